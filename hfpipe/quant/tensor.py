"""Block-FP8 linears split over tensor-parallel ranks (``--tp`` with ``--quantize-base fp8``).

A colwise linear keeps this rank's rows of the FP8 codes and the rows of the tile-scale grid over
them; a rowwise linear its columns of both. Only a split on tile boundaries keeps every tile whole on
one rank, with the one scale it was quantized with, so the rank's codes dequantize to exactly its slice
of the whole weight; any other split is refused in one line (:func:`check_tp_tiles`).

torch's ``ColwiseParallel``/``RowwiseParallel`` distribute a linear's *parameters* as DTensors and run
its forward on DTensors; an FP8 linear holds its codes and scales as buffers and dequantizes plain
tensors (tile by tile: on a DTensor the scale grid would be repeated with global shapes). transformers
runs its own FP8 linears under TP on local tensors: its ``ColwiseParallel``/``RowwiseParallel``, for a
module flagged ``_hf_quantized_needs_local_tp``, sum the input gradient over the ranks (colwise) or the
partial outputs (rowwise: all-reduce, or reduce-scatter by sequence), and split the bias. Those styles
run the forward here (:class:`FP8Split`); what no library does, split the codes and the scale grid
together, is written here. A MoE layer's FP8 expert stacks split alike (:class:`FP8ExpertsSplit`: gate and
up rows, down columns, as transformers' ``moe_tp_experts`` splits full-precision stacks).

The order (:mod:`hfpipe.pipeline.build`): the quantizer swaps in FP8 storage on the meta stage, these
styles cut it, the loader fills this rank's part (a colwise weight is read as its rows and the scale rows
of the tiles over them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from hfpipe.models.experts import experts_state
from hfpipe.parallel.tensor_plan import _Experts, _MlaKvA, stage_tp_plan
from hfpipe.parallel.tensor_slices import shard_ranges
from hfpipe.quant.fp8 import FP8Linear, take_ranges, tile_ranges
from hfpipe.quant.nf4 import QuantError

__all__ = ["FP8ExpertsSplit", "FP8Split", "check_tp_experts", "check_tp_tiles", "fp8_tp_plan", "tp_part"]

#: A fused experts stack -> how transformers' moe_tp_experts splits it: gate and up halves by their rows
#: (packed), down by its columns.
_STACK_SPLITS = {"gate_up_proj": _StridedShard(dim=1, split_factor=2), "down_proj": Shard(2)}


def _split_dim(style) -> int | None:
    """The weight dim a plan style splits (0 colwise, 1 rowwise); ``None``: the linear stays whole."""
    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        return 1
    return None


def check_tp_tiles(stage: nn.Module, linears: dict[str, nn.Linear], tp: int, block: int,
                   stored: str | None = None) -> None:
    """Refuse an FP8 linear whose tp split would cut a tile (``linears``: the stage's quantized ones;
    ``stored``: what sets the tiles when a checkpoint's own FP8 is kept, else ``--quantize-block-size``).

    Raises:
        QuantError: naming the weight, its per-rank share, the tile and the tp degree.
    """
    plan = stage_tp_plan(stage.config, [n for n, _ in stage.named_modules()], True, tp)
    for name, linear in linears.items():
        style = plan.get(name)
        dim = _split_dim(style)
        if dim is None and style is not None and not isinstance(style, _MlaKvA):
            raise QuantError(f"--tp {tp} with --quantize-base fp8: {name} is split by {type(style).__name__}, "
                             "which has no FP8 split; use --tp 1")
        if dim is None:
            continue  # whole on every rank (MLA's q_a_proj, kv_a_proj_with_mqa): its tiles stay whole
        size = (linear.out_features, linear.in_features)[dim]
        _check_whole_tiles(f"{name}.weight's {size} {('rows', 'columns')[dim]} split into", size, tp, block, stored)


def check_tp_experts(name: str, experts: nn.Module, tp: int, block: int, stored: str | None = None) -> None:
    """Refuse fused experts whose FP8 stacks a tp split would cut off their tiles (or cannot split)."""
    gate_up = experts._parameters.get("gate_up_proj")
    if gate_up is None or getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise QuantError(f"--tp {tp} with --quantize-base fp8: the routed experts of {name} are not a [gate; up] "
                         "stack that tp splits on FP8 tiles; use --tp 1 (--ep shards them)")
    inter = gate_up.shape[1] // 2
    _check_whole_tiles(f"the routed experts' intermediate size {inter} of {name} splits into", inter, tp, block, stored)


def _check_whole_tiles(what: str, size: int, tp: int, block: int, stored: str | None) -> None:
    """Refuse a dim of ``size`` that ``tp`` ranks would split off its ``block``-wide FP8 tiles (``what`` names it)."""
    if size % tp == 0 and (size // tp) % block == 0:
        return
    fix = f"a --quantize-block-size that divides {size // tp}" if stored is None and size % tp == 0 else \
        "a --tp that keeps whole tiles on each rank"
    raise QuantError(f"--tp {tp} with --quantize-base fp8: {what} {size / tp:g} per tp rank, which cuts its "
                     f"{block}x{block} FP8 tiles ({stored or f'--quantize-block-size {block}'}); use {fix}, or --tp 1")


def fp8_tp_plan(stage: nn.Module, plan: dict) -> dict:
    """``plan`` with every FP8 linear's colwise/rowwise style replaced by its :class:`FP8Split`, and the
    FP8 routed experts' by :class:`FP8ExpertsSplit`."""
    out = dict(plan)
    for name, style in plan.items():
        module = stage.get_submodule(name)
        if _split_dim(style) is not None and isinstance(module, FP8Linear):
            out[name] = FP8Split(style)
        elif isinstance(style, _Experts) and "gate_up_proj_scale_inv" in module._buffers:
            out[name] = FP8ExpertsSplit()
    return out


def tp_part(module: nn.Module, tensor: torch.Tensor, scale: torch.Tensor | None):
    """This rank's part of an FP8 linear's whole weight (full precision, or codes with their ``scale``
    grid), as :class:`FP8Split` cut the module; the tensors as they are for a whole linear."""
    part = getattr(module, "tp_part", None)
    if part is None or tuple(tensor.shape) != (module.out_features, module.in_features):
        return tensor, scale
    dim, lo, hi = part
    tensor = take_ranges(tensor, dim, [(lo, hi)])
    if scale is not None:  # lo is a tile boundary; hi one too, or the weight's edge (a partial last tile)
        scale = take_ranges(scale, dim, tile_ranges([(lo, hi)], module.block))
    return tensor, scale


class FP8Split(ParallelStyle):
    """An FP8 linear split as the plan's torch ``style`` splits a linear (module docstring).

    The codes and the scale grid become this rank's rows (colwise) or columns (rowwise), as plain
    buffers the loader fills through :func:`tp_part`; ``in_features``/``out_features`` stay whole,
    so PEFT sizes the adapters whole and :mod:`hfpipe.lora.tensor` splits them as usual.
    """

    def __init__(self, style: ColwiseParallel | RowwiseParallel):
        super().__init__()
        from transformers.distributed import tensor_parallel as hf

        self.dim = _split_dim(style)
        inp, out = style.input_layouts[0], style.output_layouts[0]
        kind = hf.ColwiseParallel if self.dim == 0 else hf.RowwiseParallel
        self.hf = kind(input_layouts=inp, output_layouts=out, use_local_output=style.use_local_output)

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        whole = (module.out_features, module.in_features)
        dim, ((lo, hi),) = shard_ranges(whole, Shard(self.dim), mesh.get_local_rank(), mesh.size())
        block, q, s = module.block, module._buffers["weight"], module._buffers["weight_scale_inv"]
        if lo % block or (hi % block and hi != whole[dim]):
            raise QuantError(f"--tp {mesh.size()}: an FP8 linear of {whole} splits at {lo}:{hi}, off its "
                             f"{block}x{block} tiles")  # check_tp_tiles refuses this before any load
        module.tp_part = (dim, lo, hi)
        module._buffers["weight"] = take_ranges(q, dim, [(lo, hi)])
        module._buffers["weight_scale_inv"] = take_ranges(s, dim, tile_ranges([(lo, hi)], block))
        if module.bias is not None:
            self.hf.shard_param(module, "bias", mesh)  # colwise: its rows; rowwise: whole, added once
        module._hf_quantized_needs_local_tp = True  # transformers' styles then run it on local tensors
        self.hf.install_forward(module, mesh)
        return module


class FP8ExpertsSplit(ParallelStyle):
    """FP8 routed-expert stacks split as transformers' ``moe_tp_experts`` splits full-precision ones.

    Each rank keeps its rows of the gate and of the up half of ``gate_up_proj`` and its columns of
    ``down_proj``, codes and per-expert scale grids together (on tile edges: :func:`check_tp_experts`),
    in ``tp_parts`` for :class:`hfpipe.quant.experts.ExpertStacks` to fill; hfpipe's experts forward runs
    on them and transformers' ``MoeExpertsParallel`` sums the ranks' partial outputs (:class:`_Experts`,
    whose parameter splits find no parameters here: the stacks are buffers).
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        block, parts = experts_state(module).block, {}
        for attr, placement in _STACK_SPLITS.items():
            q = module._buffers.get(attr)
            if q is None:
                continue
            dim, ranges = shard_ranges(q.shape, placement, mesh.get_local_rank(), mesh.size())
            parts[attr] = (dim, ranges)
            module._buffers[attr] = take_ranges(q, dim, ranges)
            scale = module._buffers[attr + "_scale_inv"]
            module._buffers[attr + "_scale_inv"] = take_ranges(scale, dim, tile_ranges(ranges, block))
        module.tp_parts = parts
        return _Experts()._apply(module, mesh)
