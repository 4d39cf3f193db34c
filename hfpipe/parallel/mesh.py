"""Process groups, device choice and the world mesh of :class:`~hfpipe.parallel.dims.ParallelDims`.

No global state: a :class:`Dist` is passed.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hfpipe.errors import ParallelError
from hfpipe.parallel.dims import EXPERT_DIMS, MESH_DIMS, ParallelDims

__all__ = ["Dist", "LaunchError", "check_gpus", "first_host", "init_distributed", "pick_device", "in_launched_env",
           "launched_node", "visible_gpus"]

log = logging.getLogger(__name__)


class LaunchError(ParallelError):
    """The processes started do not fit the requested mesh, or the launch options are incomplete."""


def visible_gpus() -> int:
    """The GPUs ranks started from here will see (none once CUDA_VISIBLE_DEVICES is set to '', which this
    process may do after it first asked CUDA: its count is cached, the ranks' is not)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def check_gpus(ranks_here: int) -> None:
    """One rank per GPU: NCCL refuses two ranks on one device ("invalid usage", measured on an H200 with
    NCCL 2.28), so more ranks on a node than its GPUs is refused before a process group starts."""
    gpus = visible_gpus()
    if 0 < gpus < ranks_here:
        raise LaunchError(f"{ranks_here} ranks on this node (pp x dp x cp x tp) but {gpus} GPU(s) visible: NCCL "
                          f"runs one rank per GPU; lower the degrees to {gpus} rank(s) per node, or run every "
                          "rank on CPU with CUDA_VISIBLE_DEVICES=''")


def pick_device(local_rank: int = 0) -> tuple[torch.device, str]:
    """CUDA with NCCL when a GPU is present, else CPU with gloo."""
    if torch.cuda.is_available():
        check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        idx = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx), "nccl"
    return torch.device("cpu"), "gloo"


def in_launched_env() -> bool:
    """Whether torchrun/elastic (RANK, WORLD_SIZE) or srun (SLURM_PROCID) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def launched_node() -> tuple[int, int, int]:
    """(nodes, this node's rank, local rank) of a torchrun- or srun-started worker."""
    env = os.environ
    if "GROUP_RANK" in env:  # torchrun / torch elastic
        return int(env.get("GROUP_WORLD_SIZE", "1")), int(env["GROUP_RANK"]), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or "1"
        return int(nodes), int(env.get("SLURM_NODEID", "0")), int(env.get("SLURM_LOCALID", "0"))
    return 1, 0, int(env.get("LOCAL_RANK", "0"))


def _env_from_slurm() -> None:
    """Map srun's variables onto torch's, so one code path serves both launchers."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "localhost")
        os.environ["MASTER_ADDR"] = first_host(nodes)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-08,10],cpu1`` -> ``gpu07``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return "localhost"
    prefix, ranges = m.groups()
    return prefix + re.split(r"[,-]", ranges)[0] if ranges else prefix


@dataclass
class Dist:
    """This rank's place in the world mesh, and the process groups each reduction runs over.

    The layout is :class:`~hfpipe.parallel.dims.ParallelDims`'s (``pp, dp, cp, tp``, tp innermost); this
    object only builds its groups, by the name of what each is for.

    Attributes:
        rank: Global rank.
        device: The device this rank computes on.
        dims: The degrees of every axis.
        mesh: The world DeviceMesh, dimensions :data:`~hfpipe.parallel.dims.MESH_DIMS`.
    """

    rank: int
    device: torch.device
    dims: ParallelDims
    mesh: object
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)["pp"]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)["dp"]

    @property
    def pp_group(self):
        """The pipeline: activations and gradients between stages, the loss broadcast."""
        return self.mesh.get_group("pp")

    @property
    def cp_group(self):
        """The context-parallel ranks of one replica: K and V gathered over it (hfpipe.parallel.context)."""
        return self.mesh.get_group("cp")

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank)["cp"]

    @property
    def batch_group(self):
        """Ranks that saw different tokens of one step (dp, and cp once it lands): losses and token
        counts are summed over it. ``None`` when this rank is alone in it."""
        return None if self.dims.dp * self.dims.cp == 1 else self._submesh(self.dims.batch_dims).get_group()

    @property
    def fsdp_mesh(self):
        """The mesh FSDP2 shards a stage's parameters over (it averages their gradients over it)."""
        return self._submesh(self.dims.fsdp_dims)

    def _submesh(self, names: tuple[str, ...]):
        if len(names) == 1:
            return self.mesh[names[0]]
        key = "_".join(names)
        if key not in self._cache:
            self._cache[key] = self.mesh[names]._flatten(key)
        return self._cache[key]

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline rank ``pp_rank`` in this rank's replica."""
        return self.dims.pp_peer(self.rank, pp_rank)

    def expert_mesh(self):
        """The world's ranks as :data:`~hfpipe.parallel.dims.EXPERT_DIMS` (collective on first use)."""
        if "expert" not in self._cache:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(self.dims.world).view(self.dims.expert_shape)
            self._cache["expert"] = DeviceMesh(self.device.type, ranks, mesh_dim_names=EXPERT_DIMS)
        return self._cache["expert"]

    def expert_replica_mesh(self):
        """The ranks holding the same routed experts, which FSDP2 shards them over and sums their gradients
        over (:attr:`~hfpipe.parallel.dims.ParallelDims.expert_replica_dims`: edp, x cp, x tp), one dimension."""
        experts, names = self.expert_mesh(), self.dims.expert_replica_dims
        if len(names) == 1:
            return experts[names[0]]
        key = "_".join(names)
        if key not in self._cache:
            self._cache[key] = experts[names]._flatten(key)
        return self._cache[key]

    def tied_group(self, first: int, last: int):
        """This rank's {first, last} pipeline-rank pair for a tied embedding's two copies, or ``None``
        (collective: every rank creates every pair's group, in the same order)."""
        mine = None
        for ranks in self.dims.tied_pairs(first, last):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine


def init_distributed(dims: ParallelDims | int, dp: int = 1, *, timeout_s: float = 600.0) -> Dist:
    """Join (or create, for a single process) the default group and build the world mesh.

    ``dims`` is the :class:`ParallelDims`, or (as before it existed) the pipeline size with ``dp`` beside it.

    Raises:
        LaunchError: the world size is not the product of the degrees.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not isinstance(dims, ParallelDims):
        dims = ParallelDims(pp=dims, dp=dp)
    _env_from_slurm()
    if "RANK" not in os.environ:  # a plain single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device, backend = pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    _end_group_at_exit()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world:
        sizes = " x ".join(f"--{n} {getattr(dims, n)}" for n in MESH_DIMS if getattr(dims, n) > 1 or n == "pp")
        raise LaunchError(f"{sizes} = {dims.world} processes, but {world} were started; "
                          "start that many processes or change the degrees")
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=MESH_DIMS)
    return Dist(rank, device, dims, mesh)


_ENDS_AT_EXIT = False


def _end_group_at_exit() -> None:
    """End the process group at exit, also one the script or transformers started (``TrainingArguments``
    starts it under torchrun, and nobody ends it). Left to the interpreter's finalisation, gloo's worker
    threads can still hold tensors and abort the rank with "terminate called without an active exception"
    (seen once in CI after PipelineTrainer.save_model; pytorch#179291), and NCCL warns about leaked resources
    on every rank (seen on an H200 after load_pipeline). At exit the script is done with the group.

    Ending the group is not enough: a group that a reference cycle still holds (a Trainer and its callbacks, a
    pipeline and its stages) keeps its gloo threads until the collector runs at finalization, which aborted a
    rank the same way in CI after PipelineDPOTrainer.save_model (measured there: 16 threads left after
    ``destroy_process_group``, 4 after a collection). So the exit handler also collects."""
    global _ENDS_AT_EXIT
    if not _ENDS_AT_EXIT:
        atexit.register(_destroy_at_exit)
        _ENDS_AT_EXIT = True


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # the groups that cycles hold die now, with the interpreter alive (see above)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
