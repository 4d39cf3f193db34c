"""Load one rank's stage tensors from an HF safetensors checkpoint, shard by shard.

The rank plans its reads from the index alone: each checkpoint key is mapped to the in-memory
name with transformers' own conversion tables (fused MoE experts), then classified as *this
stage's*, *another stage's*, *a layer the HF model lacks* (DeepSeek-V3's MTP layer, skipped) or
*unexpected* (an error naming the key and its file). Only the shards holding this stage's keys
are opened, and only those tensors are read. Conversion is total: every stage tensor must come
from the checkpoint, or loading fails naming the key.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from hfpipe.models.conversion import model_key_mapper
from hfpipe.models.registry import adapter_for
from hfpipe.source.safetensors_io import SafetensorsError, read_tensors
from hfpipe.source.tensor_checks import fp8_block
from hfpipe.source.folder import ModelSource, SourceError

__all__ = ["LoadError", "LoadStats", "load_stage_weights", "model_key_mapper"]

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # per-expert checkpoint keys: `mlp.experts.3.gate_proj.weight`
_SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3 FP8: `<name>.weight_scale_inv` beside `<name>.weight`


class LoadError(SourceError):
    """The checkpoint does not match the model (missing, unexpected or mis-shaped tensors)."""


@dataclass
class LoadStats:
    """What a rank read: for tests and ``bench/load.py``."""

    files_opened: list[str] = field(default_factory=list)
    keys_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    skipped_mtp: int = 0


@dataclass
class _Unit:
    """One in-memory tensor and the checkpoint tensors it is made from."""

    target: str
    sources: list[str]
    converter: object = None  # a transformers WeightConverter, or None for a plain copy
    patterns: list = field(default_factory=list)  # the converter pattern each source matched
    fp32_for: frozenset = frozenset()  # stage dtypes in which from_pretrained keeps this tensor fp32
    rows: tuple[int, int] | None = None  # expert parallelism: the rows [lo, hi) of dim 0 this rank holds
    sliced: frozenset = frozenset()  # fused 3-D sources read as those rows only


def _plan_units(source: ModelSource, full_keys: set[str], wanted: set[str], mapper, num_mtp: int,
                rows: dict | None = None):
    """Classify every checkpoint key; return this stage's units and the number of MTP keys skipped.

    ``rows`` maps the expert-parallel targets to the experts ``[lo, hi)`` this rank holds: of a
    per-expert layout only those experts' keys are read; a fused 3-D tensor is read as those rows.
    """
    rows = rows or {}
    n_layers = source.config.num_hidden_layers
    units: dict[str, _Unit] = {}
    skipped = 0
    for key in sorted(source.weight_map):
        if key.endswith(_SCALE_SUFFIX):
            continue  # read together with its weight
        m = _LAYER.match(key)
        if m and n_layers <= int(m.group(1)) < n_layers + num_mtp:
            skipped += 1
            continue
        target, converter, pattern = mapper(key)
        if target not in full_keys:
            raise LoadError(
                f"{source.weight_map[key]}: unexpected tensor {key!r} (the {source.config.model_type} "
                "model has no such parameter); the config does not match the weights"
            )
        if target in wanted:
            unit = units.setdefault(target, _Unit(target, [], converter and copy.deepcopy(converter),
                                                  rows=rows.get(target)))
            if unit.rows is not None and not _keep_expert(unit, key):
                continue
            unit.sources.append(key)
            unit.patterns.append(pattern)
    if source.tied and "lm_head.weight" in wanted and "lm_head.weight" not in units:
        # Tied checkpoints store the head only as the embedding.
        units["lm_head.weight"] = _Unit("lm_head.weight", ["model.embed_tokens.weight"])
    missing = sorted(wanted - set(units))
    if missing:
        where = "model.safetensors.index.json" if len(set(source.weight_map.values())) > 1 else "model.safetensors"
        raise LoadError(f"{source.folder / where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
                        "the checkpoint is incomplete or does not match config.json")
    return list(units.values()), skipped


def _keep_expert(unit: _Unit, key: str) -> bool:
    """Whether ``key`` feeds this rank's experts of ``unit``; a fused key is marked to be read sliced."""
    m = _EXPERT.search(key)
    if m is None:
        unit.sliced = unit.sliced | {key}
        return True
    return unit.rows[0] <= int(m.group(1)) < unit.rows[1]


def _with_scales(source: ModelSource, keys: list[str]) -> list[str]:
    return keys + [k + _SCALE_SUFFIX for k in keys if k + _SCALE_SUFFIX in source.weight_map]


def _dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 -> fp32: each (block[0] x block[1]) tile is multiplied by its scale."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def load_stage_weights(stages: list[nn.Module], source: ModelSource, device: torch.device,
                       dtype: torch.dtype | None = None, quantizer=None) -> LoadStats:
    """Fill the meta-device ``stages`` of one rank with their tensors from ``source``.

    Args:
        stages: This rank's :class:`hfpipe.models.stage.PipelineStageModule` objects (meta device).
        source: The opened checkpoint.
        device: Where the tensors go.
        dtype: Floating dtype of the stage parameters; ``None`` keeps each meta parameter's dtype.
        quantizer: A prepared :class:`hfpipe.quant.linear.Quantizer` (``--quantize-base``), which
            quantizes each base weight as its shard is read; ``None`` loads full precision.

    Returns:
        What was opened and read.

    Raises:
        LoadError: a tensor is missing, unexpected or has the wrong shape.
    """
    adapter = adapter_for(source.config)
    targets = _stage_targets(stages)
    full_keys = set(_full_model_keys(stages[0]))
    mapper = model_key_mapper(stages[0]._hf_model)
    wanted = set(targets) - (quantizer.scales if quantizer else set())  # scales come with their weights
    rows = _expert_rows(targets) | (quantizer.rows if quantizer else {})
    units, skipped = _plan_units(source, full_keys, wanted, mapper, adapter.num_mtp_layers(source.config), rows)
    if skipped:
        log.info("skipped %d checkpoint tensors of MTP layers the HF model does not have", skipped)
    stats = LoadStats(skipped_mtp=skipped)
    _mark_fp32(units, stages[0]._hf_model)
    _read_and_place(units, source, targets, device, dtype, stats, quantizer)
    from hfpipe.models.stage import rebuild_buffers

    for stage in stages:
        rebuild_buffers(stage, device)
        _check_materialised(stage)
    return stats


def _expert_rows(targets) -> dict[str, tuple[int, int]]:
    """Targets sharded by rows over ep or tp (DTensor parameters; the codes of an FP8 linear split colwise,
    buffers that say their part in ``tp_part``: hfpipe.quant.tensor) -> the rows of dim 0 this rank holds."""
    from hfpipe.parallel.expert import local_rows

    out = {}
    for key, holders in targets.items():
        owner, attr = holders[0]
        span = local_rows(owner._parameters.get(attr))
        part = getattr(owner, "tp_part", None)
        if attr == "weight" and part is not None and part[0] == 0:
            span = part[1:]
        if span is not None:
            out[key] = span
    return out


def _read_and_place(units, source, targets, device, dtype, stats: LoadStats, quantizer=None) -> None:
    """Read shard by shard; finish each unit as soon as all its tensors are in."""
    needed_by_file: dict[str, list[str]] = defaultdict(list)
    waiting: dict[str, list[_Unit]] = defaultdict(list)
    slices: dict[str, tuple[int, int]] = {}
    for unit in units:
        for key in _with_scales(source, unit.sources):
            needed_by_file[source.weight_map[key]].append(key)
            waiting[key].append(unit)
    have: dict[str, torch.Tensor] = {}
    block = fp8_block(source.config) or (128, 128)  # DeepSeek's tiles where the config names none
    for unit in units:
        for key in unit.sliced:
            slices.update(_row_slices(source, key, unit.rows, block[0]))
    for fname in sorted(needed_by_file):
        keys = sorted(set(needed_by_file[fname]))
        try:
            tensors = read_tensors(source.path(fname), keys, source.header(fname), rows=slices)
        except SafetensorsError as e:
            raise LoadError(str(e)) from None
        stats.files_opened.append(fname)
        stats.keys_read.extend(keys)
        stats.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        have.update(tensors)
        for unit in {id(u): u for k in keys for u in waiting[k]}.values():
            wanted = _with_scales(source, unit.sources)
            if all(k in have for k in wanted):
                keep = quantizer is not None and quantizer.keeps_stored(unit.target)
                tensor, scale = _finish_unit(unit, have, source, block, keep)
                if quantizer is None or not quantizer.place(unit.target, tensor, scale, targets[unit.target],
                                                            device, dtype):
                    _place(targets[unit.target], tensor, device, dtype, unit, source)
                for k in wanted:
                    if all(u is unit for u in waiting[k]):
                        have.pop(k, None)


def _row_slices(source: ModelSource, key: str, rows: tuple[int, int], tile: int) -> dict:
    """The rows to read of ``key`` and of its FP8 scales: the same experts of a 3-D stack; of a 2-D FP8
    weight, the tiles over its rows, or nothing (read whole, sliced once dequantized) when its rows do not
    start on a tile edge. A weight without scales: its rows."""
    scale = key + _SCALE_SUFFIX
    if scale not in source.weight_map:
        return {key: rows}
    if len(source.header(source.weight_map[key])[key]["shape"]) != 2:
        return {key: rows, scale: rows}
    lo, hi = rows
    return {key: rows, scale: (lo // tile, -(-hi // tile))} if lo % tile == 0 else {}


def _finish_unit(unit: _Unit, have: dict, source: ModelSource, block, keep_fp8: bool = False):
    """``(tensor, scale)`` of ``unit``: converters applied, FP8 dequantized (``scale`` None).

    With ``keep_fp8`` and every source FP8, the codes and the scales go through the converter
    separately (stacked and concatenated alike: a MoE layer's per-expert weights become one stack of
    codes and one of scales), so the checkpoint's values are kept as stored.
    """
    tensors, scales = {}, {}
    for key in unit.sources:
        t = have[key]
        scales[key] = have.get(key + _SCALE_SUFFIX)
        if scales[key] is None and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise LoadError(f"{source.weight_map[key]}: FP8 weight {key!r} has no {key + _SCALE_SUFFIX!r} "
                            "beside it; the checkpoint is incomplete: re-download it")
        tensors[key] = t
    keep_fp8 = keep_fp8 and all(s is not None for s in scales.values())
    if not keep_fp8:
        tensors = {k: t if scales[k] is None else _dequantize(t, scales[k], block) for k, t in tensors.items()}
        return _convert(unit, unit.converter, tensors, source), None
    scale_converter = copy.deepcopy(unit.converter)  # before the codes' converter has seen a tensor
    return _convert(unit, unit.converter, tensors, source), _convert(unit, scale_converter, scales, source)


def _convert(unit: _Unit, conv, tensors: dict, source: ModelSource) -> torch.Tensor:
    """``tensors`` (checkpoint key -> value) through ``unit``'s converter, or the one tensor as it is."""
    if conv is None:
        return tensors[unit.sources[0]]
    for key, pattern in zip(unit.sources, unit.patterns):
        conv.add_tensor(unit.target, key, pattern, tensors[key])
    return conv.convert(unit.target, config=source.config)[unit.target]


def _mark_fp32(units: list[_Unit], hf_model: nn.Module) -> None:
    """Mark the tensors transformers keeps in fp32 in a bf16/fp16 model (DeepSeek's router bias).

    The rule is the model's own ``_keep_in_fp32_modules(_strict)`` as ``from_pretrained`` applies it.
    """
    from transformers.core_model_loading import build_glob_alternation

    for half in (torch.bfloat16, torch.float16):
        plan = hf_model._get_dtype_plan(half)
        if not plan:
            continue
        pattern = build_glob_alternation(list(plan))[0]
        for unit in units:
            if pattern.search(unit.target):
                unit.fp32_for = unit.fp32_for | {half}


def _place(holders, tensor, device, dtype, unit: _Unit, source) -> None:
    """Swap the meta tensor held at every ``(module, attr)`` of ``holders`` for ``tensor``.

    Checks the shape, casts to the stage dtype, and keeps shared tensors (a tied head) shared.
    """
    owner, attr = holders[0]
    is_param = attr in owner._parameters
    old = owner._parameters[attr] if is_param else owner._buffers[attr]
    sharded = getattr(old, "device_mesh", None) is not None  # split over ep or tp: a DTensor
    expected = old.to_local().shape if sharded else old.shape
    if sharded and tuple(tensor.shape) == tuple(old.shape) != tuple(expected):
        tensor = _local_part(tensor, old)  # read whole (a column split, packed blocks): keep this rank's part
    if tuple(tensor.shape) != tuple(expected):
        raise LoadError(
            f"{source.weight_map.get(unit.sources[0], '?')}: {unit.sources[0]!r} has shape "
            f"{tuple(tensor.shape)} but the model expects {tuple(expected)}; config.json does not match the weights"
        )
    target_dtype = old.dtype if (dtype is None or not old.is_floating_point()) else dtype
    if target_dtype in unit.fp32_for:
        target_dtype = torch.float32
    new = tensor.to(device=device, dtype=target_dtype)
    if sharded:
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(new, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                 stride=old.stride())
    if is_param:
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for module, name in holders:
        (module._parameters if is_param else module._buffers)[name] = new


def _local_part(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of ``full`` as DTensor ``like`` holds it (one mesh dimension after another)."""
    from hfpipe.parallel.tensor_slices import local_slice

    mesh = like.device_mesh
    for i, placement in enumerate(like.placements):
        full = local_slice(full, placement, mesh.get_local_rank(i), mesh.size(i))
    return full.contiguous()


def _stage_targets(stages) -> dict[str, list[tuple[nn.Module, str]]]:
    """In-memory key -> every (module, attribute) on this rank that holds it.

    A tensor shared by two stage modules (tied head on the same rank) is placed once and then
    re-shared, so it is listed once here.
    """
    targets: dict[str, list] = {}
    first_name: dict[int, str] = {}
    for stage in stages:
        for name, module in stage.named_modules(remove_duplicate=False):
            tensors = list(module._parameters.items()) + [
                (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
            ]
            for attr, t in tensors:
                if t is None:
                    continue
                key = first_name.setdefault(id(t), f"{name}.{attr}" if name else attr)
                holders = targets.setdefault(key, [])
                if (module, attr) not in holders:
                    holders.append((module, attr))
    return targets


def _full_model_keys(stage) -> list[str]:
    return list(stage._hf_model.state_dict().keys())


def _check_materialised(stage: nn.Module) -> None:
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        if t.is_meta:
            raise LoadError(f"{name} was not loaded from the checkpoint; the checkpoint does not match the model")
