"""The tensor-parallel collectives of one decoder layer, per family, as hfpipe's tp plan issues them.

Counted from :mod:`hfpipe.parallel.tensor_plan` (which module is split how) and the styles it maps to
(a block's input, one replicated DTensor, sums the gradients its column-split projections leave; a
plain input to torch's ``ColwiseParallel`` is summed by that projection alone; ``RowwiseParallel`` sums
its output; transformers' ``moe_tp_experts`` sums the experts' partial outputs forward and their inputs'
gradients backward),
per token of a microbatch, in bytes of an all-reduce (a ring moves ``2 (tp - 1) / tp`` of it per rank;
an all-gather or a reduce-scatter half of it). ``h`` is the hidden size, ``r`` a LoRA rank.

=========================  ===============================  ===============================================
part                       forward                          backward
=========================  ===============================  ===============================================
attention (q, k, v, o)     o_proj's rowwise sum: h          one sum of the block's input gradient: h (q, k
                                                            and v read one replicated DTensor, Megatron's f)
MLA (DeepSeek-V3)          o_proj: h                        q_b_proj's input (q_lora_rank, or q_proj's h
                                                            without one), kv_b_proj's (kv_lora_rank), and
                                                            the shared rope key's (qk_rope_head_dim)
dense MLP                  down_proj: h                     one sum of the block's input gradient: h
routed experts over tp     partial outputs summed: h        the block's one input sum: h (router, routed
                                                            and shared experts share it); the top-k
                                                            weights: top_k (fp32 where the router is)
routed experts under ep    outputs all-gathered over tp     the token slice's backward gathers the
(whole, tokens over tp)    (each rank ran 1/tp): h / 2      gradients of its input (h / 2) and of the
                                                            top-k weights (top_k / 2)
shared experts             down_proj: h                     under ep, gate and up share one sum: h
sequence parallelism       a folded block's all-reduce is   a folded block's sum is a reduce-scatter, its
                           an all-gather in + a reduce-     output's reduce-scatter an all-gather (still h);
                           scatter out (still h); a MoE     MLA adds the gather (h / 2); a MoE MLP's whole
                           MLP gathers its input: + h / 2   output is cut to this rank's tokens, the cut's
                                                            gradient gathered (with the input's reduce-
                                                            scatter, h; under ep the input's gradient is cut
                                                            locally: + h / 2)
LoRA on a colwise base     none                             ``lora_B``'s input (r wide) summed
LoRA on a rowwise base     ``lora_A``'s output summed (r;   under SP that scatter's gather (r / 2)
                           under SP reduce-scattered, r/2)
=========================  ===============================  ===============================================

Megatron's count (Korthikanti et al., tensor and sequence parallelism) is the folded dense layer's: per
layer and token 2 h forward and 2 h backward in all-reduce units, with or without sequence parallelism
(:func:`megatron_layer_bytes`). A Llama-type layer (attention + dense MLP) now moves exactly that;
MLA's and the routed experts' rows are their own (see :mod:`hfpipe.parallel.tensor_plan` for why).

LoRA's r-wide tensors are fp32 (the adapters' dtype; PEFT casts their input to it). A LoRA run's
embedding is frozen: no gradient flows into it or into the first layer's projections that read its
output, so those sums never run (:func:`frozen_input_sums`).

Under ``--ep`` the experts stay whole on each tp rank: transformers' ``AllToAllEP`` slices the tokens over
the tp ranks (no collective) and gathers the outputs back, on the expert mesh's tp group.

Every count above was measured at torch's dispatcher against this module, byte for byte
(``tests/plan/test_plan_tensor_measured.py``, ``bench/tp.py --family``), the ``--ep`` row at dp 2 x ep 2 x tp 2.

Once per step (per microbatch when FSDP2 reshards every microbatch), a parameter whose gradient is a
pending partial sum over tp is all-reduced (:mod:`hfpipe.parallel.grads` reduces it first): the layer
norms under sequence parallelism (2 h), Qwen3's per-head q/k norms (``replicated_with_grad_allreduce``
in its plan: ``head_dim`` each) and, under SP, the whole ``lora_B`` of a rowwise base.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hfpipe.models.moe import routed_experts

__all__ = ["LORA_BYTES", "Adapters", "adapter_comm", "frozen_input_sums", "layer_comm", "megatron_layer_bytes",
           "spared_bytes", "step_partials"]

#: LoRA adapters are fp32 whatever the base's dtype (hfpipe.lora.adapters), and so their activations.
LORA_BYTES = 4

# DeepSeek-V3's TopkRouter casts the hidden states and its weight to fp32 (sigmoid scores in fp32):
# its top-k weights reach the experts in fp32. Qwen3-MoE's router casts them back to the compute dtype.
_FP32_ROUTERS = ("deepseek_v3",)


@dataclass(frozen=True)
class Adapters:
    """A LoRA run's adapters as the tp collectives see them (:func:`hfpipe.plan.lora.tp_adapters`)."""

    layers: dict = field(default_factory=dict)  # layer -> (colwise ranks, rowwise ranks, rowwise lora_B elements)
    frozen_first: int = 0  # elements per token of the first layer's attention input sums that do not run


def layer_comm(config, moe: bool, sp: bool, act: int, ep: int = 1) -> tuple[float, float]:
    """(forward, backward) bytes per token of one decoder layer's tp collectives, in all-reduces.

    Args:
        moe: Whether the layer's MLP is a routed-experts block (``CostModel.is_moe``).
        sp: Sequence parallelism.
        act: Bytes per element of the activations (the compute dtype).
        ep: Expert-parallel degree; above 1 the routed experts stay whole on each tp rank.
    """
    h = config.hidden_size * act
    attn_f, attn_b = h, h  # folded: o_proj's sum (all-gather + reduce-scatter under SP), the input's one sum
    if _mla(config):  # plain inputs: each up-projection sums its own; under SP o_proj's scatter is gathered back
        attn_b = _mla_inputs(config) * act + h / 2 * sp
    mlp_f, mlp_b = _moe(config, act, ep, sp) if moe else (h, h)
    return attn_f + mlp_f, attn_b + mlp_b


def megatron_layer_bytes(config, act: int) -> tuple[float, float]:
    """Megatron's (forward, backward) bytes per token of one dense layer, in all-reduces: its ``g`` after
    attention and after the MLP forward, its ``f`` before each in backward (2 h each way); under sequence
    parallelism each all-reduce is an all-gather and a reduce-scatter, the same bytes."""
    h = config.hidden_size * act
    return 2 * h, 2 * h


def _mla(config) -> bool:
    return bool(getattr(config, "kv_lora_rank", None))


def _mla_inputs(config) -> int:
    """Elements per token whose gradient MLA's column-split projections sum: they read latents, not h."""
    q = getattr(config, "q_lora_rank", None) or config.hidden_size
    return q + config.kv_lora_rank + config.qk_rope_head_dim


def _moe(config, act: int, ep: int, sp: bool) -> tuple[float, float]:
    """A MoE block's (forward, backward): its outputs are summed whole (under SP the input is gathered
    first and the output cut to this rank's tokens, that cut's gradient gathered)."""
    h = config.hidden_size * act
    shared = h if getattr(config, "n_shared_experts", 0) else 0  # its down_proj's sum
    _, top_k = routed_experts(config)
    weights = top_k * (4 if config.model_type in _FP32_ROUTERS else act)
    if ep > 1:  # experts whole on every tp rank; each runs 1/tp of the tokens and gathers the outputs, and
        # the backward of its token slice gathers the gradients of the hidden states and the top-k weights;
        # the shared experts' gate and up sum their input on their own
        return shared + h / 2 + h / 2 * sp, shared + h / 2 + weights / 2 + h / 2 * sp
    # routed experts, router and shared experts share the block's one input sum (SP: a reduce-scatter + the cut's gather)
    return h + shared + h / 2 * sp, h + weights


def frozen_input_sums(config, adapted: set[str]) -> int:
    """Elements per token of the first layer's attention input-gradient sums a LoRA run never runs.

    The hidden states entering the first layer come from the frozen embedding and need no gradient, so
    autograd skips the attention's one input sum (:func:`spared_bytes`); under MLA q_b_proj and kv_b_proj
    (and the rope key) only read the whole down-projections' outputs, which need a gradient where those
    carry an adapter. (The embedding's own backward gather under SP is skipped too.)
    """
    if not _mla(config):
        return config.hidden_size
    q_rank = getattr(config, "q_lora_rank", None)
    q = config.hidden_size if not q_rank else 0 if "q_a_proj" in adapted else q_rank
    kv = 0 if "kv_a_proj_with_mqa" in adapted else config.kv_lora_rank + config.qk_rope_head_dim
    return q + kv


def spared_bytes(config, frozen_first: int, sp: bool, act: int) -> float:
    """Bytes per token, in all-reduces, a LoRA run's frozen embedding spares the first stage: the first
    layer's attention input sums (a folded block's is a reduce-scatter under SP) and the embedding's gather."""
    h = config.hidden_size * act
    sums = frozen_first * act * (0.5 if sp and not _mla(config) else 1)
    return sums + h / 2 * sp


def adapter_comm(col_r: int, row_r: int, sp: bool) -> tuple[float, float]:
    """(forward, backward) bytes per token LoRA adds to a layer: ``col_r``/``row_r`` are the summed
    ranks of its adapters on column-/row-split bases."""
    if sp:
        return row_r * LORA_BYTES / 2, (col_r + row_r / 2) * LORA_BYTES
    return row_r * LORA_BYTES, col_r * LORA_BYTES


def step_partials(config, sp: bool) -> int:
    """Elements per layer of a full run's parameters whose gradient waits as a partial sum over tp."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    heads = sum(1 for style in plan.values() if style == "replicated_with_grad_allreduce")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads * head_dim + (2 * config.hidden_size if sp else 0)
