"""Checks of a checkpoint's tensors that need only their names and headers, run where those are read.

- **Block-FP8 scales** (:func:`check_fp8_scales`): a ``weight_scale_inv`` must hold exactly one scale
  per ``weight_block_size`` tile of its weight (``ceil(rows/b0) x ceil(cols/b1)``, per expert for a
  stack). The dequantization repeats each scale over its tile and crops, so a scale grid of another
  shape (a wrong block size in config.json, extra tiles) would silently scale weights wrongly.
- **Routed experts** (:func:`check_expert_keys`, :class:`ExpertShapes`): per-expert keys
  (``...experts.<e>.<proj>``) and fused keys (``...experts.<proj>``) never mixed in one layer; every
  expert ``0 .. n-1`` of the config holds every projection the layer's other experts hold; and the
  experts of one projection have one shape. The loader stacks the experts into one tensor and would
  otherwise fail inside a worker (``stack expects each tensor to be equal size``), name a present key
  for a missing one, or ignore a stray fused key.

Each check returns the problem as one line (None when there is none): :mod:`hfpipe.source.folder`
raises it as its ``SourceError``, and this module stays a floor below the config reader.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

from hfpipe.models.moe import routed_experts

__all__ = ["ExpertShapes", "check_expert_keys", "check_fp8_scales", "decoder_layers", "fp8_block"]

SCALE = "_scale_inv"
_PER_EXPERT = re.compile(r"^(?P<layer>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FUSED = re.compile(r"^(?P<layer>(?:.*\.)?experts)\.(?P<rest>[^.\d][^.]*(?:\.[^.]+)?)$")


def fp8_block(config) -> tuple[int, int] | None:
    """``weight_block_size`` of a block-FP8 config (DeepSeek's default 128 x 128), else None."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[-1])


def check_fp8_scales(where: Path, weight: str, shape, scale_shape, block: tuple[int, int]) -> str | None:
    """Refuse a scale grid that is not one scale per ``block`` tile of ``weight`` (the last two dims)."""
    *lead, rows, cols = shape
    want = [*lead, -(-rows // block[0]), -(-cols // block[1])]
    if list(scale_shape) != want:
        return (f"{where}: {weight + SCALE!r} has shape {list(scale_shape)}, but weight_block_size "
                          f"{list(block)} tiles {weight!r} {list(shape)} into {want}; config.json's "
                          "quantization_config does not match the checkpoint: fix weight_block_size or re-download")
    return None


def decoder_layers(config) -> int | None:
    """The decoder layers the model has: keys of layers past them (DeepSeek's MTP layers) are skipped
    by the loader, never read, so their experts are not checked either."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_hidden_layers", None)


def _skipped(layer: str, layers: int | None) -> bool:
    m = _LAYER.search(layer)
    return layers is not None and m is not None and int(m[1]) >= layers


def check_expert_keys(where: Path, names, config) -> str | None:
    """Per-expert and fused keys not mixed, and every routed expert's keys present (names only)."""
    per, fused = defaultdict(lambda: defaultdict(set)), defaultdict(list)
    layers = decoder_layers(config)
    for key in names:
        if (m := _PER_EXPERT.match(key)) is not None and _skipped(m["layer"], layers):
            continue
        if m is not None:
            per[m["layer"]][m["rest"]].add(int(m["e"]))
        elif (m := _FUSED.match(key)) is not None:
            fused[m["layer"]].append(key)
    n = routed_experts(config)[0]
    for layer in sorted(per):
        if fused.get(layer):
            return (f"{where}: {fused[layer][0]!r} is a fused expert tensor, but {layer} also has "
                              "per-expert tensors; a checkpoint holds one layout per layer: re-download it")
        for rest, have in sorted(per[layer].items()):
            want = set(range(n)) if n else set().union(*per[layer].values())
            if missing := sorted(want - have):
                return (f"{where}: tensor {f'{layer}.{missing[0]}.{rest}'!r} is missing ({len(missing)} "
                                  f"of {len(want)} experts of {layer}.*.{rest} missing); the checkpoint is "
                                  "incomplete or does not match config.json")
            if extra := sorted(have - want):
                return (f"{where}: tensor {f'{layer}.{extra[0]}.{rest}'!r} is an expert beyond the "
                                  f"{n} routed experts config.json declares; the checkpoint does not match it")
    return None


class ExpertShapes:
    """The shapes of per-expert tensors seen so far, grouped by layer and projection.

    Headers are read one shard at a time (a rank reads only its own); each new header's experts are
    checked against the others of their group read so far, so all of them are once every header is.
    """

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], dict[str, tuple]] = defaultdict(dict)

    def add(self, where: Path, header: dict, layers: int | None = None) -> str | None:
        """Record ``header``'s expert shapes; the problem if an expert's shape differs from its group's.
        Layers from ``layers`` on (:func:`decoder_layers`) are skipped."""
        touched = set()
        for key, entry in header.items():
            m = _PER_EXPERT.match(key) if isinstance(entry, dict) else None
            if m is not None and not _skipped(m["layer"], layers):
                self.groups[m["layer"], m["rest"]][key] = tuple(entry.get("shape") or ())
                touched.add((m["layer"], m["rest"]))
        for layer, rest in sorted(touched):
            members = self.groups[layer, rest]
            common, _ = Counter(members.values()).most_common(1)[0]
            odd = sorted(k for k, s in members.items() if s != common)
            if odd:
                return (f"{where.parent}: tensor {odd[0]!r} has shape {list(members[odd[0]])}, but "
                                  f"the other experts' {rest} in {layer} are {list(common)}; the checkpoint "
                                  "is damaged: re-download it")
        return None
