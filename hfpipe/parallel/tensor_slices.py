"""A tensor-parallel rank's part of a whole tensor.

A floor module (torch only): the loader (:mod:`hfpipe.pipeline.load`) and an FP8 base's split
(:mod:`hfpipe.quant.tensor`) use these without pulling in the plans of :mod:`hfpipe.parallel.tensor_plan`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["as_dtensor", "local_slice", "shard_ranges"]


def shard_ranges(shape, placement: Placement, tp_rank: int, tp_size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Which part of a whole tensor of ``shape`` rank ``tp_rank`` holds: ``(dim, [(start, stop), ...])``.

    The local tensor is the ranges along ``dim`` concatenated in order (one range for ``Shard``;
    one per packed block for ``_StridedShard``, e.g. the gate and the up half of ``gate_up_proj``).
    ``None`` for a replicated tensor (the whole of it). Sizes split as ``torch.chunk`` does.
    """
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, (Shard, _StridedShard)):
        raise ValueError(f"no local slice for placement {placement}")
    dim = placement.dim % len(shape)
    blocks = placement.split_factor if isinstance(placement, _StridedShard) else 1
    if shape[dim] % blocks:
        raise ValueError(f"dim {dim} of {tuple(shape)} is not {blocks} packed blocks")
    block = shape[dim] // blocks
    part = -(-block // tp_size)  # ceil, as torch.chunk
    lo, hi = min(tp_rank * part, block), min((tp_rank + 1) * part, block)
    return dim, [(b * block + lo, b * block + hi) for b in range(blocks)]


def local_slice(full: torch.Tensor, placement: Placement, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s local tensor of ``full`` (what ``DTensor.to_local()`` holds there)."""
    where = shard_ranges(full.shape, placement, tp_rank, tp_size)
    if where is None:
        return full
    dim, ranges = where
    parts = [full.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def as_dtensor(local: torch.Tensor, tp_mesh, placement: Placement, shape) -> DTensor:
    """Wrap this rank's ``local`` part of a whole tensor of ``shape`` as a DTensor, without communication."""
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, tp_mesh, [placement], run_check=False, shape=shape, stride=stride)
