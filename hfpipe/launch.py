"""Start local worker processes through torch's elastic launcher (what torchrun uses).

``hfpipe finetune --pp 4`` calls :func:`launch` so nobody types torchrun; the tests use it to run
real gloo processes on localhost. Under torchrun or srun the processes already exist and this
module is not used.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

__all__ = ["launch"]

log = logging.getLogger(__name__)


def launch(fn: Callable, nprocs: int, *args, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads_per_rank: int | None = None,
           timeout_s: float = 900.0) -> dict[int, object]:
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

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes > 1 and not rdzv_endpoint:
        from hfpipe.distributed import LaunchError

        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT reachable from every node")
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
    )
    return elastic_launch(config, _Entry(fn, threads_per_rank))(*args)


class _Entry:
    """Picklable wrapper that sets the thread count in the child before calling ``fn``."""

    def __init__(self, fn: Callable, threads: int | None) -> None:
        self.fn, self.threads = fn, threads
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "hfpipe_worker")

    def __call__(self, *args):
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        return self.fn(*args)
