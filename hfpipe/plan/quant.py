"""What a quantized frozen base (``--quantize-base nf4|fp8``, LoRA runs) costs each rank.

Which weights: every linear weight inside a decoder layer except a MoE router's (``mlp.gate``,
``router``), as :mod:`hfpipe.quant` quantizes them, and the routed experts' weight stacks (they
stay quantized on their ranks under ``--ep``). The embedding, the head, norms, routers, biases and
the LoRA adapters stay in the run's dtype.

Bytes per quantized parameter:

- ``nf4``: torchao's ``NF4Tensor`` (QLoRA's format; hfpipe's choice over bitsandbytes, see
  :mod:`hfpipe.quant.nf4`): 4 bits per value, one absmax per block of 64 values, and the absmaxes
  double-quantized: int8 each, with one scale per group of up to 256 blocks (priced at 4 bytes).
  ``0.5 + 1/64 + 4/(64*256)`` = 0.516 bytes per parameter (0.5625 without double quantization).
- ``fp8``: e4m3, 1 byte, plus one fp32 scale per 128 x 128 tile of each matrix (edge tiles
  partial), DeepSeek's ``weight_block_size`` (``weight_scale_inv``): 1.0002 bytes for big matrices.

Under FSDP2 (dp > 1) an NF4 linear is sharded and gathered as it is, quantized: a rank keeps its
shard plus the gathered weight during a step, ``q / dp + q`` (no fp32 master: the base is frozen).
FP8 codes are buffers, whole on every rank: ``q``; so are the routed experts of either kind. A
linear, and a routed expert, dequantizes just in time, in forward and again in backward, so one
dequantized weight lives at a time: priced as the rank's largest quantized matrix in the run's
dtype, twice (a forward's and a backward's can overlap in a 1F1B steady state).

Under ``--fp8-recipe blockwise`` an FP8 linear, or routed expert, whose dims divide by 16 multiplies its
codes tile by tile instead (:mod:`hfpipe.quant.fp8_matmul`) and no weight of it is dequantized; what lives
during one of its matmuls is priced instead, on a microbatch's tokens (all of them, for an expert: a bound):
the input's fp32 copy and its scaled copy while it is cast (then its e4m3 codes), and the tile loop's two
``(tokens, out)`` sums in fp32 (fp64 runs: fp64); in backward the same with ``in`` and ``out`` swapped, plus
the codes laid out transposed. Priced on the layer's widest input and output (whole under tp: a bound).
torch's one-GEMM kernel, where it runs, holds less. The others dequantize (priced as above).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hfpipe.plan.experts import replicas
from hfpipe.plan.memory import ACT_BYTES, frozen_dtype, param_bytes
from hfpipe.models.targets import ROUTERS as _SKIP  # routers stay in the run's dtype, as loading keeps them
from hfpipe.models.targets import plain_linear  # ... and linear subclasses with a forward of their own

__all__ = ["QUANT_BYTES", "LayerQuant", "check_quant", "layer_quant", "price_ranks", "describe_quant"]

_NF4_BLOCK, _NF4_GROUP, _FP8_TILE = 64, 256, 128
#: kind -> bytes per quantized value before scales.
QUANT_BYTES = {"nf4": 0.5, "fp8": 1.0}


@dataclass(frozen=True)
class LayerQuant:
    """The quantizable weights of one decoder layer."""

    linear: int  # parameters of quantized linear weights outside the routed experts
    linear_tiles: int  # their 128 x 128 FP8 tiles
    largest: int  # parameters of the largest of them
    experts: int  # parameters of the routed experts' weight stacks (all experts)
    expert_tiles: int  # their 128 x 128 FP8 tiles (per expert matrix)
    largest_stack: int  # parameters of the largest routed-expert stack (all experts)
    largest_expert: int = 0  # parameters of the largest one expert's matrix in those stacks
    widest_in: int = 0  # the largest in_features of the quantized matrices (linears, experts) that multiply in
    widest_out: int = 0  # ... float8 tiles under blockwise (dims dividing by 16), and out_features
    largest_untiled: int = 0  # parameters of the largest that do not (one expert's): it dequantizes


def check_quant(kind: str | None, lora_rank: int | None, config=None, block: int | None = None,
                tp: int = 1, fp8: str | None = None, dtype: str = "bf16-mixed") -> None:
    """Raise PlanError unless ``--quantize-base kind`` can be priced (FinetuneConfig repeats it); with
    the model's ``config``, also QuantError for what finetune refuses of that model
    (:func:`hfpipe.quant.linear.check_quantize`, the one set of checks both call); ConfigError for a
    float8 recipe ``fp8`` that does not go with the base (:func:`hfpipe.config.names.check_fp8`)."""
    from hfpipe.config.names import check_fp8
    from hfpipe.errors import PlanError

    check_fp8(fp8, dtype, kind)

    if kind is not None and kind not in QUANT_BYTES:
        raise PlanError(f"--quantize-base must be one of {', '.join(QUANT_BYTES)}; got {kind!r}")
    if kind is not None and lora_rank is None:
        raise PlanError("--quantize-base applies to LoRA runs only (the base must be frozen); add "
                        "--lora-rank R (e.g. 16)")
    if kind is not None and config is not None:
        from hfpipe.plan.cost import config_key
        from hfpipe.quant.linear import check_quantize

        key = (config_key(config), type(config), kind, block, tp)
        if key not in _CHECKED:  # the fit search prices many layouts of one model: build its meta model once
            check_quantize(config, kind, block, backend=False, tp=tp)  # a plan prices without torchao
            _CHECKED.add(key)


_CHECKED: set = set()


def layer_quant(config) -> tuple[LayerQuant, ...]:
    """Per decoder layer, its quantizable weights, counted on the meta model (cached per config)."""
    from hfpipe.plan.cost import config_key

    key = (config_key(config), type(config))
    if key not in _CACHE:
        _CACHE.clear() if len(_CACHE) > 16 else None
        _CACHE[key] = _count(config)
    return _CACHE[key]


_CACHE: dict = {}


def _count(config) -> tuple[LayerQuant, ...]:
    import copy

    from transformers import AutoModelForCausalLM

    from hfpipe.plan.cost import _decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=False)
    return tuple(_one_layer(layer) for layer in _decoder_layers(model, config.num_hidden_layers))


def _one_layer(layer: torch.nn.Module) -> LayerQuant:
    from hfpipe.quant.fp8_matmul import fits_float8_tiles

    lin = tiles = largest = exp = exp_tiles = stack = one = wide_in = wide_out = untiled = 0

    def matmul(out_features: int, in_features: int, transposed: bool = False) -> None:
        """Under blockwise: a weight multiplied tile by tile (priced at the default tiles), or dequantized."""
        nonlocal wide_in, wide_out, untiled
        if not transposed and fits_float8_tiles(in_features, out_features, _FP8_TILE):
            wide_out, wide_in = max(wide_out, out_features), max(wide_in, in_features)
        else:
            untiled = max(untiled, out_features * in_features)

    for name, module in layer.named_modules():
        routed = "experts" in name.split(".")  # not shared_experts: those run for every token
        for pname, p in module.named_parameters(recurse=False):
            if routed and p.dim() == 3 and "bias" not in pname:  # fused [E, out, in] stacks
                exp += p.numel()
                exp_tiles += p.shape[0] * _tiles(p.shape[1], p.shape[2])
                stack, one = max(stack, p.numel()), max(one, p[0].numel())
                matmul(p.shape[1], p.shape[2], getattr(module, "is_transposed", False))  # (GPT-OSS: [E, in, out])
            elif plain_linear(module) and pname == "weight" and not name.endswith(_SKIP):
                if routed:  # experts as a ModuleList of linears
                    exp, exp_tiles = exp + p.numel(), exp_tiles + _tiles(*p.shape)
                else:
                    lin, tiles, largest = lin + p.numel(), tiles + _tiles(*p.shape), max(largest, p.numel())
                matmul(*p.shape)
    return LayerQuant(lin, tiles, largest, exp, exp_tiles, stack, one, wide_in, wide_out, untiled)


def _tiles(rows: int, cols: int) -> int:
    return -(-rows // _FP8_TILE) * -(-cols // _FP8_TILE)


def _quantized_bytes(kind: str, params: float, tiles: float) -> float:
    if kind == "nf4":
        return params * (0.5 + 1 / _NF4_BLOCK + 4 / (_NF4_BLOCK * _NF4_GROUP))
    return params * QUANT_BYTES["fp8"] + 4 * tiles


def price_ranks(lora_ranks, plan, config, kind: str | None, dtype: str, dp: int, ep: int, tp: int = 1,
                tile_tokens: int | None = None) -> tuple:
    """LoRA ranks (:func:`hfpipe.lora.memory.describe_plan`'s) with the frozen base re-priced: its
    routed experts sharded over ``dp / ep`` (x ``tp``: whole on each tp rank) and, with ``kind``, its linear
    weights quantized; ``tile_tokens``: a microbatch's tokens, whose float8 tile products an FP8 base's
    linears compute (``--fp8-recipe blockwise``) instead of dequantizing.

    ``describe_plan`` priced every base parameter a rank holds at a frozen full-precision weight's
    bytes over ``dp``; that part is replaced here, the adapters' bytes are kept.
    """
    per_layer = layer_quant(config) if kind else None
    from hfpipe.plan.cost import layer_costs

    costs = layer_costs(config)
    out = []
    for r in lora_ranks:
        layers = [i for s in plan.stages_of_rank(r.rank) for i in s.layers]
        routed = sum(costs.layer_routed_params[i] for i in layers) // ep
        adapters = r.weight_bytes - int(r.params * param_bytes(frozen_dtype(dtype, bool(kind)), dp)[0])
        base, transient = _base_bytes(r.params, routed, layers, per_layer, kind, dtype, dp, ep, tp, tile_tokens)
        out.append(dataclasses.replace(r, weight_bytes=int(base) + adapters, transient_bytes=int(transient)))
    return tuple(out)


def _base_bytes(params: int, routed: int, layers, per_layer, kind, dtype: str, dp: int, ep: int, tp: int,
                tile_tokens: int | None = None):
    """(frozen base bytes, transient bytes) of a rank holding ``params`` base parameters, ``routed`` of them
    routed experts (already cut to ``1 / ep``): dequantized weights, or float8 tile products (``tile_tokens``)."""
    edp = replicas(dp, ep, tp)  # the ranks holding the same experts (under ep whole on each tp rank)
    held = frozen_dtype(dtype, bool(kind))
    full, full_e = param_bytes(held, dp)[0], param_bytes(held, edp)[0]
    if not kind:
        return (params - routed) * full + routed * full_e, 0

    def gathered(n: int) -> float:  # FSDP2: the shard, plus the whole weight during a step
        return 1 / n + 1 if n > 1 else 1

    q = [per_layer[i] for i in layers]
    fp8 = kind == "fp8"
    lin, exp = sum(x.linear for x in q), sum(x.experts for x in q) // ep
    # unquantized: embedding, head, norms, routers, biases (experts' over dp / ep)
    base = (params - routed - lin) * full + (routed - exp) * full_e
    base += _quantized_bytes(kind, lin, sum(x.linear_tiles for x in q)) * (1 if fp8 else gathered(dp))
    base += _quantized_bytes(kind, exp, sum(x.expert_tiles for x in q) / ep)  # whole on their ranks
    if not tile_tokens:
        largest = max([x.largest for x in q] + [x.largest_expert for x in q] + [0])
        return base, 2 * largest * ACT_BYTES[dtype]
    dequantized = max([x.largest_untiled for x in q] + [0])
    return base, max(2 * dequantized * ACT_BYTES[dtype], _tile_bytes(q, tile_tokens, dtype))


def _tile_bytes(q, tokens: int, dtype: str) -> float:
    """What one float8 tile product holds at its peak (module docstring), on the widest linear of ``q``."""
    wide_in, wide_out = max([x.widest_in for x in q] + [0]), max([x.widest_out for x in q] + [0])
    codes = max([x.largest for x in q] + [x.largest_expert for x in q] + [0])  # the codes transposed, in backward
    acc = 8 if dtype == "fp64" else 4  # the sums' dtype

    def one_way(k: int, n: int) -> float:  # casting (k) to e4m3, then multiplying into (n)
        cast = tokens * k * 2 * acc
        return max(cast, tokens * k * (1 + 4 / _FP8_TILE) + 2 * tokens * n * acc)

    return max(one_way(wide_in, wide_out), codes + one_way(wide_out, wide_in))


def describe_quant(kind: str, ranks, size, tiles: bool = False) -> str:
    """The line ``hfpipe plan`` prints about the quantized base (``size`` formats bytes; ``tiles``: an FP8 base
    multiplied in float8, ``--fp8-recipe blockwise``)."""
    per = {"nf4": "0.516 B/param (4-bit NF4, one int8 absmax per 64 values, double-quantized: one "
                  "scale per 256 absmaxes; torchao)",
           "fp8": "1 B/param + one fp32 scale per 128x128 tile (e4m3, DeepSeek's block format)"}[kind]
    worst = max(r.transient_bytes for r in ranks)
    how = (f"linears multiplied in float8 tile by tile, routed experts dequantized just in time, {size(worst)} "
           "transient on the busiest rank (a microbatch's tile products through its widest linear)" if tiles else
           f"dequantized just in time, {size(worst)} transient on the busiest rank (its largest weight in the "
           "run's dtype, x2)")
    return (f"base quantized {kind}: decoder-layer linears and routed experts at {per}; embedding, head, norms "
            f"and routers in the run's dtype; {how}")
