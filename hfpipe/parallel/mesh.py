"""Process groups, device choice and the (dp, pp) mesh. No global state: a :class:`Dist` is passed."""

from __future__ import annotations

import datetime
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfpipe.errors import HfpipeError

__all__ = ["Dist", "LaunchError", "first_host", "init_distributed", "pick_device", "in_launched_env", "launched_node"]

log = logging.getLogger(__name__)


class LaunchError(HfpipeError):
    """The processes started do not fit the requested mesh, or the launch options are incomplete."""


def pick_device(local_rank: int = 0) -> tuple[torch.device, str]:
    """CUDA with NCCL when a GPU is present, else CPU with gloo."""
    if torch.cuda.is_available():
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
    """This process's place in the (dp, pp) mesh.

    Attributes:
        rank: Global rank.
        world: World size.
        device: The device this rank computes on.
        pp, dp: Mesh sizes.
        pp_rank, dp_rank: Coordinates in the mesh.
        pp_group, dp_group: Process groups along each dimension (``dp_group`` is ``None`` if dp == 1).
        mesh: The DeviceMesh ``("dp", "pp")``.
    """

    rank: int
    world: int
    device: torch.device
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: object
    dp_group: object
    mesh: object

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline rank ``pp_rank`` in this rank's dp replica."""
        return self.dp_rank * self.pp + pp_rank


def init_distributed(pp: int, dp: int = 1, *, timeout_s: float = 600.0) -> Dist:
    """Join (or create, for a single process) the default group and build the mesh.

    Raises:
        ValueError: the world size is not pp * dp.
    """
    from torch.distributed.device_mesh import init_device_mesh

    _env_from_slurm()
    if "RANK" not in os.environ:  # a plain single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device, backend = pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != pp * dp:
        raise LaunchError(f"--pp {pp} x --dp {dp} = {pp * dp} processes, but {world} were started; "
                         "start pp*dp processes or change --pp/--dp")
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_group = mesh.get_group("dp") if dp > 1 else None
    return Dist(rank, world, device, pp, dp, rank % pp, rank // pp, mesh.get_group("pp"), dp_group, mesh)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
