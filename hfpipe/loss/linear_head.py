"""The chunked head loss's fast path: a plain linear head whose matmuls the loss runs itself.

:mod:`hfpipe.loss.chunked` runs any ``stage.logits`` through autograd, a chunk at a time. For the
common head, ``scale(lm_head(norm(h)))`` with a plain ``nn.Linear`` and logit transforms that are
constant factors (none for most families; Granite's and Cohere's logit scales), the same gradients
come out of three matmuls per chunk and a few in-place passes over the chunk's logits, without
what generic autograd adds per chunk (measured by ``bench/head.py``):

- the head weight's gradient goes straight into one buffer: the first chunk's matmul writes it and
  every later one adds to it inside the GEMM (``addmm_``, beta=1), instead of a fresh (V, H) gradient
  per chunk summed by a separate ``add_`` (at a 128k vocabulary that read-modify-write is 2 GB per
  chunk, memory-bound, as long as the matmul itself);
- the softmax gradient of a chunk is one fused pass on a GPU (:func:`_fused_loss_and_grad`, compiled
  with ``torch.compile``; ``HFPIPE_HEAD_COMPILE=0`` turns that off), made in place elsewhere, in the
  fp32 log-softmax of the chunk (``log_softmax`` upcasts as it reads, so no fp32 copy of the logits is
  made) and cast into the logits' own buffer;
- nothing probes the head for its parameters (one more read of the whole weight per microbatch).

Measured on one H200 (``bench/head_cuda.py``, Llama-3-8B's head, 4 x 2048 tokens, bf16): full logits
48-50 ms and 12.7 GB; the generic path 1.41-1.45x the time; this path eager 1.08-1.14x at 1046 tokens a
chunk, and fused 0.90-0.94x the time at 0.18x the memory: the head loss then costs less than the full
logits (a whole step of a 2-layer slice: 1.025x the full logits' tokens/s at 0.77x the peak memory).

What stays on the generic path: a LoRA head (not a plain ``nn.Linear``), a weight split over tp ranks or
sharded by FSDP2 (a DTensor), a soft-capped family (tanh is not a constant factor), an ``autocast``
region (its casts are autograd's to make), and anything :func:`linear_head_weight` does not recognise.
The norm (and any module before it) runs once per microbatch under autograd, as in the full model.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

__all__ = ["LinearHead", "hand_on", "linear_head_weight", "linear_loss_sum"]


@dataclass(frozen=True)
class LinearHead:
    """A head the loss may run itself: ``logits = scale(module(inputs(hidden)))``.

    Attributes:
        inputs: Hidden states (B, t, ...) to the head's input (B, t, H): the final norm and what runs
            before it; per token.
        module: The ``lm_head``, read when the loss runs (FSDP2 swaps in its unsharded parameters then).
        scale: The family's logit transforms when each is a constant factor (so the same map applied to
            the logits' gradient is the chain rule), or ``None``.
    """

    inputs: Callable[[torch.Tensor], torch.Tensor]
    module: nn.Module
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None


def linear_head_weight(head: LinearHead | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """The head's weight when the fast path can run it exactly now, else ``None`` (the generic path)."""
    if head is None or type(head.module) is not nn.Linear:  # a LoRA (PEFT) or quantized head is a subclass/wrapper
        return None
    weight = head.module.weight
    if type(weight) not in (torch.Tensor, nn.Parameter) or weight.dtype != hidden.dtype:  # DTensor: tp or FSDP2 shard
        return None
    if torch.is_autocast_enabled(hidden.device.type):  # autocast's casts and their backward are autograd's
        return None
    return weight


def linear_loss_sum(head: LinearHead, weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
                    chunk: int, denominator: float, ignore_index: int) -> torch.Tensor:
    """Sum of cross-entropy / ``denominator`` of ``head``'s logits, ``chunk`` tokens at a time (see the module)."""
    x = head.inputs(hidden)  # (B, T, H): the norm under autograd, once per microbatch
    args = (x, weight, head.module.bias, targets.to(x.device), head.scale, max(1, chunk), float(denominator),
            ignore_index)
    if not torch.is_grad_enabled():
        return _chunks(*args, need=(False, False, False))[0]
    return _LinearCrossEntropy.apply(*args)


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's summed loss and, given ``weights`` (n,), its gradient in the logits' dtype.

    As ``F.cross_entropy(logits.float(), reduction="sum")`` and its backward compute them: fp32
    log-softmax, the gradient ``(softmax - onehot) * weight`` cast to the logits' dtype (``weights`` is
    1/denominator on tokens with a target, 0 elsewhere), made in place in the log-softmax and cast into
    the logits' own buffer (only the chunk's logits and their fp32 log-softmax are ever alive).
    """
    # (n, V) fp32, upcast as it reads; an fp64 run's stay fp64 (hfpipe.loss.vocab_parallel.loss_dtype)
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    valid = targets != ignore_index
    index = torch.where(valid, targets, 0).unsqueeze(1)  # (n, 1)
    loss = -torch.where(valid, logp.gather(1, index).squeeze(1), 0.0).sum()
    if weights is None:
        return loss, None
    grad = logp.exp_()  # softmax
    grad.scatter_add_(1, index, torch.full(index.shape, -1.0, dtype=grad.dtype, device=grad.device))  # - onehot
    if logits.dtype == grad.dtype:
        return loss, grad.mul_(weights.unsqueeze(1))
    return loss, torch.mul(grad, weights.unsqueeze(1), out=logits)  # scaled, then cast into the logits' buffer


def _fused_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_chunk_loss_and_grad` in functional form, for ``torch.compile`` to fuse into a few passes
    (the eager form makes five over the chunk's logits)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    valid = targets != ignore_index
    index = torch.where(valid, targets, 0).unsqueeze(1)
    loss = -torch.where(valid, logp.gather(1, index).squeeze(1), 0.0).sum()
    if weights is None:
        return loss, None
    onehot = torch.zeros_like(logp).scatter_(1, index, 1.0)
    return loss, ((logp.exp() - onehot) * weights.unsqueeze(1)).to(logits.dtype)


@cache
def _compiled():
    # dynamic: chunks of every length (the last one shorter, other microbatch shapes) share one graph
    return torch.compile(_fused_loss_and_grad, dynamic=True)


@cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _loss_and_grad_for(device: torch.device):
    """The chunk's loss-and-gradient function: compiled on CUDA (where Triton fuses it), else in place."""
    if device.type != "cuda" or os.environ.get("HFPIPE_HEAD_COMPILE", "1") == "0" or not _has_triton():
        return _chunk_loss_and_grad
    return _compiled()


def _chunks(x, weight, bias, targets, scale, chunk, denominator, ignore_index, need):
    """Every chunk's loss, and (as ``need`` asks) the gradients of ``x``, ``weight`` and ``bias``."""
    x2, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (N, H), (N,): the tokens in a row
    need_x, need_w, need_b = need
    train = any(need)
    grad_x = torch.empty_like(x2) if need_x else None
    grad_w = grad_b = None
    total = torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)  # fp64 stays fp64
    for s in range(0, x2.shape[0], chunk):
        xc, tc = x2[s:s + chunk], t[s:s + chunk]
        logits = xc @ weight.t() if bias is None else torch.addmm(bias, xc, weight.t())  # (n, V)
        if scale is not None:
            logits = scale(logits)
        weights = (tc != ignore_index).to(total.dtype) / denominator if train else None
        loss, grad = _loss_and_grad_for(logits.device)(logits, tc, weights, ignore_index)
        total += loss / denominator
        if not train:
            continue
        if scale is not None:
            grad = scale(grad)  # a constant factor: the chain rule through it is the same map
        if need_x:
            torch.mm(grad, weight, out=grad_x[s:s + chunk])
        if need_w:  # one buffer, added to inside the GEMM (beta=1)
            grad_w = grad.t() @ xc if grad_w is None else grad_w.addmm_(grad.t(), xc)
        if need_b:
            grad_b = grad.sum(0) if grad_b is None else grad_b.add_(grad.sum(0))
    return total, (grad_x.view_as(x) if need_x else None, grad_w, grad_b)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward and backward of every chunk in ``forward``; ``backward`` hands the kept gradients on.

    ``backward`` may run twice on one graph (zero-bubble schedules take the input gradient first and
    the weight gradient later, retaining the graph); it hands on what it keeps only when the graph is not
    retained (:func:`hand_on`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, targets, scale, chunk, denominator, ignore_index):
        total, ctx.grads = _chunks(x, weight, bias, targets, scale, chunk, denominator, ignore_index,
                                   need=tuple(ctx.needs_input_grad[:3]))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        return (*hand_on(ctx, grad_out), None, None, None, None, None)


def hand_on(ctx, grad_out: torch.Tensor) -> list:
    """A chunked loss's backward: the gradients its forward made (``ctx.grads``) times ``grad_out``.

    Scaled on the device, never compared on the host (a GPU would wait for the whole forward). A zero-bubble
    schedule runs the backward twice on one graph (the input gradients first, retaining the graph, the weight
    gradients later): then the kept tensors stay, and fresh products go on. Otherwise this is the graph's only
    backward: the kept tensors are scaled in place and handed on, so nothing is held twice through the last
    stage's backward (at Llama-3-8B's vocabulary the head's gradient is 1 GB in bf16) and AccumulateGrad takes
    the head's gradient over without a copy.
    """
    if _graph_kept():
        return [None if g is None else g * grad_out for g in ctx.grads]
    grads, ctx.grads = ctx.grads, None
    return [None if g is None else g.mul_(grad_out) for g in grads]


def _graph_kept() -> bool:
    """Whether the backward running now retains its graph (torch's own test, AOTAutograd's "saved tensors used
    once"; a private function: where a torch lacks it, the graph is taken as retained, which is always safe)."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())
