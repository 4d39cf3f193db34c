"""A tensor-parallel rank's part of a whole tensor, and the cross entropy on vocabulary-split logits.

A floor module (torch only): the loader (:mod:`hfpipe.pipeline.load`) and the chunked head loss
(:mod:`hfpipe.pipeline.head_loss`) use these without pulling in the plans of
:mod:`hfpipe.parallel.tensor_plan`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["as_dtensor", "local_slice", "shard_ranges", "vocab_parallel_loss_sum"]


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


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(logits, targets, reduction="sum")`` on vocabulary-split logits, never gathered.

    Args:
        logits: (..., V) as the tp head returns them: a DTensor sharded on its last dim (a plain
            tensor is taken as whole logits).
        targets: (...) token ids, ``ignore_index`` where no loss is taken.

    Returns:
        A float32 scalar, the same on every tp rank: the summed (not averaged) loss, so the
        pipeline's division by the global token count stays as it is. Each rank's gradient goes
        to its own slice of the logits.
    """
    targets = targets.flatten().to(logits.device)
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.float().flatten(0, -2), targets, ignore_index=ignore_index, reduction="sum")
    (placement,) = logits.placements
    if not isinstance(placement, Shard) or placement.dim % logits.ndim != logits.ndim - 1:
        raise ValueError(f"vocab-parallel loss needs logits split on the vocabulary, got {placement}")
    mesh = logits.device_mesh
    local = logits.to_local().float().flatten(0, -2)  # (N, V/tp)
    start = shard_ranges(logits.shape, placement, mesh.get_local_rank(), mesh.size())[1][0][0]
    return _VocabParallelCrossEntropy.apply(local, targets, start, ignore_index, mesh.get_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy: max and sum of exp all-reduced over tp, the target
    logit taken on the rank that holds it; the backward is local (softmax - one-hot, on this slice)."""

    @staticmethod
    def forward(ctx, local, targets, start, ignore_index, group):
        valid = targets != ignore_index
        idx = targets - start
        mine = valid & (idx >= 0) & (idx < local.shape[-1])
        idx = torch.where(mine, idx, torch.zeros_like(idx))
        top = local.detach().amax(-1) if local.shape[0] else local.new_zeros(0)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = local - top.unsqueeze(-1)  # (N, V/tp), <= 0: exp cannot overflow
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        picked = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(total))
        dist.all_reduce(picked, group=group)
        loss = torch.where(valid, total.log() - picked, torch.zeros_like(total)).sum()
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        out.mul_(valid.to(out.dtype).unsqueeze(-1) * grad)
        return out, None, None, None, None
