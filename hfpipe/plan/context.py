"""What context parallelism (``--cp N``) costs each rank, for ``hfpipe plan`` and ``bench/cp.py``.

hfpipe's context parallelism splits each microbatch's sequence over ``cp`` ranks, head-tail
balanced (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), and gathers each
attention layer's K and V over the cp group with autograd, as Llama 3 was trained
(:mod:`hfpipe.parallel.context`). The collective bytes of that are pure arithmetic, written once
here so that the planner prices what the runtime moves and the benchmark can check one against the
other (measured / analytic = 1.00).

Per decoder layer and microbatch, a rank **receives** ``cp - 1`` other ranks' local K and V in the
forward all-gather, and the same bytes again in the backward (the all-gather's gradient is a
reduce-scatter of dK and dV); a layer recomputed under activation checkpointing gathers once more.

**Memory.** A rank holds ``seq_len / cp`` tokens of every activation (the head's logits too), so
the measured bytes per token (:mod:`hfpipe.plan.activations`) are counted on ``tokens / cp``. What
does not divide is attention's K and V: a layer attends its local queries to the whole sequence's
keys, so the gathered K and V (``kv_heads`` after GQA, on this rank's ``kv_heads / tp``; MLA: the
expanded per-head K of ``qk_nope + qk_rope`` and V of ``v_head_dim``) are what SDPA saves for
backward in place of the local ones the measurement counted: each kept layer keeps ``cp - 1``
other ranks' K/V per local token more (:func:`layer_bytes`; a checkpointed layer keeps only its
input, and its recompute holds them once). During a layer's backward the gradient of the gathered
K/V, whole-sequence sized, waits for its reduce-scatter: one layer's at a time (:func:`held_kv`).
The mask the runtime builds (``pos_q >= pos_k``, packed documents, padding) is one boolean per (local
query, key) pair, shared by the layers; but SDPA turns a boolean mask into an additive one in the
compute dtype at every call (CPU's flash kernel and CUDA's memory-efficient one alike) and saves it
for backward: each kept layer keeps ``seq_len`` more elements per local token, whole over tp (it
broadcasts over the heads). Measured on CPU: without it the plan held 0.965 of a cp2 run's activations.

**Weights.** FSDP2 shards and averages over dp x cp (:attr:`hfpipe.parallel.dims.ParallelDims.fsdp_dims`),
so cp divides a rank's sharded state as dp does (:func:`hfpipe.plan.memory.param_bytes` at
``dp * cp``), and FSDP2's traffic is that of ``dp * cp`` shards (:func:`hfpipe.plan.tensor.fsdp_traffic`).
"""

from __future__ import annotations

from hfpipe.plan.memory import ACT_BYTES

__all__ = ["cp_traffic", "describe", "held_kv", "kv_gather_bytes", "kv_shape", "layer_bytes"]


def kv_gather_bytes(*, batch: int, seq_len: int, cp: int, kv_heads: int, k_dim: int, v_dim: int,
                    dtype_bytes: int, layers: int = 1, recomputed: int = 0) -> int:
    """Bytes one cp rank receives in K/V gathers for one microbatch through ``layers`` attention layers.

    Args:
        batch, seq_len: The microbatch's rows and its whole (unsplit) sequence length.
        kv_heads, k_dim, v_dim: K and V as attention sees them (after GQA's kv heads; for MLA the
            expanded per-head K of ``qk_nope + qk_rope`` and V of ``v_head_dim``).
        recomputed: How many of ``layers`` run their forward again in backward (activation checkpointing).
    """
    if cp == 1:
        return 0
    local = batch * kv_heads * (seq_len // cp) * (k_dim + v_dim) * dtype_bytes
    return (cp - 1) * local * (2 * layers + recomputed)


def kv_shape(config, tp: int = 1) -> tuple[int, int, int]:
    """(kv heads on one tensor-parallel rank, K dim, V dim) of the K and V the cp ranks gather."""
    heads = config.num_attention_heads
    if getattr(config, "qk_nope_head_dim", None):  # MLA: K and V expanded per attention head
        k_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return heads // tp, k_dim, config.v_head_dim
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return max(1, kv // tp), head_dim, head_dim


def _kv_per_token(config, tp: int, dtype: str) -> int:
    """Bytes of one token's K and V in one attention layer, on one tensor-parallel rank."""
    heads, k_dim, v_dim = kv_shape(config, tp)
    return heads * (k_dim + v_dim) * ACT_BYTES[dtype]


def layer_bytes(per_layer: tuple[int, ...], config, cp: int, tp: int, dtype: str, seq_len: int) -> tuple[int, ...]:
    """Each layer's activation bytes per local token on one cp rank: the measured bytes plus the
    ``cp - 1`` other ranks' K and V that attention saves in place of its own, and the row of the mask
    over the ``seq_len`` keys that attention saves in the compute dtype (module docstring)."""
    if cp == 1:
        return tuple(per_layer)
    more = (cp - 1) * _kv_per_token(config, tp, dtype) + seq_len * ACT_BYTES[dtype]
    return tuple(b + more for b in per_layer)


def held_kv(config, local_tokens: int, cp: int, tp: int, dtype: str) -> int:
    """Bytes of one layer's whole-sequence K/V gradient, held until its reduce-scatter (0 at cp 1)."""
    return cp * local_tokens * _kv_per_token(config, tp, dtype) if cp > 1 else 0


def cp_traffic(plan, config, cp: int, tp: int, microbatches: int, batch: int, seq_len: int, dtype: str,
               ac: str) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU receives in K/V gathers (and their reduce-scatters) per step.

    Args:
        batch: Sequences per microbatch.
    """
    if cp == 1:
        return (0,) * plan.pp
    heads, k_dim, v_dim = kv_shape(config, tp)
    step = {"none": 0, "full": 1, "selective": 2}[ac]  # which layers recompute (hfpipe.plan.tensor)
    out = []
    for rank in range(plan.pp):
        layers = [j for s in plan.stages_of_rank(rank) for j, _ in enumerate(s.layers)]
        recomputed = sum(1 for j in layers if j % step == 0) if step else 0
        out.append(microbatches * kv_gather_bytes(
            batch=batch, seq_len=seq_len, cp=cp, kv_heads=heads, k_dim=k_dim, v_dim=v_dim,
            dtype_bytes=ACT_BYTES[dtype], layers=len(layers), recomputed=recomputed))
    return tuple(out)


def describe(cp: int, dp: int, cp_bytes, fsdp_bytes, size) -> list[str]:
    """The line ``hfpipe plan`` prints about context parallelism."""
    if cp == 1:
        return []
    fsdp = (f"; FSDP2 over dp {dp} x cp {cp} = {dp * cp} shards, all-gather + reduce-scatter "
            f"{size(max(fsdp_bytes))} per GPU per step" if max(fsdp_bytes) else "")
    return [f"context parallel: cp {cp}, each sequence split {cp} ways head-tail (activations and logits / cp); "
            f"each attention layer gathers the whole sequence's K and V, {size(max(cp_bytes))} received per GPU "
            f"per step (forward, backward, recompute) on the busiest rank{fsdp}"]
