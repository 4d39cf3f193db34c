"""The cost model of pipeline planning: FLOPs per token and parameters of each part of a model.

Costs come from a parameter count of the real transformers model built on the meta device, so the
planner knows every architecture transformers knows.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch

from hfpipe.errors import PlanError
from hfpipe.models.moe import routed_experts

__all__ = ["CostModel", "config_key", "layer_costs"]

# The embedding is a row lookup: no matmul FLOPs, but not free. Per token it moves ~4 * hidden bytes
# (bf16 row read + write), and a memory-bound byte takes about as long as ~300 FLOPs on current GPUs
# (H100: ~990 TFLOP/s bf16 over 3.35 TB/s). That is <1% of a decoder layer: enough to keep ties
# off the embedding stage, too little to move a layer by itself.
_EMBED_FLOPS_PER_HIDDEN = 4 * 300

@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs per token (training is ~3x everywhere; only ratios matter) and parameters."""

    embed: float  # the lookup, costed as memory traffic (see _EMBED_FLOPS_PER_HIDDEN)
    head: float  # final norm + lm_head: 2 FLOPs per parameter (2 * hidden * vocab), tied or not
    layers: tuple[float, ...]  # per decoder layer: 2 FLOPs per active parameter + attention
    mtp: float  # one MTP layer if it ran (0.0 without one); hfpipe skips MTP on load: stages cost 0
    embed_params: int
    head_params: int  # includes a tied lm_head weight: the head stage holds its own copy
    layer_params: tuple[int, ...]  # every parameter of each layer, all experts included (memory)
    layer_active_params: tuple[float, ...]  # what a token runs: routed experts x top_k / experts
    is_moe: tuple[bool, ...]
    mtp_params: int
    num_mtp: int
    layer_routed_params: tuple[int, ...] = ()  # per layer, the routed experts' parameters (0: dense)
    layer_replicated_params: tuple[int, ...] = ()  # per layer, what tensor parallelism keeps whole
    head_replicated_params: int = 0  # the final norm: whole on every tensor-parallel rank


def layer_costs(config, seq_len: int = 4096) -> CostModel:
    """Cost of each part of the model, from its transformers class built on the meta device.

    Args:
        config: A transformers ``PretrainedConfig`` of a causal LM.
        seq_len: Training sequence length; sets the attention-score FLOPs.

    Returns:
        The :class:`CostModel`.
    """
    if seq_len < 1:
        raise PlanError(f"--seq-len must be >= 1, got {seq_len}")
    key = (config_key(config), type(config), seq_len)
    if key not in _COSTS:
        _COSTS[key] = _layer_costs(config, seq_len)
    return _COSTS[key]


class _Cache(dict):
    """A dict that forgets everything once it holds 64 entries (plans see a handful of configs)."""

    def __setitem__(self, key, value):
        if len(self) >= 64:
            self.clear()
        super().__setitem__(key, value)


def config_key(config) -> str:
    """A config's fields as one string: the cache key of everything priced from the config alone.

    A search over plans (``hfpipe plan --gpu-memory``'s suggestions) prices one config dozens of
    times; building its meta model each time was most of a report's second.
    """
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


_COSTS = _Cache()  # (config_key, config class, seq_len) -> CostModel
_COUNTS = _Cache()  # (config_key, config class) -> parameter counts (seq_len does not matter)


def _layer_costs(config, seq_len: int) -> CostModel:
    key = (config_key(config), type(config))
    if key not in _COUNTS:
        _COUNTS[key] = _param_counts(config)
    embed_p, head_p, head_rep, per_layer = _COUNTS[key]
    totals, active, moe, routed, replicated = zip(*per_layer)
    attn = _attention_flops(config, seq_len)
    layers = tuple(2.0 * a + f for a, f in zip(active, attn))
    head = 2.0 * head_p
    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    hidden = config.hidden_size
    # transformers does not build MTP layers. DeepSeek's is a decoder layer like the last one, plus
    # eh_proj (2h -> h), three norms, and a pass through the shared head for its own loss.
    mtp_params = totals[-1] + 2 * hidden * hidden + 3 * hidden if num_mtp else 0
    mtp = layers[-1] + 4.0 * hidden * hidden + head if num_mtp else 0.0
    return CostModel(
        embed=float(_EMBED_FLOPS_PER_HIDDEN * hidden), head=head, layers=layers, mtp=mtp,
        embed_params=embed_p, head_params=head_p, layer_params=totals, layer_active_params=active,
        is_moe=moe, mtp_params=mtp_params, num_mtp=num_mtp, layer_routed_params=routed,
        layer_replicated_params=replicated, head_replicated_params=head_rep,
    )


def _param_counts(config) -> tuple[int, int, int, list[tuple[int, float, bool, int, int]]]:
    """(embed, head, head's replicated, per layer (total, active, is_moe, routed, replicated)) counted
    on a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, fast even for 671B parameters
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=False)
    layers = _decoder_layers(model, config.num_hidden_layers)
    embed = {id(p): p for p in model.get_input_embeddings().parameters()}
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    head = {id(p): p for p in model.parameters() if id(p) not in in_layers | embed.keys()}
    out = model.get_output_embeddings()
    head.update({id(p): p for p in (out.parameters() if out is not None else ())})
    experts = _expert_fraction(config)
    per_layer = [_layer_params(layer, experts) for layer in layers]
    head_rep = sum(p.numel() for n, p in model.named_parameters() if id(p) in head and _replicated(n))
    return sum(p.numel() for p in embed.values()), sum(p.numel() for p in head.values()), head_rep, per_layer


def _decoder_layers(model, num_layers: int) -> torch.nn.ModuleList:
    """The ModuleList of decoder layers (``model.layers`` in every HF decoder)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            if len(module) == num_layers:
                return module
    raise PlanError(f"{type(model).__name__} has no ModuleList of {num_layers} decoder layers "
                    "(num_hidden_layers); hfpipe cannot split this architecture")


def _expert_fraction(config) -> float:
    """The share of routed-expert parameters one token uses: top_k / num_experts."""
    count, top_k = routed_experts(config)
    return top_k / count if count and top_k else 1.0


def _layer_params(layer: torch.nn.Module, expert_fraction: float) -> tuple[int, float, bool, int, int]:
    """(total, active, is_moe, routed, replicated) of one decoder layer.

    Routed experts live under a module named ``experts`` (fused or a ModuleList);
    ``shared_experts`` / ``shared_expert`` run for every token and count in full.
    """
    total = routed = replicated = 0
    for name, param in layer.named_parameters():
        total += param.numel()
        if "experts" in name.split("."):
            routed += param.numel()
        elif _replicated(name):
            replicated += param.numel()
    return total, total - routed + routed * expert_fraction, routed > 0, routed, replicated


#: MLA's down-projections, which hfpipe's tp plan leaves whole (hfpipe.parallel.tensor_plan's _MLA_PLAN: q_a_proj
#: is not in it, kv_a_proj_with_mqa only sums its rope key's gradient): every rank runs them on the whole input.
_WHOLE_MATRICES = ("q_a_proj", "kv_a_proj_with_mqa")


def _replicated(name: str) -> bool:
    """Whether tensor parallelism keeps a parameter whole on every rank: the norms (layer, q/k and
    MLA's low-rank ones), a MoE router (``mlp.gate``) and MLA's down-projections; every matrix else is split."""
    parts = name.split(".")
    return "gate" in parts or any("norm" in part for part in parts) or any(p in _WHOLE_MATRICES for p in parts)


def _attention_flops(config, seq_len: int) -> list[float]:
    """Per layer, forward FLOPs per token of QK^T and AV: 2 * keys * heads * (d_qk + d_v)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    d_qk = getattr(config, "qk_head_dim", None) or head_dim  # MLA: nope + rope dims
    d_v = getattr(config, "v_head_dim", None) or head_dim
    window = getattr(config, "sliding_window", None)
    default = "sliding_attention" if window and getattr(config, "use_sliding_window", True) else (
        "full_attention")
    kinds = getattr(config, "layer_types", None) or [default] * config.num_hidden_layers
    keys = [_mean_keys(kind, seq_len, window, config) for kind in kinds]
    return [2.0 * k * heads * (d_qk + d_v) for k in keys]


def _mean_keys(kind: str, seq_len: int, window: int | None, config) -> float:
    """Keys one query attends to, averaged over the causal sequence."""
    if kind == "sliding_attention" and window and window < seq_len:
        return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
    if kind == "chunked_attention":
        return (min(getattr(config, "attention_chunk_size", seq_len), seq_len) + 1) / 2
    if kind in ("full_attention", "sliding_attention"):
        return (seq_len + 1) / 2  # causal: half the square
    return 0.0  # linear attention / state-space layers: their cost is in their parameters
