"""The squared norm of a gradient spread over ranks, each element counted once.

A gradient element may live on one rank (a stage's, or an FSDP shard's) or on several (a parameter
replicated over an axis, such as a norm weight under tensor parallelism). Summing every rank's local
squares over the whole world, as a plain all-reduce would, counts a replicated element once per
replica. So the placements decide: a DTensor's local squares are summed over the mesh dimensions it
is *sharded* on, never over those it is replicated on; pending partial sums are reduced first (their
local values are not the gradient). Then the stages' sums add up over the pipeline group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["squared_norm"]


def squared_norm(grads, pp_group, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squares (in ``dtype``: fp32, or fp64 for an fp64 run, as ``clip_grad_norm_`` sums in the gradients'
    own dtype) of the whole gradient ``grads`` (this rank's part of every stage's).

    Every rank of a pipeline replica returns the same value. Collective over the groups the gradients
    are sharded on (within one pipeline rank: its ranks hold the same stages, so the same buckets) and
    over ``pp_group`` (``None``: none).
    """
    buckets: dict[tuple, list] = {}  # sharded mesh dims -> (groups, local squares)
    for g in grads:
        groups, local = _shards_of(g)
        key = tuple(name for name, _ in groups)
        buckets.setdefault(key, [groups, []])[1].append(torch.linalg.vector_norm(local, dtype=dtype))
    total = torch.zeros((), dtype=dtype, device=device)
    for key in sorted(buckets):  # the same order on every rank of a group
        groups, norms = buckets[key]
        sq = torch.stack(norms).pow(2).sum().to(device)
        for _, group in groups:
            dist.all_reduce(sq, group=group)
        total = total + sq
    if pp_group is not None:  # None: this rank holds every stage (pp=1)
        dist.all_reduce(total, group=pp_group)
    return total


def _shards_of(g: torch.Tensor) -> tuple[list, torch.Tensor]:
    """``([(mesh dim name, its group), ...] g is sharded on, g's local values)``."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(g, DTensor):
        return [], g
    if any(p.is_partial() for p in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    mesh, names = g.device_mesh, g.device_mesh.mesh_dim_names
    # any split counts, _StridedShard too (FSDP2's dp split of a tp-split dim 0; not a Shard subclass in torch 2.13)
    split = [not (p.is_replicate() or p.is_partial()) for p in g.placements]
    groups = [(names[i], mesh.get_group(i)) for i, s in enumerate(split) if s and mesh.size(i) > 1]
    return groups, g.to_local()
