"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``) as inputs:
``hfpipe verify ADAPTER_DIR`` runs the base with them, the quickstart generates with them."""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.lora.adapters import LoraError, peft_key

__all__ = ["adapter_shapes", "check_adapter_weights", "read_adapter_folder", "load_adapter_weights"]

WEIGHTS = "adapter_model.safetensors"


def read_adapter_folder(folder) -> tuple[str, object] | None:
    """``(base model, LoraConfig)`` of a PEFT LoRA adapter folder, or ``None`` for any other folder.

    What hfpipe cannot run is refused here, before PEFT builds anything: another PEFT method, DoRA,
    ``modules_to_save``, a config PEFT rejects, and a ``.bin`` (pickle) payload.

    Raises:
        LoraError: one line naming ``adapter_config.json`` (or the payload) and the fix.
    """
    from pathlib import Path

    from peft import LoraConfig, PeftConfig

    folder = Path(folder)
    path = folder / "adapter_config.json"
    if not path.is_file() and not path.is_symlink():
        return None
    _check_raw(path, _read_raw(path))
    _check_payload(folder)
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - PEFT's validators raise ValueError, TypeError, KeyError...
        raise LoraError(f"{path}: PEFT refuses it ({' '.join(str(e).split())[:200] or type(e).__name__}); "
                        "fix the field or re-export the adapter") from None
    if not isinstance(config, LoraConfig):
        raise LoraError(f"{path}: a {config.peft_type} adapter; hfpipe trains LoRA only")
    if not config.base_model_name_or_path:
        raise LoraError(f"{path} names no base model (base_model_name_or_path)")
    config.inference_mode = False  # PEFT would freeze the adapters; hfpipe finds them as the trainable ones
    return config.base_model_name_or_path, config


def _read_raw(path) -> dict:
    from hfpipe.files import SideFileError, read_side_json

    try:
        raw = read_side_json(path, follow=True)  # a hub cache links its files
    except SideFileError as e:
        raise LoraError(f"{e}; re-export the adapter") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{path}: must hold a JSON object, got a {type(raw).__name__}; re-export the adapter")
    return raw


def _check_raw(path, raw: dict) -> None:
    """What PEFT would load but hfpipe cannot run the way PEFT does (its reference would differ)."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: a {raw.get('peft_type')} adapter; hfpipe trains and runs LoRA only")
    if raw.get("use_dora"):
        raise LoraError(f"{path}: a DoRA adapter (use_dora: true); hfpipe runs plain LoRA only: merge it with "
                        "PEFT's merge_and_unload() and give hfpipe the merged model")
    if raw.get("modules_to_save"):
        raise LoraError(f"{path}: modules_to_save {raw['modules_to_save']} keeps whole copies of modules, which "
                        "hfpipe does not load; merge the adapter with PEFT and give hfpipe the merged model")
    r = raw.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"{path}: r must be a positive integer (the LoRA rank), got {r!r}; re-export the adapter")


def _check_payload(folder) -> None:
    """The adapter's tensors are a safetensors file: a pickle (``.bin``) would run code on load."""
    if (folder / WEIGHTS).is_file():
        return
    pickles = sorted(p.name for p in folder.glob("adapter_model.*") if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise LoraError(f"{folder / pickles[0]}: a pickle payload, which hfpipe never loads (it can run code); "
                        f"convert it to {WEIGHTS} with PEFT's save_pretrained(safe_serialization=True)")
    raise LoraError(f"{folder}: has adapter_config.json but no {WEIGHTS}; re-export the adapter")


def adapter_shapes(meta_model: nn.Module, config) -> dict[str, tuple[int, ...]]:
    """Adapter parameters PEFT injects into ``meta_model`` (a full model on the meta device), by name,
    with their shapes: what ``PeftModel.from_pretrained`` builds and loads into."""
    import copy

    from peft.tuners.lora import LoraModel

    from hfpipe.lora.adapters import ADAPTER

    with torch.device("meta"):  # PEFT makes its adapters on the default device: a huge rank must cost nothing
        LoraModel(meta_model, copy.deepcopy(config), ADAPTER, low_cpu_mem_usage=True)
    return {n: tuple(p.shape) for n, p in meta_model.named_parameters() if p.requires_grad}


def check_adapter_weights(folder, config, model_config) -> None:
    """The payload's keys and shapes against what PEFT builds from ``config`` on the base, from the
    headers only (a rank that is not the tensors', a huge rank, another base: refused before any
    tensor is allocated).

    Raises:
        LoraError: naming the key, its shape and the one PEFT expects.
    """
    from pathlib import Path

    from hfpipe.models.meta import build_meta_model, model_config as hf_config
    from hfpipe.source.safetensors_io import SafetensorsError, read_header

    path = Path(folder) / WEIGHTS
    try:
        header = {k: tuple(v["shape"]) for k, v in read_header(path).items() if k != "__data_start__"}
    except SafetensorsError as e:
        raise LoraError(str(e)) from None
    want = {peft_key(n): s for n, s in adapter_shapes(build_meta_model(hf_config(model_config)), config).items()}
    for key in sorted(set(want) | set(header)):
        if key not in header:
            raise LoraError(f"{path}: {key} is missing; the adapter does not match its adapter_config.json")
        if key not in want:
            raise LoraError(f"{path}: {key} is not an adapter PEFT puts on the base with this adapter_config.json "
                            "(another base, or other target_modules?); re-export the adapter")
        if header[key] != want[key]:
            raise LoraError(f"{path}: {key} has shape {list(header[key])}, but adapter_config.json (r={config.r}) "
                            f"on its base makes it {list(want[key])}; the config's rank (or the base) is not the "
                            "tensors': re-export the adapter")


def load_adapter_weights(modules: list[nn.Module], folder) -> None:
    """Copy ``adapter_model.safetensors`` of a PEFT folder into this rank's adapters (by PEFT key).

    Raises:
        LoraError: an adapter of this rank is missing from the file.
    """
    from pathlib import Path

    from safetensors import safe_open

    path = Path(folder) / "adapter_model.safetensors"
    with safe_open(path, "pt") as f, torch.no_grad():
        keys = set(f.keys())
        for module in modules:
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                key = peft_key(name)
                if key not in keys:
                    raise LoraError(f"{path}: {key} is missing; the adapter does not match its adapter_config.json")
                p.copy_(f.get_tensor(key))
