"""Start local worker processes through torch's elastic launcher (what torchrun uses).

``hfpipe finetune --pp 4`` calls :func:`launch` so nobody types torchrun; the tests use it to run
real gloo processes on localhost. Under torchrun or srun the processes already exist and this
module is not used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["launch", "check_launch", "say_phase", "LOG_LEVEL_ENV"]

log = logging.getLogger(__name__)

#: The launcher's pid, for its workers: they must not outlive it (kill -9 of the launcher).
LAUNCHER_ENV = "HFPIPE_LAUNCHER_PID"
_QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
#: The launcher's log level (``hfpipe --log-level``), for its workers: they log at it on rank 0, and
#: at warnings (or debug, when asked) on the others.
LOG_LEVEL_ENV = "HFPIPE_LOG_LEVEL"
_PHASE = "phase"  # in the control folder: what rank 0 is doing, for the launcher's ticker


def check_launch(world: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
                 threads_per_rank: int | None) -> None:
    """Refuse launch options that cannot work, before any process starts (one line each)."""
    from hfpipe.parallel.mesh import LaunchError, check_gpus

    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if world % nnodes:
        raise LaunchError(f"--nnodes {nnodes} does not divide the {world} ranks (--pp x --dp x --cp x --tp); "
                          "choose a divisor of the world size (pp * dp * cp * tp)")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}; use 0 .. {nnodes - 1}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT reachable from every node")
    if nnodes > 1:
        _check_endpoint(rdzv_endpoint)
    check_gpus(world // nnodes)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads_per_rank and threads_per_rank > cores:
        raise LaunchError(f"--threads-per-rank {threads_per_rank} exceeds the {cores} CPU cores here; "
                          "lower --threads-per-rank")


def _check_endpoint(endpoint: str) -> None:
    """HOST:PORT with a port number and a host that resolves (else nodes wait out the timeout)."""
    import socket

    from hfpipe.parallel.mesh import LaunchError

    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # [::1]:29500
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise LaunchError(f"--rdzv-endpoint {endpoint}: host {host!r} does not resolve ({e}); "
                          "give node 0's address") from None


def launch(fn: Callable, nprocs: int, *args, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads_per_rank: int | None = None,
           timeout_s: float = 900.0, worker_timeout_s: float | None = None,
           ticker: Callable | None = None) -> dict[int, object]:
    """Run ``fn(*args)`` in ``nprocs`` processes per node and return each local rank's result.

    Args:
        fn: A module-level (picklable) function.
        nprocs: Processes on this node.
        nnodes: Nodes in the job; with more than one, ``rdzv_endpoint`` (host:port) is required.
        node_rank: This node's index: its workers are global ranks ``node_rank * nprocs ..``.
        rdzv_endpoint: Rendezvous host:port; defaults to a free port on localhost. With several
            nodes, node 0 listens there (host = node 0's address), as torchrun's
            ``--master-addr/--master-port`` with ``--node-rank``.
        threads_per_rank: Torch intra-op threads per process (CPU runs).
        timeout_s: Rendezvous / join timeout.
        worker_timeout_s: The workers' collective timeout (``--timeout``), named when one hangs.
        ticker: Makes the context manager that says, with the time so far, what the workers do
            before they print on their own: called with a function returning that text
            (:class:`hfpipe.progress.ticker.Ticker`; ``None``: silent). "starting N worker
            processes", then what rank 0 tells by :func:`say_phase`, until it says ``None``.

    Raises:
        WorkerError: a rank found a user error (its one-line message, as a preflight error).
        WorkerFailed: a rank crashed, was killed or timed out (one line naming it);
            with ``HFPIPE_DEBUG=1``, torch's ``ChildFailedError`` itself.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hfpipe.parallel.mesh import LaunchError
    from hfpipe.parallel.signals import CONTROL_ENV, LauncherSignals
    from hfpipe.parallel.worker_errors import debug, raise_from_failures

    check_launch(nprocs * nnodes, nnodes, node_rank, rdzv_endpoint, threads_per_rank)
    if nnodes == 1 and rdzv_endpoint:  # two single-node runs must never join each other
        log.warning("--rdzv-endpoint %s ignored: it is only used with --nnodes > 1", rdzv_endpoint)
        rdzv_endpoint = None
    env_threads = str(threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs))
    os.environ.setdefault("OMP_NUM_THREADS", env_threads)
    # Several nodes meet by torch's static rendezvous: ranks follow --node-rank (c10d's dynamic
    # one numbers nodes by arrival), and every node must name the same run (no random id).
    multi = nnodes > 1
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs,
        run_id=f"hfpipe-{rdzv_endpoint}" if multi else f"hfpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static" if multi else "c10d",
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        rdzv_configs={"timeout": int(timeout_s), **({"rank": node_rank} if multi else {})},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="localhost" if nnodes == 1 else None,
        signals_to_handle="SIGQUIT",  # SIGTERM/SIGINT/SIGHUP: LauncherSignals asks workers to save first
    )
    control = Path(tempfile.mkdtemp(prefix="hfpipe-control-"))
    old_env = {k: os.environ.get(k) for k in (CONTROL_ENV, LAUNCHER_ENV, "PYTHONWARNINGS", LOG_LEVEL_ENV)}
    os.environ[CONTROL_ENV] = str(control)  # spawned workers inherit it
    if old_env[LOG_LEVEL_ENV] is None:  # --log-level reaches the workers (hfpipe.train.runner reads it)
        os.environ[LOG_LEVEL_ENV] = logging.getLevelName(logging.getLogger("hfpipe").getEffectiveLevel())
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # they die with this process (_die_with_launcher)
    # A second signal ends this process at once; multiprocessing's resource tracker would then
    # warn about the workers' semaphores on the console, after the one line that says what happened.
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [old_env["PYTHONWARNINGS"], _QUIET_TRACKER]))
    if multi:  # the rendezvous can wait for the whole timeout: say so before it starts
        log.info("node %d of %d: %s node 0 at %s (up to %d s)", node_rank, nnodes,
                 "waiting for the other nodes as" if node_rank == 0 else "joining", rdzv_endpoint, timeout_s)
    try:
        with LauncherSignals(control), _quiet_elastic(not debug()), _phase_ticker(control, ticker, nprocs):
            return elastic_launch(config, _Entry(fn, threads_per_rank))(*args)
    except ChildFailedError as e:
        raise_from_failures(control, e, nprocs * nnodes, worker_timeout_s)
    except _rendezvous_errors() as e:
        if not multi:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint}: the {nnodes} nodes did not meet within {timeout_s:g} s "
                          f"({type(e).__name__}: {first}); check that node 0 runs, its address and port, "
                          "and the firewall") from None
    finally:
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(control, ignore_errors=True)


def say_phase(text: str | None) -> None:
    """From rank 0 of a launched run: what it does now (``None``: its own lines show progress from here).

    The launcher's ticker says it with the time so far; under torchrun (no launcher) rank 0 logs it.
    """
    from hfpipe.parallel.signals import CONTROL_ENV

    if os.environ.get("RANK", "0") != "0":
        return
    control = os.environ.get(CONTROL_ENV)
    if not control or not Path(control).is_dir():
        if text:
            log.info("%s...", text)
        return
    tmp = Path(control) / f".{_PHASE}.tmp"
    tmp.write_text(text or "")
    os.replace(tmp, Path(control) / _PHASE)  # whole, never half-written, for the launcher's reads


def _phase_ticker(control: Path, ticker: Callable | None, nprocs: int):
    """The launcher's ticker over the workers' silent start, or nothing without ``ticker``."""
    if ticker is None:
        return contextlib.nullcontext()

    def what() -> str | None:
        try:
            said = (control / _PHASE).read_text()
        except OSError:
            return f"starting {nprocs} worker processes"
        return said or None

    return ticker(what)


@contextlib.contextmanager
def _quiet_elastic(quiet: bool):
    """Keep torch-elastic's failure logs (kilobytes per failed rank) off the console unless --debug."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [lg.level for lg in loggers]
    if quiet:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _die_with_launcher() -> None:
    """Make this worker end when its launcher does, even by kill -9 (which no handler sees).

    Linux delivers SIGKILL to a process whose parent dies once it asked (``PR_SET_PDEATHSIG``);
    elsewhere a watchdog thread polls the parent. Either way, a launcher already gone is checked
    once the request is in (it may have died just before).
    """
    import signal
    import threading
    import time

    launcher = int(os.environ.get(LAUNCHER_ENV) or 0)
    if not launcher or os.getppid() != launcher:  # started by torchrun/srun, or not by hfpipe
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        asked = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        asked = False
    if os.getppid() != launcher:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os._exit(1)

    if not asked:
        threading.Thread(target=watch, name="hfpipe-launcher-watch", daemon=True).start()


def _function(module: str, qualname: str) -> Callable:
    import importlib

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def _rendezvous_errors() -> tuple[type, ...]:
    """What torch raises when nodes never meet: the TCP store's and elastic's rendezvous errors."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None),
                             RendezvousError) if t is not None)


def _dcp_exception() -> type:
    """DCP's CheckpointException: a BaseException, so ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class _Entry:
    """Picklable wrapper that sets the thread count in the child before calling ``fn``."""

    def __init__(self, fn: Callable, threads: int | None) -> None:
        # By name, imported in the worker once its signal handlers are in: unpickling the function
        # itself would import torch first, seconds in which a Ctrl-C is a KeyboardInterrupt dump.
        self.fn = (fn.__module__, fn.__qualname__)
        self.threads = threads
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "hfpipe_worker")

    def __call__(self, *args):
        import sys

        from hfpipe.parallel.signals import CONTROL_ENV, StartupInterrupted, read_stop, stop_at_once
        from hfpipe.parallel.worker_errors import debug, record_failure, record_interrupt

        control = Path(os.environ[CONTROL_ENV]) if os.environ.get(CONTROL_ENV) else None
        _die_with_launcher()
        try:
            with stop_at_once(ending=True):  # until the run loop takes the signals over (StopRequest)
                if control is not None:  # the pid first, then the stop file: no signal falls between
                    (control / f"pid-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
                    if read_stop(control / "stop"):
                        raise StartupInterrupted(read_stop(control / "stop"))
                return self._load()(*args)
        except StartupInterrupted as e:
            sys.exit(record_interrupt(control, e.signum))
        except (Exception, _dcp_exception()) as e:  # noqa: BLE001 - reported to the launcher in one line
            code = record_failure(control, e, stopping=(control is not None and (control / "stop").exists()))
            if debug():
                raise
            sys.exit(code)  # quietly: the launcher tells the user

    def _load(self) -> Callable:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        return _function(*self.fn)
