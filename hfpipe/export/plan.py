"""Export's plan, made on a meta-device model before a byte is read: which tensors, in which groups,
under which exported names and dtypes, in which shard.

A group is what transformers converts as a unit (one decoder layer, or one other tensor), so
revert_weight_conversion runs on meta tensors here to learn the exported names and shapes (fused
MoE experts -> per-expert keys) and again on real tensors, group by group, when export writes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfpipe.checkpoint.safe_metadata import _DcpReader
from hfpipe.export.guard import ExportError
from hfpipe.quant.fp8 import FP8_DTYPES

__all__ = ["Group", "assign_shards", "cross_check", "dominant_dtype", "few", "flat", "nbytes", "plan_groups",
           "revert_as_source", "set_out_dtypes"]

log = logging.getLogger("hfpipe.export.hf_folder")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class Group:
    """Checkpoint tensors converted as a unit (one decoder layer, or one other tensor)."""

    fqns: list[str]  # in-memory transformers names; DCP key is "model." + fqn
    out: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)  # exported key -> spec
    as_is: frozenset = frozenset()  # fqns the source stores under the in-memory name (fused 3-D experts)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(*spec) for spec in self.out.values())


def nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def flat(groups: list[Group]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {k: spec for g in groups for k, spec in g.out.items()}


def plan_groups(model: torch.nn.Module, reader: _DcpReader, ckpt: Path, source_keys=()) -> list[Group]:
    """Group the checkpoint's model tensors by layer and name their exported keys (on meta).

    A tensor the source stores under its in-memory name (``source_keys``: a checkpoint with fused
    3-D experts, as some hub models ship) is exported as it is, so the export keeps the source's layout.
    """
    source_keys = set(source_keys or ())
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    full = model.state_dict()
    expected = remove_tied_weights_from_state_dict(dict(full), model)
    for key in model._keys_to_ignore_on_save or ():
        expected.pop(key, None)
    saved = reader.tensors("model.")
    for alias in (set(full) - set(expected)) & set(saved):
        log.info("%s: %s is tied to another weight; not exported", ckpt, alias)
        del saved[alias]
    missing, extra = [k for k in expected if k not in saved], [k for k in saved if k not in expected]
    if missing or extra:
        raise ExportError(
            f"checkpoint {ckpt} does not match the source model: missing {few(missing)}, "
            f"unexpected {few(extra)}; pass the source the run started from (--source)"
        )
    groups: dict[object, Group] = {}
    for fqn, tensor in expected.items():
        if tuple(saved[fqn].size) != tuple(tensor.shape):
            raise ExportError(
                f"checkpoint {ckpt}: model.{fqn} has shape {list(saved[fqn].size)}, the source model "
                f"{list(tensor.shape)}; pass the source the run started from (--source)"
            )
        m = _LAYER.search(fqn)
        groups.setdefault(int(m.group(1)) if m else fqn, Group([])).fqns.append(fqn)
    for group in groups.values():
        group.as_is = frozenset(f for f in group.fqns if f in source_keys)
        metas = {f: torch.empty(saved[f].size, dtype=saved[f].properties.dtype, device="meta") for f in group.fqns}
        reverted = revert_as_source(model, metas, group.as_is)  # on meta: names and shapes, no data
        group.out = {k: (t.shape, t.dtype) for k, t in reverted.items()}
    return list(groups.values())


def revert_as_source(model, tensors: dict, as_is) -> dict:
    """transformers' ``revert_weight_conversion`` on ``tensors``, except the ``as_is`` ones kept by name."""
    from transformers.core_model_loading import revert_weight_conversion

    rest = {k: t for k, t in tensors.items() if k not in as_is}
    out = revert_weight_conversion(model, rest) if rest else {}
    out.update({k: tensors[k] for k in tensors if k in as_is})
    return out


def few(keys, n: int = 6) -> str:
    keys = sorted(keys)
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def cross_check(out_keys: list[str], src_dtypes: dict | None, model, fp8: bool, src: Path) -> None:
    """The exported keys must be the source checkpoint's keys (bar ones transformers ignores)."""
    if src_dtypes is None:
        log.info("%s has no safetensors weights; skipped the key check against the source", src)
        return
    ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or ())]
    out, theirs = set(out_keys), set(src_dtypes)
    dropped = {
        k for k in theirs - out
        if (fp8 and k.endswith("weight_scale_inv")) or any(p.search(k) for p in ignore)
    }  # fmt: skip
    if dropped:
        log.info("not exported: %d source keys transformers ignores (%s)", len(dropped), few(dropped, 3))
    missing, extra = theirs - out - dropped, out - theirs
    if missing or extra:
        raise ExportError(
            f"export keys differ from the source {src}: source only {few(missing)}, "
            f"export only {few(extra)}; pass the source the run started from (--source)"
        )


def set_out_dtypes(groups: list[Group], want, src_dtypes: dict, fallback: str) -> None:
    """Give every floating tensor its export dtype: ``want``, or per key the source's (FP8 -> bf16)."""
    default = getattr(torch, fallback, None)
    if not isinstance(default, torch.dtype) or default in FP8_DTYPES:
        default = torch.bfloat16
    for group in groups:
        for key, (shape, stored) in group.out.items():
            if stored.is_floating_point:
                dtype = want or src_dtypes.get(key) or default
                group.out[key] = (shape, torch.bfloat16 if dtype in FP8_DTYPES else dtype)


def assign_shards(groups: list[Group], max_bytes: int) -> list[list[str]]:
    """Pack keys into shards in order, starting a new shard at a group that would not fit.

    Shard boundaries fall between groups so a shard is complete, written and freed before the next
    group is read; only a group larger than ``max_bytes`` is split across shards.
    """
    shards, size = [[]], 0
    for group in groups:
        if shards[-1] and size + group.nbytes > max_bytes:
            shards, size = shards + [[]], 0
        for key, spec in group.out.items():
            if shards[-1] and size + nbytes(*spec) > max_bytes:
                shards, size = shards + [[]], 0
            shards[-1].append(key)
            size += nbytes(*spec)
    return shards


def dominant_dtype(groups: list[Group]) -> torch.dtype:
    by_dtype: dict[torch.dtype, int] = {}
    for shape, dtype in flat(groups).values():
        if dtype.is_floating_point:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes(shape, dtype)
    return max(by_dtype, key=by_dtype.get, default=torch.float32)
