"""Which base weights ``--quantize-base`` quantizes, and how the loader places them.

Every ``nn.Linear`` inside a decoder layer is quantized, except a MoE router (``mlp.gate``,
``router``: tiny and precision-critical, transformers' quantizers skip it too). Embedding,
norms, head and the LoRA adapters stay in the run's dtype.

- ``nf4``: the linear keeps its class; its ``weight`` becomes a frozen ``NF4Tensor`` parameter
  (:mod:`hfpipe.quant.nf4`), which FSDP2 shards over dp like any parameter.
- ``fp8``: the linear becomes an :class:`~hfpipe.quant.fp8.FP8Linear` holding the FP8 codes and
  ``weight_scale_inv`` (the checkpoint's own when it is block-FP8, else quantized at load); a MoE layer's
  fused routed experts become FP8 stacks (:mod:`hfpipe.quant.experts`), on their ranks under ``--ep``;
  with ``nf4`` one ``NF4Tensor`` per expert's matrix. Under ``--fp8-recipe blockwise`` FP8 linears and
  stacks multiply their codes in float8 instead of dequantizing (:mod:`hfpipe.quant.fp8_matmul`), where
  their dims allow.

Under ``--tp`` (fp8 only) each FP8 linear and routed-expert stack is then split on its tile edges
(:mod:`hfpipe.quant.tensor`) and the loader keeps this rank's codes and scales; a split that would
cut a tile is refused by :meth:`Quantizer.prepare` (what ``plan`` and ``finetune`` call).

The loader (:mod:`hfpipe.pipeline.load`) hands each weight to :meth:`Quantizer.place` as soon as
its shard is read, so only one full-precision weight exists at a time: a stage is never
materialised in full precision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hfpipe.models.experts import STACKS, experts_state, register
from hfpipe.quant.experts import ExpertStacks, fused_experts
from hfpipe.quant.fp8 import FP8_DEFAULT_BLOCK, FP8Linear, is_fp8, quantize_blocks
from hfpipe.quant.fp8_matmul import cublas_blockwise, fits_float8_tiles, float8_tile_linear
from hfpipe.quant.nf4 import DEFAULT_BLOCK, QuantError, check_nf4, quantize_nf4, torchao_nf4
from hfpipe.models.targets import quantized_linears

__all__ = ["KINDS", "QuantSpec", "Quantizer", "QuantError", "apply_quant", "check_quantize", "check_shardable",
           "quantized_linears", "source_fp8_block"]

KINDS = ("nf4", "fp8")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantSpec:
    """What ``--quantize-base`` asks for: ``kind`` and the block size (``None``: the default)."""

    kind: str
    block: int | None = None
    dtype: str = "float32"  # the parameter dtype weights are cast to before quantizing (for --merge)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise QuantError(f"--quantize-base must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.block is not None and self.block < 1:
            raise QuantError(f"--quantize-block-size must be >= 1, got {self.block}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "block": self.block, "dtype": self.dtype}


def source_fp8_block(config) -> int | None:
    """The tile edge of a block-FP8 checkpoint (``quantization_config``), or ``None``."""
    from hfpipe.source.tensor_checks import fp8_block  # the one reading of weight_block_size

    block = fp8_block(config)
    if block is None:
        return None
    if block[0] != block[1]:
        raise QuantError(f"weight_block_size {list(block)}: --quantize-base fp8 keeps square tiles only")
    return block[0]


def check_quantize(model_config, kind: str, block: int | None = None, *, backend: bool = True, tp: int = 1) -> None:
    """Every check ``--quantize-base kind`` (with ``--quantize-block-size block``) makes of a model, on
    its meta model: what ``plan`` and ``finetune`` both call, so they cannot disagree.

    NF4 blocks that do not divide a weight's rows, an FP8 tile that straddles the routed experts'
    gate/up seam, a checkpoint's FP8 tiles that another block size would re-cut, a ``tp`` split that
    would cut FP8 tiles. ``backend``: also require torchao for nf4 (a run needs it; a plan prices without it).

    Raises:
        QuantError: naming the option, the weight and a block size that fits.
    """
    from hfpipe.models.meta import build_meta_model, model_config as hf_config

    full = build_meta_model(hf_config(model_config))
    Quantizer(QuantSpec(kind, block), model_config, backend=backend, tp=tp).prepare([full], full.dtype)


class Quantizer:
    """Prepares a rank's meta stages and places their quantized weights while they load.

    Args:
        spec: The ``--quantize-base`` request.
        source_config: The checkpoint's transformers config (its FP8 block, if any).
        tp: The tensor-parallel degree the stages are then split over (FP8 only: whole tiles per rank).
        float8: Multiply FP8 linears in float8 where their dims allow (``--fp8-recipe blockwise``).
    """

    def __init__(self, spec: QuantSpec, source_config, *, backend: bool = True, tp: int = 1,
                 float8: bool = False) -> None:
        self.spec, self.tp, self.float8 = spec, tp, float8
        self.source_block = source_fp8_block(source_config)
        if spec.kind == "fp8":
            if self.source_block is not None and spec.block not in (None, self.source_block):
                raise QuantError(f"--quantize-block-size {spec.block}: the checkpoint's FP8 tiles are "
                                 f"{self.source_block}; drop the option to keep them as stored")
            self.block = spec.block or self.source_block or FP8_DEFAULT_BLOCK
        else:
            if backend:  # missing torchao says how to install it before anything loads
                torchao_nf4()
            self.block = spec.block or DEFAULT_BLOCK
        self.weights: set[str] = set()  # full-model names of the weights this quantizer places
        self.scales: set[str] = set()  # ... and of the FP8 scales it derives or reads with them
        self.stacks: dict[str, ExpertStacks] = {}  # routed-expert stacks -> their holder
        self.rows: dict[str, tuple[int, int]] = {}  # ... -> the experts [lo, hi) this rank reads

    def prepare(self, stages: list[nn.Module], dtype: torch.dtype) -> None:
        """Swap in FP8 linears (fp8) and quantized expert stacks, and record which weights to quantize;
        stages on meta."""
        self.dtype = dtype
        for stage in stages:
            linears = quantized_linears(stage)
            if self.tp > 1:
                self._check_tp(stage, linears)
            for name, linear in linears.items():
                if self.spec.kind == "nf4":
                    check_nf4(name + ".weight", linear.weight.shape, self.block)
                else:
                    parent, _, attr = name.rpartition(".")
                    new = FP8Linear(linear.in_features, linear.out_features, self.block,
                                    bias=linear.bias is not None, compute_dtype=dtype, device="meta")
                    new.float8 = self.float8 and fits_float8_tiles(new.in_features, new.out_features, self.block)
                    setattr(stage.get_submodule(parent), attr, new)
                    self.scales.add(name + ".weight_scale_inv")
                self.weights.add(name + ".weight")
            for name, experts in fused_experts(stage).items():
                self._prepare_experts(name, experts)

    def _check_tp(self, stage: nn.Module, linears: dict) -> None:
        """What a tp split of this quantized stage cannot keep exact, refused before anything loads."""
        from hfpipe.quant.tensor import check_tp_experts, check_tp_tiles

        if self.spec.kind != "fp8":
            return  # nf4 under tp: hfpipe.parallel.rules refuses it for every layout
        stored = "the checkpoint's weight_block_size" if self.source_block else None
        for name, experts in fused_experts(stage).items():
            check_tp_experts(name, experts, self.tp, self.block, stored)
        check_tp_tiles(stage, linears, self.tp, self.block, stored)

    def _prepare_experts(self, name: str, experts: nn.Module) -> None:
        # Gate and up are one stack here but two matrices in the checkpoint (and in a merged export):
        # their tiles must not straddle the seam, or the codes would depend on which one quantized them.
        gate_up = experts._parameters.get("gate_up_proj")
        if self.spec.kind == "fp8" and gate_up is not None and not getattr(experts, "is_transposed", False) \
                and (gate_up.shape[1] // 2) % self.block:
            whose = f"the checkpoint's FP8 tiles ({self.block})" if self.source_block else \
                f"--quantize-block-size {self.block}"
            raise QuantError(f"--quantize-base fp8: {whose} must divide the routed experts' "
                             f"intermediate size {gate_up.shape[1] // 2} of {name}, which stacks gate and up; "
                             "choose a block size dividing it")
        stacks = ExpertStacks(experts, name, self.spec.kind, self.block)
        register(experts)  # hfpipe's experts forward: one expert dequantized at a time
        for target in stacks.rows:
            self.stacks[target] = stacks
            self.weights.add(target)
            if self.spec.kind == "fp8":
                self.scales.add(target + "_scale_inv")
        self.rows.update(stacks.rows)

    def keeps_stored(self, target: str) -> bool:
        """Whether ``target``'s FP8 codes are kept as the checkpoint stores them (not dequantized)."""
        return self.spec.kind == "fp8" and self.source_block is not None and target in self.weights

    def place(self, target: str, tensor: torch.Tensor, scale: torch.Tensor | None, holders,
              device: torch.device, dtype: torch.dtype | None) -> bool:
        """Quantize and place weight ``target``; ``False`` if it is not one of this quantizer's.

        ``tensor`` is the checkpoint's value: full precision, or FP8 codes with their ``scale``
        when :meth:`keeps_stored`. ``holders`` are the ``(module, attr)`` pairs holding it.
        """
        if target not in self.weights:
            return False
        if target in self.stacks:
            if scale is None or not is_fp8(tensor):
                tensor, scale = tensor.to(dtype or self.dtype), None
            self.stacks[target].place(target, tensor, scale, device)
            return True
        module, attr = holders[0]
        if hasattr(module, "tp_part"):  # split over tp (hfpipe.quant.tensor): keep this rank's tiles
            from hfpipe.quant.tensor import tp_part

            tensor, scale = tp_part(module, tensor, scale)
        old = module._parameters.get(attr) if attr in module._parameters else module._buffers[attr]
        if tuple(tensor.shape) != tuple(old.shape):
            return False  # the loader's own check names the file and the shapes
        if self.spec.kind == "nf4":
            w = tensor.to(device=device, dtype=dtype or old.dtype)
            module._parameters[attr] = nn.Parameter(quantize_nf4(w, self.block), requires_grad=False)
            return True
        if scale is None or not is_fp8(tensor):
            w = tensor.to(device=device, dtype=dtype or module.compute_dtype)
            tensor, scale = quantize_blocks(w, self.block)
        want = tuple(module._buffers["weight_scale_inv"].shape)
        if tuple(scale.shape) != want:
            raise QuantError(f"{target}_scale_inv has shape {tuple(scale.shape)}, but {self.block}x{self.block} "
                             f"tiles of {tuple(tensor.shape)} need {want}; weight_block_size in config.json "
                             "does not match the scales")
        module._buffers["weight"] = tensor.to(device)
        module._buffers["weight_scale_inv"] = scale.to(device=device, dtype=torch.float32)
        return True


def apply_quant(modules: list[nn.Module], config, spec: QuantSpec | None, dtype: torch.dtype, tp: int = 1,
                float8: bool = False, device=None):
    """A quantized base's storage on the meta stage ``modules`` (``dtype``: the parameters'); the returned
    :class:`Quantizer` fills it while loading (under ``tp``, this rank's tiles of each FP8 linear), or
    ``None`` without ``spec``. ``float8``: FP8 linears multiply in float8 (``--fp8-recipe blockwise``) on
    ``device``."""
    if spec is None:
        return None
    quantizer = Quantizer(spec, config, tp=tp, float8=float8)
    quantizer.prepare(modules, dtype)
    if float8:
        linears = [m for stage in modules for m in stage.modules() if isinstance(m, FP8Linear)]
        cublas = device is not None and cublas_blockwise(device)
        for m in linears:
            m.cublas = m.float8 and cublas
        experts = _float8_experts(modules, quantizer.block, cublas) if spec.kind == "fp8" else (0, 0)
        log.info("--fp8-recipe blockwise: %d of %d FP8 linears and %d of %d routed-expert layers multiply in float8 "
                 "(dims that do not divide by 16, or transposed expert stacks, dequantize), %s",
                 sum(m.float8 for m in linears), len(linears), *experts,
                 "through torch's blockwise kernel where their dims divide by 128" if cublas else "tile by tile")
        if not cublas and device is not None and torch.device(device).type == "cuda":
            log.warning("--fp8-recipe blockwise: torch's one-GEMM blockwise kernel does not run here (it needs an "
                        "H100/H200 and torch built with CUDA 12.9 or later); tile by tile, a GEMM per 128 columns, "
                        "is likely slower than the dequantizing base: measure it against dropping --fp8")
    return quantizer


def _float8_experts(modules: list[nn.Module], block: int, cublas: bool) -> tuple[int, int]:
    """Let each stage's FP8 routed experts multiply their codes in float8 where every stack's dims allow it
    and the stacks are ``[E, out, in]`` (GPT-OSS's transposed ones keep dequantizing); ``(how many, of)``."""
    def multiply(x, codes, scales, block):
        return float8_tile_linear(x, codes, scales, block, None, cublas)

    done = total = 0
    for stage in modules:
        for experts in fused_experts(stage).values():
            stacks = [t for a in STACKS if (t := experts._buffers.get(a)) is not None and is_fp8(t)]
            if not stacks:
                continue
            total += 1
            if getattr(experts, "is_transposed", False) or \
                    not all(fits_float8_tiles(t.shape[2], t.shape[1], block) for t in stacks):
                continue
            experts_state(experts).multiply = multiply
            done += 1
    return done, total


def check_shardable(modules: list[nn.Module], dp: int) -> None:
    """Raise :class:`QuantError` unless every NF4 weight splits into ``dp`` equal FSDP2 row shards.

    FSDP2 pads a parameter whose rows do not divide evenly, and an ``NF4Tensor`` cannot be padded
    (nor split inside a group of scales). FP8 weights are buffers, kept whole on every dp rank.
    """
    for module in modules:
        for name, p in module.named_parameters():
            w = getattr(p, "_local_tensor", p)
            if not hasattr(w, "quantization_factor"):
                continue
            parts = (w.shape[0], w.quantized_scalers.numel(), w.quantization_factor.numel())
            if any(n % dp for n in parts):
                raise QuantError(f"--dp {dp}: NF4 weight {name} ({w.shape[0]} rows, {parts[2]} groups of scales) "
                                 f"does not split into {dp} equal FSDP2 shards; use --dp 2, 4 or 8, or "
                                 "--quantize-base fp8")
