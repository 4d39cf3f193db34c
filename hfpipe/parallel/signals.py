"""Signals: SIGTERM, Ctrl-C (SIGINT) and SIGHUP end a run in one line, with exit 143, 130 or 129.

Slurm and Kubernetes send SIGTERM before they kill; a terminal sends SIGINT (Ctrl-C) to every
process of the job, and SIGHUP when it closes. What a signal does depends on when it comes:

- **Before training** (checks, start-up, loading: nothing worth saving yet), it stops at once:
  :func:`stop_at_once` makes it raise :class:`StartupInterrupted` wherever the process is, so
  ``finally`` blocks remove what was half-written (an export's temporary folder too). A worker in
  start-up does the same; the launcher passes it on to such workers.
- **During training**, it only sets a flag: the step in flight finishes, then all ranks agree (one
  tiny all-reduce per step) to stop at the same step, save a checkpoint and return
  ``{"interrupted": signum, ...}``; :class:`Interrupted` carries that to the user as one line with
  the resume command. A worker says it is training with a ``training-rank<r>`` file in the
  control folder.
- **A second signal** aborts at once: no save, one line, the same exit code.

The launcher (the ``hfpipe finetune`` process) does not forward a signal to a training worker
(under Slurm or a terminal the workers got it already, and a forwarded copy would count as the
second); it writes a ``stop`` file into the run's control folder, which every rank checks each step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

__all__ = ["CONTROL_ENV", "SIGNALS", "Interrupted", "StartupInterrupted", "StopRequest", "LauncherSignals",
           "exit_code", "stop_at_once"]

CONTROL_ENV = "HFPIPE_CONTROL_DIR"
#: The signals that end a run politely (SIGHUP: the terminal went away).
SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None)


def exit_code(signum: int) -> int:
    """The shell's code for a run ended by ``signum``: 143 SIGTERM, 130 SIGINT, 129 SIGHUP."""
    return 128 + int(signum)


def _name(signum: int) -> str:
    return signal.Signals(int(signum)).name


class Interrupted(Exception):
    """The run stopped on a signal; the message says what was saved and how to go on.

    ``step`` is None when it stopped before its first step (nothing was written).
    """

    def __init__(self, signum: int, step: int | None, checkpoint: str | None, *, late: bool = False) -> None:
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        if step is None and late:
            text = f"{_name(signum)} after training, during the final export: its checkpoints stay"
        elif step is None:
            text = f"{_name(signum)} before the first step; nothing was written"
        else:
            saved = f"saved {checkpoint}" if checkpoint else "no checkpoint saved"
            text = f"{_name(signum)} after step {step}: {saved}; resume with --resume auto"
        super().__init__(text)

    @property
    def code(self) -> int:
        return exit_code(self.signum)


class StartupInterrupted(BaseException):
    """A signal before training: unwinds like KeyboardInterrupt (``except Exception`` lets it by)."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(_name(signum))

    @property
    def code(self) -> int:
        return exit_code(self.signum)


class _RaiseOnce:
    """A handler raising :class:`StartupInterrupted` at the first signal only: a terminal's Ctrl-C
    and the launcher's copy of it must not interrupt the unwinding the first one started."""

    def __init__(self) -> None:
        self.raised = False

    def __call__(self, signum, frame) -> None:
        if not self.raised:
            self.raised = True
            raise StartupInterrupted(signum)


@contextlib.contextmanager
def stop_at_once(ending: bool = False):
    """While inside, SIGTERM/SIGINT/SIGHUP raise :class:`StartupInterrupted` (main thread only).

    ``ending``: the process ends once a signal stopped it (a worker), so later signals are ignored from then
    on instead of meeting the old handlers: a terminal's Ctrl-C and the launcher's copy of it arrive apart,
    and the copy would otherwise be a ``KeyboardInterrupt`` traceback printed while the worker exits.
    """
    old = {}
    handler = _RaiseOnce()
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, signal.SIG_IGN if ending and handler.raised else previous)


class StopRequest:
    """A training worker's view of stop requests: its own signals and the launcher's ``stop`` file."""

    def __init__(self, device) -> None:
        self.device = device
        self.signum = 0
        self._old: dict[int, object] = {}
        control = os.environ.get(CONTROL_ENV)
        self._control = Path(control) if control else None
        self._file = self._control / "stop" if control else None

    def install(self) -> "StopRequest":
        """Catch the signals (main thread only); a second one ends the process at once."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        if self._control is not None and self._control.is_dir():  # the launcher stops forwarding
            (self._control / f"training-rank{os.environ.get('RANK', '0')}").touch()
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:
            os._exit(exit_code(signum))  # the user insists: no save, no cleanup (the launcher says so)
        self.signum = signum

    def _local(self) -> int:
        if not self.signum and self._file is not None and self._file.is_file():
            self.signum = read_stop(self._file) or int(signal.SIGTERM)
        return self.signum

    def agreed(self) -> int:
        """Collective: the signal any rank got (0 if none), so all ranks stop at the same step."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self._local()], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def read_stop(path: Path) -> int:
    """The signal number a ``stop`` file holds (0 if none, or unreadable)."""
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


#: How long a worker still starting has, after the launcher passed it a signal, to end on its own before the
#: launcher kills it: one blocked in C++ (joining the process group while a peer never arrives, a store wait)
#: cannot run its Python handler until the call returns, which may be the whole --timeout away; nothing it
#: holds then is half-written (workers write nothing before training).
STARTUP_GRACE_S = 5.0


class LauncherSignals:
    """In the launcher: the first signal asks the workers to stop (the ``stop`` file; workers still
    starting get the signal itself, and are killed if they have not ended :data:`STARTUP_GRACE_S` later);
    the second kills them and exits at once, in one line."""

    def __init__(self, control: Path, grace_s: float = STARTUP_GRACE_S) -> None:
        self.control = Path(control)
        self.signum = 0
        self.grace_s = grace_s
        self._old: dict[int, object] = {}

    def __enter__(self) -> "LauncherSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _pids(self) -> dict[str, int]:
        out = {}
        for pid_file in self.control.glob("pid-*"):
            with contextlib.suppress(OSError, ValueError):
                out[pid_file.name[4:]] = int(pid_file.read_text())
        return out

    def _handle(self, signum, frame) -> None:
        if self.signum:
            for pid in self._pids().values():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.control, ignore_errors=True)
            with contextlib.suppress(OSError):
                sys.stderr.write(f"error: a second {_name(signum)}: the workers were killed without saving; "
                                 "the last complete checkpoint stays (--resume auto continues from it)\n")
                sys.stderr.flush()
            os._exit(exit_code(signum))
        self.signum = signum
        with contextlib.suppress(OSError):  # written before the pids are read: no worker misses it
            (self.control / "stop").write_text(str(int(signum)))
        starting = self._starting()
        for pid in starting:  # stop it now
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        if starting:
            timer = threading.Timer(self.grace_s, self._kill_starting, args=(set(starting),))
            timer.daemon = True
            timer.start()

    def _starting(self) -> list[int]:
        """The workers not training yet (no ``training-rank<r>`` file)."""
        return [pid for rank, pid in self._pids().items() if not (self.control / f"training-rank{rank}").exists()]

    def _kill_starting(self, signalled: set[int]) -> None:
        """Kill what is left of the workers signalled in start-up: the launcher then tells of the signal."""
        for pid in set(self._starting()) & signalled:
            if _child_of_this_process(pid):  # never a process that took a dead worker's pid
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _child_of_this_process(pid: int) -> bool:
    """Whether ``pid`` is a live child of this process (the launcher's workers are; Linux's /proc says so)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return not Path("/proc/self").exists() and _exists(pid)  # no /proc (not Linux): the pid is all we have
    except OSError:
        return False
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return state not in ("Z", "X") and int(parent) == os.getpid()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
