"""Context parallelism (``--cp N``): each microbatch's sequence split over ``cp`` ranks.

The split is head-tail balanced: the sequence is cut into ``2 cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r``, so under causal attention every rank has the same work (an early
chunk sees few keys, its partner many). Every cp rank of a replica is handed the same whole rows and
keeps its own tokens (:meth:`ContextParallel.split_batch`); the labels are shifted *before* the split,
so the token that predicts across a chunk seam still has its target.

Attention runs through transformers' own ``AttentionInterface`` (:func:`context_attention`,
registered as :data:`ATTENTION`), so the model classes stay unpatched: K and V of the local tokens
are gathered over the cp group with autograd (as Llama 3 was trained; exact on gloo and NCCL), put
back in sequence order, and attended under a mask built once per microbatch and stage from what
every rank already holds (the whole rows' document ids and padding): no positions or document ids
cross the wire, only K and V (``hfpipe.plan.context.kv_gather_bytes`` prices exactly those).

The mask is transformers' own rule written for a query subset: causal in the sequence index, no
attention across packed documents (a document starts where ``position_ids`` do not go up by one,
``transformers.masking_utils.find_packed_sequence_indices``, used when no attention mask is given),
no padded key (when one is), and a sliding window (``q - k < window``) on sliding layers. Families
whose attention differs otherwise (chunked, sinks, softcapping) are refused by
:func:`hfpipe.parallel.rules.check_layout`; :func:`context_attention` refuses them again at run time.

torch's own ``context_parallel`` (ring attention) is not used: it runs CUDA SDPA kernels only, needs
``is_causal=True`` and takes no mask, so it can express neither packed documents nor CPU tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hfpipe.errors import ParallelError
from hfpipe.loss.tokens import shift_labels

__all__ = ["ATTENTION", "ContextMask", "ContextParallel", "apply_cp", "chunk_index", "context_attention",
           "document_ids", "register_attention", "split_sequence", "unsplit_sequence"]

log = logging.getLogger(__name__)

#: The ``attn_implementation`` name the stages run under with cp > 1.
ATTENTION = "hfpipe_context"


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions rank ``rank`` holds: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def split_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of ``t`` along ``dim`` (head-tail)."""
    return t.index_select(dim, chunk_index(t.shape[dim], cp, rank).to(t.device))


def unsplit_sequence(parts: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's tokens concatenated in rank order along ``dim``."""
    return parts.index_select(dim, _sequence_order(parts.shape[dim], cp).to(parts.device))


def _sequence_order(seq_len: int, cp: int) -> torch.Tensor:
    """Where each sequence position sits in the rank-major concatenation of every rank's tokens."""
    return torch.argsort(torch.cat([chunk_index(seq_len, cp, r) for r in range(cp)]))


def document_ids(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 shape: tuple[int, int]) -> torch.Tensor:
    """``(B, 2, T)``: each token's document id and whether it may be attended (not padding).

    transformers' rule: with an attention mask, only padding is masked; without one, a packed row's
    documents start wherever ``position_ids`` do not go up by one (``find_packed_sequence_indices``).
    """
    docs = torch.zeros(shape, dtype=torch.long)
    if attention_mask is None and position_ids is not None:
        pos = position_ids.expand(shape).long()
        docs = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    real = torch.ones(shape, dtype=torch.long) if attention_mask is None else (attention_mask != 0).long()
    return torch.stack([docs.to(real.device), real], dim=1)


class ContextParallel:
    """This rank's place in its cp group, and the K/V bytes its gathers received (``bench/cp.py``).

    A plain class, not a dataclass: FSDP2 rebuilds the dataclasses among a layer's arguments (the
    :class:`ContextMask`) field by field, and the shared counter must survive that.

    Attributes:
        group: The cp process group.
        cp: Its size.
        rank: This rank's index in it.
    """

    def __init__(self, group, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.received_bytes = 0
        self._logged = False

    def split_batch(self, batch: dict) -> dict:
        """This rank's tokens of a batch of whole rows: ``input_ids``, ``shift_labels`` (shifted before
        the split), the global ``position_ids`` (rotary sees where a token really is) and
        ``context_keys`` (:func:`document_ids` of the whole rows, for the attention mask)."""
        ids = batch["input_ids"]
        seq = ids.shape[1]
        if seq % (2 * self.cp):
            raise ParallelError(f"--cp {self.cp}: a sequence of {seq} tokens does not split into {2 * self.cp} "
                                f"equal chunks; use a --seq-len (or pad rows to a length) divisible by {2 * self.cp}")
        pos, mask = batch.get("position_ids"), batch.get("attention_mask")
        keys = document_ids(pos, mask, tuple(ids.shape))
        if pos is None:
            pos = torch.arange(seq).expand(ids.shape)
        cut = lambda t: split_sequence(t, self.cp, self.rank)  # noqa: E731
        out = {"input_ids": cut(ids), "position_ids": cut(pos.expand(ids.shape)), "context_keys": keys}
        if batch.get("labels") is not None:
            out["shift_labels"] = cut(shift_labels(batch["labels"]))  # (B, T): token t predicts t+1
        return out

    def gather_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """The whole sequence (dim 1) of a tensor each cp rank holds its tokens of (logits)."""
        parts = [torch.empty_like(t) for _ in range(self.cp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=self.group)
        return unsplit_sequence(torch.cat(parts, dim=1), self.cp)

    def mask(self, keys: torch.Tensor, window: int | None = None) -> "ContextMask":
        """The attention mask of this rank's queries over the whole sequence, from ``context_keys``."""
        docs, real = keys[:, 0], keys[:, 1].bool()  # (B, T) each
        seq = docs.shape[1]
        q = chunk_index(seq, self.cp, self.rank).to(docs.device)  # (Tl,)
        k = torch.arange(seq, device=docs.device)
        allowed = q[:, None] >= k[None, :]  # (Tl, T): causal in the sequence index
        if window is not None:
            allowed = allowed & (q[:, None] - k[None, :] < window)
        same = docs[:, q, None] == docs[:, None, :]  # (B, Tl, T): one document
        allowed = allowed[None] & same & real[:, None, :]
        # A query with no key (a row starting with padding) attends itself: finite, and never seen by a
        # real token (padding keys are masked), where an empty row would be NaN.
        empty = ~allowed.any(-1, keepdim=True)
        allowed = allowed | (empty & (q[:, None] == k[None, :])[None])
        return ContextMask(allowed[:, None], _sequence_order(seq, self.cp).to(docs.device), self, window)

    def gather(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """``t`` (B, H, Tl, D) gathered over the cp group along the sequence and put in sequence order.

        ``all_gather_single_autograd`` (``all_gather_tensor_autograd`` before torch 2.13): its backward
        reduce-scatters the gradient correctly on gloo, where ``torch.distributed.nn.functional.all_gather``
        silently does not for SDPA's permuted strides (FACTS: errors 2-5).
        """
        from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

        local = t.contiguous()
        full = wait_tensor(all_gather_single_autograd(local, gather_dim=2, group=self.group))
        if local.device.type == "meta":  # torch's stages infer shapes on meta tensors: nothing moves
            return full.index_select(2, order)
        self.received_bytes += (self.cp - 1) * local.numel() * local.element_size()
        if full.requires_grad:  # the backward reduce-scatter receives as much again
            full.register_hook(self._count_backward)
        return full.index_select(2, order)

    def _count_backward(self, grad: torch.Tensor) -> None:
        self.received_bytes += (self.cp - 1) * (grad.numel() // self.cp) * grad.element_size()


@dataclass(eq=False)
class ContextMask:
    """What :func:`context_attention` needs, passed in the ``attention_mask`` slot the decoder layer forwards.

    Attributes:
        allowed: ``(B, 1, Tl, T)`` bool, True where a local query may attend a key (sequence order).
        order: Puts gathered keys (rank-major) in sequence order.
        context: The :class:`ContextParallel` to gather over.
        window: The sliding window this mask applies, or ``None``.
    """

    allowed: torch.Tensor
    order: torch.Tensor
    context: ContextParallel
    window: int | None = None


def context_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    """transformers' attention signature: local queries over K and V gathered from the whole cp group.

    Shapes as transformers passes them: query (B, H, Tl, D), key/value (B, Hkv, Tl, D[v]); returns
    (B, Tl, H, Dv) and no weights, as ``sdpa_attention_forward`` does.
    """
    mask = attention_mask
    if not isinstance(mask, ContextMask):
        raise ParallelError(f"attn_implementation {ATTENTION!r} runs only inside an hfpipe stage under --cp "
                            "(it needs the stage's context mask)")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ParallelError(f"--cp: {type(module).__name__} passes {name} to attention, which the "
                                "gathered-K/V attention does not apply; use --cp 1")
    window = kwargs.get("sliding_window")
    if window is not None and window != mask.window:
        raise ParallelError(f"--cp: {type(module).__name__} asks for a sliding window of {window}, but its layer "
                            f"type builds {mask.window}; use --cp 1")
    if not mask.context._logged:
        log.info("context parallelism: attention over K/V all-gathered from %d ranks", mask.context.cp)
        mask.context._logged = True
    key = mask.context.gather(key, mask.order)  # (B, Hkv, T, D)
    value = mask.context.gather(value, mask.order)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.allowed, dropout_p=dropout,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None  # (B, Tl, H, Dv)


def register_attention() -> str:
    """Register :func:`context_attention` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)
    return ATTENTION


def apply_cp(modules: list, context: ContextParallel) -> None:
    """Every stage's attention through :func:`context_attention`, registered with transformers'
    ``AttentionInterface`` (the model classes stay as they are); the stages share one ``context``."""
    name = register_attention()
    for m in modules:
        m.config._attn_implementation = name  # the layers' config: read at every attention call
        m.context = context
