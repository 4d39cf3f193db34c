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

__all__ = ["launch", "check_launch"]

log = logging.getLogger(__name__)


def check_launch(world: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
                 threads_per_rank: int | None) -> None:
    """Refuse launch options that cannot work, before any process starts (one line each)."""
    from hfpipe.parallel.mesh import LaunchError

    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if world % nnodes:
        raise LaunchError(f"--nnodes {nnodes} does not divide the {world} ranks (--pp x --dp); "
                          "choose a divisor of pp * dp")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}; use 0 .. {nnodes - 1}")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT reachable from every node")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads_per_rank and threads_per_rank > cores:
        raise LaunchError(f"--threads-per-rank {threads_per_rank} exceeds the {cores} CPU cores here; "
                          "lower --threads-per-rank")


def launch(fn: Callable, nprocs: int, *args, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads_per_rank: int | None = None,
           timeout_s: float = 900.0, worker_timeout_s: float | None = None) -> dict[int, object]:
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

    Raises:
        WorkerError: a rank found a user error (its one-line message, as a preflight error).
        WorkerFailed: a rank crashed, was killed or timed out (one line naming it);
            with ``HFPIPE_DEBUG=1``, torch's ``ChildFailedError`` itself.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM/SIGINT: LauncherSignals asks workers to save first
    )
    control = Path(tempfile.mkdtemp(prefix="hfpipe-control-"))
    old_env = os.environ.get(CONTROL_ENV)
    os.environ[CONTROL_ENV] = str(control)  # spawned workers inherit it
    try:
        with LauncherSignals(control), _quiet_elastic(not debug()):
            return elastic_launch(config, _Entry(fn, threads_per_rank))(*args)
    except ChildFailedError as e:
        raise_from_failures(control, e, nprocs * nnodes, worker_timeout_s)
    finally:
        if old_env is None:
            os.environ.pop(CONTROL_ENV, None)
        else:
            os.environ[CONTROL_ENV] = old_env
        shutil.rmtree(control, ignore_errors=True)


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


def _dcp_exception() -> type:
    """DCP's CheckpointException: a BaseException, so ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class _Entry:
    """Picklable wrapper that sets the thread count in the child before calling ``fn``."""

    def __init__(self, fn: Callable, threads: int | None) -> None:
        self.fn, self.threads = fn, threads
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "hfpipe_worker")

    def __call__(self, *args):
        import sys

        import torch

        from hfpipe.parallel.signals import CONTROL_ENV
        from hfpipe.parallel.worker_errors import debug, record_failure

        if self.threads:
            torch.set_num_threads(self.threads)
        control = Path(os.environ[CONTROL_ENV]) if os.environ.get(CONTROL_ENV) else None
        if control is not None:
            (control / f"pid-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        try:
            return self.fn(*args)
        except (Exception, _dcp_exception()) as e:  # noqa: BLE001 - reported to the launcher in one line
            code = record_failure(control, e, stopping=(control is not None and (control / "stop").exists()))
            if debug():
                raise
            sys.exit(code)  # quietly: the launcher tells the user
