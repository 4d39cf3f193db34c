"""Preemption: SIGTERM / Ctrl-C finish the current step, save, and end the run cleanly.

Slurm and Kubernetes send SIGTERM before they kill; a terminal sends SIGINT (Ctrl-C) to every
process of the job. A signal only sets a flag: the step in flight finishes, then all ranks agree
(one tiny all-reduce per step) to stop at the same step, save a checkpoint and return
``{"interrupted": signum, ...}``; :class:`Interrupted` carries that to the user as one line with the
resume command and exit code 128 + signum (143 / 130). A second signal aborts at once.

The launcher (the ``hfpipe finetune`` process) does not forward a first signal as a signal (under
Slurm or a terminal the workers got it already, and a forwarded copy would count as the second);
it writes a ``stop`` file into the run's control folder, which every rank checks each step.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

__all__ = ["CONTROL_ENV", "Interrupted", "StopRequest", "LauncherSignals", "exit_code"]

CONTROL_ENV = "HFPIPE_CONTROL_DIR"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's code for a run ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


class Interrupted(Exception):
    """The run stopped on a signal after saving; the message says how to resume."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        name = signal.Signals(self.signum).name
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint saved"
        super().__init__(f"{name} after step {step}: {saved}; resume with --resume auto")

    @property
    def code(self) -> int:
        return exit_code(self.signum)


class StopRequest:
    """A worker's view of stop requests: its own signals and the launcher's ``stop`` file."""

    def __init__(self, device) -> None:
        self.device = device
        self.signum = 0
        self._old: dict[int, object] = {}
        control = os.environ.get(CONTROL_ENV)
        self._file = Path(control) / "stop" if control else None

    def install(self) -> "StopRequest":
        """Catch SIGTERM and SIGINT (main thread only); a second one ends the process at once."""
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:
            os._exit(exit_code(signum))  # the user insists: no save, no cleanup, no traceback
        self.signum = signum

    def _local(self) -> int:
        if not self.signum and self._file is not None and self._file.is_file():
            try:
                self.signum = int(self._file.read_text().strip() or signal.SIGTERM)
            except ValueError:
                self.signum = int(signal.SIGTERM)
        return self.signum

    def agreed(self) -> int:
        """Collective: the signal any rank got (0 if none), so all ranks stop at the same step."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self._local()], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


class LauncherSignals:
    """In the launcher: the first SIGTERM/SIGINT asks the workers to stop via the control folder;
    the second kills them (their pids are in the folder) and exits at once."""

    def __init__(self, control: Path) -> None:
        self.control = Path(control)
        self.signum = 0
        self._old: dict[int, object] = {}

    def __enter__(self) -> "LauncherSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        if self.signum:
            for pid_file in self.control.glob("pid-*"):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            shutil.rmtree(self.control, ignore_errors=True)
            os._exit(exit_code(signum))
        self.signum = signum
        (self.control / "stop").write_text(str(int(signum)))
