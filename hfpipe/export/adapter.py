"""Export a LoRA training checkpoint: a PEFT adapter folder, or the base with the adapters merged.

A LoRA checkpoint holds only adapters (``model.<stage name>``, e.g.
``model.model.layers.0.self_attn.q_proj.lora_A.default.weight``) and points at its base model.

- The adapter export writes what ``PeftModel.save_pretrained`` writes: ``adapter_config.json``
  (the run's ``LoraConfig``, naming the base model) and ``adapter_model.safetensors`` under PEFT's
  keys (``base_model.model.<name>`` without the adapter name). The key set is checked against the
  adapters PEFT injects into the full (meta) model, so a folder that loads is a complete one.
- The merged export (:mod:`hfpipe.export.merge`; both are started by :mod:`hfpipe.export.hf_folder`) rewrites the base checkpoint shard by shard,
  same file names, keys and dtypes, each targeted weight merged by PEFT's own ``merge()``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hfpipe.checkpoint.safe_metadata import _DcpReader
from hfpipe.errors import ExportError
from hfpipe.source.config import meta_model

__all__ = ["base_name", "is_lora_checkpoint", "read_adapters", "write_adapter"]

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_lora_checkpoint(meta: dict) -> bool:
    """Whether ``hfpipe.json``'s fields describe a LoRA run."""
    return isinstance(meta.get("lora"), dict)


def base_name(meta: dict, src: Path) -> str:
    """The base model as ``adapter_config.json`` names it: the hub id the run used, else the folder."""
    name = (meta.get("config") or {}).get("model")
    if isinstance(name, str) and not Path(name).expanduser().exists() and name.count("/") == 1:
        return name
    return str(src)


def read_adapters(ckpt: Path, config, src: Path) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the checkpoint (stage names), checked against PEFT's own set."""
    reader = _DcpReader(ckpt)
    saved = reader.tensors("model.")
    expected = _expected_shapes(config, src)
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or extra:
        raise ExportError(f"checkpoint {ckpt}: adapters differ from the ones PEFT puts on {src}: "
                          f"missing {missing[:3] or 'none'}, unexpected {extra[:3] or 'none'}; "
                          "pass the base the run started from (--source)")
    _check_shapes(ckpt, config, src, {n: tuple(m.size) for n, m in saved.items()}, expected)
    return {name: reader.read("model." + name) for name in sorted(saved)}


def _check_shapes(ckpt: Path, config, src: Path, saved: dict, expected: dict) -> None:
    """Every adapter tensor has the shape PEFT gives it from the record's LoRA config on this base.

    It is what ``PeftModel.from_pretrained`` checks when it loads the export (a size mismatch), here
    before anything is written: a record whose rank disagrees with the tensors, or a base of another
    shape than the one the run trained on, would otherwise export a folder PEFT cannot load.
    """
    for name in sorted(saved):
        if saved[name] != expected[name]:
            raise ExportError(
                f"checkpoint {ckpt}: adapter {name} has shape {list(saved[name])}, but the run's LoRA config "
                f"(r={config.r}, in hfpipe.json) on {src} makes it {list(expected[name])}; pass the base the "
                "run started from (--source), or export an undamaged checkpoint")


def _expected_shapes(config, src: Path) -> dict[str, tuple[int, ...]]:
    """Adapter parameters PEFT injects into the full model, and their shapes (on the meta device)."""
    from hfpipe.lora.folder import adapter_shapes

    return adapter_shapes(meta_model(src), config)


def write_adapter(tmp: Path, config, adapters: dict[str, torch.Tensor], base: str) -> None:
    from safetensors.torch import save_file

    from hfpipe.lora.adapters import peft_key

    targets = config.target_modules
    config = _copy(config, base_model_name_or_path=base, inference_mode=True,  # sorted: same file every time
                   target_modules=sorted(targets) if isinstance(targets, (set, list)) else targets)
    config.save_pretrained(str(tmp))
    tensors = {peft_key(name): t.contiguous() for name, t in adapters.items()}
    save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def _copy(config, **changes):
    import copy

    config = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(config, k, v)
    return config
