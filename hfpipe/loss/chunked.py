"""The last stage's loss in chunks of tokens, so the full (B, T, V) logits never exist.

For a 128k vocabulary one microbatch of 4096 tokens makes 2.1 GB of fp32 logits, and as much
again for each of their log-softmax and gradients: this, not the layers, often sets the last
rank's peak memory. Here the last stage hands its final hidden states to the loss, which runs
``stage.logits`` (norm -> head -> the family's logit transforms) on a few tokens at a time.

Each chunk's backward runs right away, inside the loss's forward: the chunk's logits die before
the next chunk starts, and no logits are recomputed later (a per-chunk checkpoint would pay one
more head matmul, a third of the head's time). What is kept for the backward is the gradient of
the hidden states (B, T, H) and one summed gradient per head parameter (V, H), the same size as
the gradient the plain loss makes. Everything is plain torch autograd over the stage's own
modules, so it runs on CPU and CUDA, under FSDP2 mixed precision, and with any ``logits``. How many
tokens a chunk holds is :func:`hfpipe.loss.budget.chunk_tokens`.

A plain linear head (the common case) takes a faster path to the same result,
:mod:`hfpipe.loss.linear_head`: the loss runs the head's matmuls itself and adds each chunk's weight
gradient inside the GEMM. :func:`head_path` says which path a call takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfpipe.loss.linear_head import LinearHead, hand_on, linear_head_weight, linear_loss_sum
from hfpipe.loss.tokens import IGNORE_INDEX
from hfpipe.loss.vocab_parallel import loss_dtype, vocab_parallel_loss_sum, vocab_parallel_token_losses

__all__ = ["chunked_loss_sum", "chunked_token_losses", "head_path"]


def head_path(linear: LinearHead | None, hidden: torch.Tensor) -> str:
    """``"linear"`` when :func:`chunked_loss_sum` runs the head's matmuls itself, else ``"generic"``."""
    return "generic" if linear_head_weight(linear, hidden) is None else "linear"


def chunked_token_losses(logits_fn, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Each token's cross entropy (B, T) (0 where ``targets`` is ``ignore_index``), chunk by chunk, without
    gradients: what a per-sequence objective reads (the negated log-probs of its tokens) before it knows how
    much each token weighs in its loss (then :func:`chunked_loss_sum` with ``weights`` runs the backward)."""
    step = max(1, chunk // hidden.shape[0])
    targets = targets.to(hidden.device)
    with torch.no_grad():
        parts = [vocab_parallel_token_losses(logits_fn(hidden[:, s:s + step]), targets[:, s:s + step], ignore_index)
                 .view(hidden.shape[0], -1) for s in range(0, hidden.shape[1], step)]
    return torch.cat(parts, dim=1)


def chunked_loss_sum(logits_fn, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                     denominator: float, ignore_index: int = IGNORE_INDEX,
                     linear: LinearHead | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of cross-entropy / ``denominator`` over ``targets`` != ``ignore_index``, chunk by chunk.

    Args:
        logits_fn: Maps hidden states (B, t, H) to logits (B, t, V) token by token (``stage.logits``).
        hidden: The last stage's final hidden states (B, T, H).
        targets: Already shifted labels (B, T): the token each position predicts.
        chunk: Tokens per chunk (split along T; each chunk holds ``B * t <= chunk`` tokens).
        denominator: The global token count the loss is divided by.
        linear: ``logits_fn`` split into its parts, where it is a linear head: then the fast path runs
            when it can (:func:`head_path`).
        weights: (B, T) per-token factors of the loss (a per-sequence objective's gradient by each token's
            log-prob), or ``None`` for all ones.

    Returns:
        A float32 scalar equal to ``cross_entropy(logits_fn(hidden), targets, reduction="sum") /
        denominator``, with the same gradients for ``hidden`` and every parameter ``logits_fn`` uses.
    """
    weight = linear_head_weight(linear, hidden) if weights is None else None  # the fast path weighs none
    if weight is not None:
        return linear_loss_sum(linear, weight, hidden, targets, chunk, denominator, ignore_index)
    step = max(1, chunk // hidden.shape[0])
    targets = targets.to(hidden.device)
    if weights is not None:
        weights = weights.to(hidden.device)
    if not torch.is_grad_enabled():
        parts = [_chunk_loss(logits_fn, hidden[:, s:s + step], targets[:, s:s + step], ignore_index,
                             None if weights is None else weights[:, s:s + step])
                 for s in range(0, hidden.shape[1], step)]
        return torch.stack(parts).sum() / denominator
    params = _parameters_used(logits_fn, hidden)
    return _ChunkedLoss.apply(hidden, targets, logits_fn, step, float(denominator), ignore_index, weights, *params)


def _chunk_loss(logits_fn, hidden, targets, ignore_index, weights=None) -> torch.Tensor:
    logits = logits_fn(hidden)  # (B, t, V), the only logits alive at a time
    if weights is not None or getattr(logits, "device_mesh", None) is not None:  # --tp: split over the vocabulary
        return vocab_parallel_loss_sum(logits, targets, ignore_index, weights)
    return F.cross_entropy(logits.to(loss_dtype(logits.dtype)).flatten(0, -2), targets.flatten(),
                           ignore_index=ignore_index, reduction="sum")


def _parameters_used(logits_fn, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The trainable tensors ``logits_fn`` reads, found in the autograd graph of one token's logits.

    Read from the graph rather than listed by name, so a family's logit transforms, a LoRA head,
    or FSDP2's unsharded parameters (the tensors in use at this moment) are all covered.
    """
    with torch.enable_grad():
        probe = logits_fn(hidden[:1, :1].detach())
    found, seen, stack = [], set(), [probe.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold the leaf tensor
        if leaf is not None:
            found.append(leaf)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


class _ChunkedLoss(torch.autograd.Function):
    """Loss forward and backward per chunk in ``forward``; ``backward`` hands the kept gradients on.

    ``backward`` may run twice on one graph (zero-bubble schedules take the input gradient first
    and the weight gradient later, retaining the graph); it hands on what it keeps only when the graph
    is not retained (:func:`hfpipe.loss.linear_head.hand_on`).
    """

    @staticmethod
    def forward(ctx, hidden, targets, logits_fn, step, denominator, ignore_index, weights, *params):
        need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[7:]
        wanted = [p for p, need in zip(params, need_p) if need]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_p: list = [None] * len(wanted)
        total = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)
        for s in range(0, hidden.shape[1], step):
            h = hidden[:, s:s + step].detach().requires_grad_(need_h)
            with torch.enable_grad():
                w = None if weights is None else weights[:, s:s + step]
                loss = _chunk_loss(logits_fn, h, targets[:, s:s + step], ignore_index, w) / denominator
            grads = torch.autograd.grad(loss, ([h] if need_h else []) + wanted, allow_unused=True)
            if need_h:
                grad_h[:, s:s + step] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is not None:
                    grad_p[i] = g if grad_p[i] is None else grad_p[i].add_(g)
            total += loss.detach()
        it = iter(grad_p)
        ctx.grads = [grad_h] + [next(it) if need else None for need in need_p]
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = hand_on(ctx, grad_out)
        return (grads[0], None, None, None, None, None, None, *grads[1:])
