"""Tensors split over tp in strided runs, handed to DCP as a plain split of the same global tensor.

Why: transformers' packed column split (``PackedColwiseParallel``, which hfpipe uses for a MoE's fused
``gate_up_proj`` expert stacks under ``--tp`` without ``--ep``) gives each tp rank its rows of *both*
halves of the packed tensor, which DTensor describes as ``_StridedShard(dim, split_factor=2)``. DCP
(torch 2.13) describes a rank's piece by one offset and one size, so it writes those two runs as one
block that overlaps the next rank's, and the save fails ("overlapping chunks"). A checkpoint therefore
sees such tensors, parameters and optimizer state alike, redistributed to ``Shard(dim)`` (one collective
over tp; the global tensor, its name and its shape are unchanged, so the checkpoint reshards to any
layout), and a load fills those plain-split copies, then puts them back in the parameter's own layout.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["plain_split", "restore"]


def plain_split(state: dict) -> list[tuple[dict, str, tuple]]:
    """Replace, in nested ``state``, every DTensor split in strided runs by a ``Shard`` copy of it.

    Returns what :func:`restore` needs to put the loaded copies back: (dict, key, original placements).
    """
    changed = []
    for holder, key, value in list(_leaves(state)):
        if isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements):
            plain = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements)
            holder[key] = value.redistribute(value.device_mesh, plain)
            changed.append((holder, key, value.placements))
    return changed


def restore(changed: list[tuple[dict, str, tuple]]) -> None:
    """After a load into :func:`plain_split`'s copies: each back in its tensor's strided layout."""
    for holder, key, placements in changed:
        holder[key] = holder[key].redistribute(holder[key].device_mesh, placements)


def _leaves(d: dict):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield d, key, value
