"""The cross entropy on logits split over the vocabulary (``--tp``), never gathered whole.

torch only: the chunked head loss (:mod:`hfpipe.loss.chunked`) takes it for a tp head's logits, and where a
rank's slice starts is the DTensor's own rule (``Shard.local_shard_size_and_offset``, as ``torch.chunk``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

__all__ = ["loss_dtype", "vocab_parallel_loss_sum", "vocab_parallel_token_losses"]


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss is taken in from logits of ``dtype``: fp32 (bf16 logits upcast, as transformers' loss
    does), or the logits' own where wider: an fp64 run stays fp64 end to end, so that it can tell reordered
    sums (which vanish there) from a real error (which does not)."""
    return torch.promote_types(dtype, torch.float32)


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                            weights: torch.Tensor | None = None) -> torch.Tensor:
    """``cross_entropy(logits, targets, reduction="sum")`` on vocabulary-split logits, never gathered;
    with ``weights`` (shaped as ``targets``) each token's loss is multiplied by its weight first."""
    if weights is None and not isinstance(logits, DTensor):  # the token loss's own form, summed by torch in one go
        return F.cross_entropy(logits.to(loss_dtype(logits.dtype)).flatten(0, -2),
                               targets.flatten().to(logits.device), ignore_index=ignore_index, reduction="sum")
    tokens = vocab_parallel_token_losses(logits, targets, ignore_index)
    return tokens.sum() if weights is None else (tokens * weights.flatten().to(tokens)).sum()


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each token's ``cross_entropy`` (``reduction="none"``, flattened; 0 where ignored), the logits never gathered.

    Args:
        logits: (..., V) as the tp head returns them: a DTensor sharded on its last dim (a plain
            tensor is taken as whole logits).
        targets: (...) token ids, ``ignore_index`` where no loss is taken.
        ignore_index: The label of a token without loss (:data:`hfpipe.loss.tokens.IGNORE_INDEX`, passed in so
            that this module imports nothing of hfpipe: it sits on the house's floor).

    Returns:
        float32 (N,) (fp64 for fp64 logits: :func:`loss_dtype`), the same on every tp rank (a per-sequence
        objective sums them by row). Each rank's gradient goes to its own slice of the logits.
    """
    targets = targets.flatten().to(logits.device)
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.to(loss_dtype(logits.dtype)).flatten(0, -2), targets, ignore_index=ignore_index,
                               reduction="none")
    (placement,) = logits.placements
    if not isinstance(placement, Shard) or placement.dim % logits.ndim != logits.ndim - 1:
        raise ValueError(f"vocab-parallel loss needs logits split on the vocabulary, got {placement}")
    mesh = logits.device_mesh
    local = logits.to_local()
    local = local.to(loss_dtype(local.dtype)).flatten(0, -2)  # (N, V/tp)
    _, start = Shard.local_shard_size_and_offset(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    return _VocabParallelCrossEntropy.apply(local, targets, int(start), ignore_index, mesh.get_group())


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
        loss = torch.where(valid, total.log() - picked, torch.zeros_like(total))  # (N,)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        out.mul_((valid.to(out.dtype) * grad).unsqueeze(-1))  # grad: (N,), one per token
        return out, None, None, None, None
