"""Merge a LoRA run's adapters into its base checkpoint, in the base's files, keys and dtypes.

Every targeted weight is merged by PEFT's own ``merge()``: the module is rebuilt under its full
name over the base tensor, PEFT injects its LoRA layer there (so the config's per-name rank and
alpha patterns and its scaling apply as on the whole model), the fp32 adapters are loaded as
``PeftModel`` holds them, and ``merge()`` adds the delta in the base dtype. Two kinds of targets:

- ``nn.Linear`` modules (attention, dense and shared-expert MLPs): the checkpoint tensor is
  ``<module>.weight`` itself, merged in place in its shard;
- fused MoE experts (PEFT's ``target_parameters``, e.g. ``mlp.experts.gate_up_proj`` of shape
  [E, 2I, H]): the checkpoint holds per-expert tensors (``mlp.experts.3.gate_proj.weight``), so the
  fused tensor is built with transformers' conversion (as the loader does), merged, and written
  back per expert with ``revert_weight_conversion`` (as ``save_pretrained`` does). One layer's
  experts are held at a time.

Untargeted tensors are copied bit for bit. The output is written shard by shard (peak memory: a
shard, or one layer's experts).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from hfpipe.export.guard import ExportError
from hfpipe.source.folder import INDEX, SINGLE
from hfpipe.source.config import meta_model

__all__ = ["write_merged"]


def write_merged(tmp: Path, src: Path, config, adapters: dict[str, torch.Tensor], *,
                 quant: dict | None = None, dtype: str = "auto") -> None:
    """Write the base checkpoint ``src`` into ``tmp`` with ``adapters`` (stage names) merged.

    ``quant`` (``hfpipe.json``'s ``quantize_base``) and a block-FP8 base merge into the base as
    the run saw it, written in bf16 or, with ``dtype="fp8"``, requantized per block
    (:mod:`hfpipe.quant.merged`).
    """
    from safetensors.torch import load_file, save_file

    from hfpipe.quant.merged import MergedBase

    cfg_json = json.loads((src / "config.json").read_text())
    base = MergedBase(cfg_json, meta_model(src), quant, dtype)
    weight_map = _weight_map(src)
    targets = _merge_targets(adapters)
    linear = [t for t in targets if t + ".weight" in weight_map]
    experts = _FusedExperts(src, config, adapters, [t for t in targets if t not in linear],
                            base.as_trained if base.changes else None)
    out_map = {}
    for fname in sorted(set(weight_map.values())):
        tensors = load_file(src / fname)
        stored = {k: t.dtype for k, t in tensors.items()}
        if base.changes:
            tensors = base.as_trained(_with_scales(tensors, weight_map, src))
        here = {t: tensors[t + ".weight"] for t in linear if weight_map[t + ".weight"] == fname}
        for name, merged in _merge(config, here, adapters).items():
            tensors[name + ".weight"] = merged
        tensors.update(experts.merged_in(fname, weight_map))
        if base.changes:
            tensors = base.output(tensors, stored)
        save_file(tensors, tmp / fname, metadata={"format": "pt"})
        out_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if not base.changes:  # the base's own files, keys and dtypes
        if (src / INDEX).is_file():
            shutil.copy2(src / INDEX, tmp / INDEX)
        shutil.copy2(src / "config.json", tmp / "config.json")
    else:  # keys (FP8 scales) and dtypes changed: a new index and config
        if (src / INDEX).is_file():
            total = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(out_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(base.config_json(cfg_json), indent=2))


def _merge_targets(adapters: dict[str, torch.Tensor]) -> list[str]:
    """Modules carrying an adapter (``...q_proj`` of ``...q_proj.lora_A.default.weight``); a
    nested PEFT wrapper (``...experts.base_layer``) counts as its module."""
    out = set()
    for name in adapters:
        if ".lora_A." in name:
            path = name.split(".lora_A.")[0]
            while path.endswith(".base_layer"):
                path = path.removesuffix(".base_layer")
            out.add(path)
    return sorted(out)


def _weight_map(src: Path) -> dict[str, str]:
    from safetensors import safe_open

    if (src / INDEX).is_file():
        return json.loads((src / INDEX).read_text())["weight_map"]
    if (src / SINGLE).is_file():
        with safe_open(src / SINGLE, "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise ExportError(f"--merge: {src} has no safetensors weights to merge into")


def _peft_merge(root: nn.Module, config, adapters: dict[str, torch.Tensor], prefixes) -> None:
    """Inject PEFT's LoRA layers into ``root``, load the adapters under ``prefixes``, merge them."""
    from peft.tuners.lora import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer, cast_adapter_dtype

    from hfpipe.lora.adapters import ADAPTER

    with torch.random.fork_rng(devices=[]):
        LoraModel(root, config, ADAPTER)
    cast_adapter_dtype(root, ADAPTER, autocast_adapter_dtype=True)  # fp32 adapters, as PeftModel holds them
    mine = {k: v for k, v in adapters.items() if any(k.startswith(p + ".") for p in prefixes)}
    result = root.load_state_dict(mine, strict=False)
    lora_keys = {k for k, _ in root.named_parameters() if ".lora_" in k}
    if result.unexpected_keys or lora_keys != set(mine):
        raise ExportError(f"--merge: the adapters of {sorted(prefixes)[0]} do not fit PEFT's layer; "
                          "was the checkpoint written for this base? (--source)")
    for _, module in root.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge(adapter_names=[ADAPTER])


def _merge(config, weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (module name -> base ``nn.Linear`` weight) with their adapters merged."""
    if not weights:
        return {}
    from hfpipe.lora.adapters import _attach

    root, linears = nn.Module(), {}
    for name, w in weights.items():
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        linear.weight = nn.Parameter(w, requires_grad=False)
        _attach(root, name, linear)
        linears[name] = linear
    config = _copy(config, target_modules=set(weights), target_parameters=None)
    _peft_merge(root, config, adapters, list(weights))
    return {name: linear.weight.detach().contiguous() for name, linear in linears.items()}


def _copy(config, **changes):
    config = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def _with_scales(tensors: dict, weight_map: dict[str, str], src: Path) -> dict:
    """``tensors`` plus the FP8 scales of its weights that another shard holds (a shard may cut a weight
    from its ``weight_scale_inv``)."""
    from safetensors import safe_open

    missing = [k + "_scale_inv" for k in tensors if k + "_scale_inv" in weight_map and k + "_scale_inv" not in tensors]
    out = dict(tensors)
    for key in missing:
        with safe_open(src / weight_map[key], "pt") as f:
            out[key] = f.get_tensor(key)
    return out


class _FusedExperts:
    """Per-expert checkpoint tensors of fused expert parameters, merged one module at a time."""

    def __init__(self, src: Path, config, adapters: dict[str, torch.Tensor], modules: list[str],
                 as_trained=None) -> None:
        self.src, self.config, self.adapters, self.modules = src, config, adapters, modules
        self.as_trained = as_trained  # a quantized run's base as it trained (MergedBase.as_trained), or None
        self._cache: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()
        if modules:
            from hfpipe.models.conversion import model_key_mapper

            self.meta = meta_model(src)
            mapper = model_key_mapper(self.meta)
            self.sources: dict[str, list[tuple[str, object, object]]] = {}  # fused param -> its keys
            for key in _weight_map(src):
                target, converter, pattern = mapper(key)
                if converter is not None and target.rpartition(".")[0] in modules:
                    self.sources.setdefault(target, []).append((key, converter, pattern))
            missing = [m for m in modules if not any(t.rpartition(".")[0] == m for t in self.sources)]
            if missing:
                raise ExportError(f"--merge: {missing[0]} carries an adapter but is not a module of {src}; "
                                  "pass the base the run started from (--source)")

    def merged_in(self, fname: str, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
        """Merged per-expert tensors that live in shard ``fname``."""
        out = {}
        for module in self.modules:
            keys = {k for t, srcs in self.sources.items() if t.rpartition(".")[0] == module for k, _, _ in srcs}
            if any(weight_map[k] == fname for k in keys):
                if not keys & self._cache.keys():
                    self._cache.update(self._merge_module(module))
                for k in keys:
                    if weight_map[k] == fname:
                        out[k] = self._cache.pop(k)
        return out

    def _merge_module(self, module: str) -> dict[str, torch.Tensor]:
        """Build the module's fused parameters from the checkpoint, merge, revert to per-expert keys."""
        from transformers.core_model_loading import revert_weight_conversion

        from hfpipe.lora.adapters import _attach

        layer = copy.deepcopy(self.meta.get_submodule(module))
        fused = {t: self._fused(t) for t in self.sources if t.rpartition(".")[0] == module}
        for target, tensor in fused.items():
            setattr(layer, target.rpartition(".")[2], nn.Parameter(tensor, requires_grad=False))
        root = nn.Module()
        _attach(root, module, layer)
        config = _copy(self.config, target_modules=[])  # only the parameter targets are in this module
        _peft_merge(root, config, self.adapters, [module])
        merged = {t: getattr(layer, t.rpartition(".")[2]).detach() for t in fused}
        out = revert_weight_conversion(self.meta, merged)
        return {k: v.contiguous() for k, v in out.items()}

    def _fused(self, target: str) -> torch.Tensor:
        """The in-memory fused tensor ``target`` from its per-expert checkpoint tensors."""
        from safetensors import safe_open

        weight_map = _weight_map(self.src)
        sources = self.sources[target]
        converter = copy.deepcopy(sources[0][1])
        by_file: dict[str, list] = {}
        for key, _, pattern in sources:
            by_file.setdefault(weight_map[key], []).append((key, pattern))
        for fname, items in by_file.items():
            with safe_open(self.src / fname, "pt") as f:
                for key, pattern in items:
                    converter.add_tensor(target, key, pattern, self._as_trained(key, f.get_tensor(key), weight_map))
        from transformers import AutoConfig

        return converter.convert(target, config=AutoConfig.from_pretrained(self.src, trust_remote_code=False))[target]

    def _as_trained(self, key: str, tensor: torch.Tensor, weight_map: dict[str, str]) -> torch.Tensor:
        """One expert's weight as the run saw it: its FP8 scale (from whichever shard holds it) applied,
        and the run's quantization round-tripped."""
        if self.as_trained is None:
            return tensor
        from safetensors import safe_open

        tensors = {key: tensor}
        scale = key + "_scale_inv"
        if scale in weight_map:
            with safe_open(self.src / weight_map[scale], "pt") as f:
                tensors[scale] = f.get_tensor(scale)
        return self.as_trained(tensors)[key]
