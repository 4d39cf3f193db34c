"""Float8 training (``--fp8``): the decoder layers' matmuls in float8 through torchao's ``Float8Linear``.

Not a storage format (that is ``--quantize-base fp8``, :mod:`hfpipe.quant.fp8`): the weights, their
gradients, the optimizer state, checkpoints and exports keep the run's dtypes and names. torchao's
``convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear`` (a subclass) that
holds the *same* ``weight`` and ``bias`` parameters and, in every forward and backward, casts the
input, the weight and the output gradient to float8 with dynamic scales (``rowwise``: one scale per
row, torchtitan's default; ``tensorwise``: one per tensor) and multiplies in float8 (``torch._scaled_mm``;
emulated on a CPU). So a state dict is unchanged by the conversion, key for key and dtype for dtype.

Which linears: those inside a decoder layer that a quantized base would quantize
(:func:`hfpipe.models.targets.quantized_linears`: not a MoE router, whose rounding would change which
experts run, nor a linear subclass with a forward of its own), and whose both dims divide by 16
(``_scaled_mm``'s requirement). The embedding, norms and head stay in the compute dtype, as do fused
routed experts (3-D parameters, not linears) and LoRA's adapters (added after, in their own dtype).
Under LoRA the frozen base multiplies in float8 too, computed from float8 casts (never dequantized
first), and skips its weight's gradient GEMM (:mod:`hfpipe.quant.float8_frozen`).
torchao's own filter (``_auto_filter_for_recipe``) also skips small layers for speed on an H100; here
the shapes alone decide, so a small model's run computes in float8 as a large one does.

The build step (:mod:`hfpipe.pipeline.build`) runs on the meta stages before ``apply_tp``, whose plan
then splits the ``Float8Linear`` modules with torch's own styles: each rank casts its DTensor shards
(DTensor computes a tensorwise scale's amax over the ranks) and multiplies in float8, while the
collectives stay in bf16. torchao's float8 styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
``PrepareFloat8ModuleInput``, torchtitan's choice under tensorwise) would move float8 bytes instead,
but gloo cannot carry float8 (``RuntimeError: Invalid scalar type`` in the backward's all-gather,
torch 2.13), so they could not be checked against bf16 here; torchtitan keeps bf16 collectives under
rowwise too. torchao is imported only when a run asks for float8 (its import is slow, and it is an
optional extra).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hfpipe.models.targets import quantized_linears
from hfpipe.quant.fp8_matmul import SCALED_MM_DIVISOR
from hfpipe.quant.nf4 import QuantError

__all__ = ["apply_fp8", "float8_linears", "warn_if_uncompiled"]

log = logging.getLogger(__name__)


def float8_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Full-model name -> each linear of ``module``'s decoder layers that ``--fp8`` runs in float8."""
    return {name: linear for name, linear in quantized_linears(module).items()
            if linear.in_features % SCALED_MM_DIVISOR == 0 and linear.out_features % SCALED_MM_DIVISOR == 0}


def _float8_config(recipe: str):
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        raise QuantError("--fp8 needs torchao: pip install 'hfpipe[qlora]' (or torchao)") from None
    return Float8LinearConfig.from_recipe_name(recipe)


def _check_device(device) -> None:
    """A GPU without float8 matmuls fails in the first step inside ``torch._scaled_mm``: say so first.
    (On a CPU torch runs them, slowly: tests use that.)"""
    if device is None or torch.device(device).type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise QuantError(f"--fp8 needs float8 matmuls (compute capability 8.9 or later: L4, L40S, H100, ...); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: drop --fp8")


def apply_fp8(modules: list[nn.Module], recipe: str | None, device=None) -> int:
    """Swap the :func:`float8_linears` of each (meta) stage in ``modules`` for torchao's ``Float8Linear``
    with ``recipe``'s config (checked by :func:`hfpipe.config.names.check_fp8`), in place, for a run on
    ``device``; returns how many (0 without a recipe)."""
    if recipe is None:
        return 0
    _check_device(device)
    if recipe == "blockwise":  # not torchao's: the FP8 base's own linears (hfpipe.pipeline.build, apply_quant)
        return 0
    config = _float8_config(recipe)
    from torchao.float8 import convert_to_float8_training

    from hfpipe.quant.float8_frozen import FrozenAwareFloat8Linear  # imports torchao: only when asked for

    count = 0
    for stage in modules:
        chosen = set(float8_linears(stage))
        # torchao's filter gets each linear's name below the module it converts: the stage's names
        convert_to_float8_training(stage, config=config,
                                   module_filter_fn=lambda _m, name, picked=chosen: name in picked)
        for name in chosen:
            linear = stage.get_submodule(name)
            # torchao's converter makes its own class (and readies inductor for float8); ours only adds a
            # backward without the weight's gradient for a frozen (LoRA) base
            linear.__class__ = FrozenAwareFloat8Linear
            linear.plain_linear = True  # x @ W.T + b: still a target of LoRA's all-linear (models.targets)
        count += len(chosen)
    log.info("--fp8 %s: %d decoder-layer linears compute in float8", recipe, count)
    return count


def warn_if_uncompiled(recipe: str | None, compiled: bool, device) -> None:
    """Log that ``--fp8`` without ``--compile`` is slower than bf16 on a GPU: torchao's casts to float8 run as
    separate kernels unless inductor fuses them (measured on an H200: 0.61x of bf16-mixed eager, where
    ``--compile --fp8`` ran 1.06x of ``--compile``; docs/benchmarks.md)."""
    if recipe in ("rowwise", "tensorwise") and not compiled and device is not None \
            and torch.device(device).type == "cuda":
        log.warning("--fp8 without --compile runs torchao's float8 casts unfused: slower than bf16 on a GPU "
                    "(0.61x measured on an H200); add --compile")
