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
"""

from __future__ import annotations

__all__ = ["kv_gather_bytes"]


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
