"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``) as inputs:
``hfpipe verify ADAPTER_DIR`` runs the base with them, the quickstart generates with them."""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.lora.adapters import LoraError, peft_key

__all__ = ["read_adapter_folder", "load_adapter_weights"]


def read_adapter_folder(folder) -> tuple[str, object] | None:
    """``(base model, LoraConfig)`` of a PEFT LoRA adapter folder, or ``None`` for any other folder.

    Raises:
        LoraError: an adapter folder that is not LoRA's or names no base model.
    """
    from pathlib import Path

    from peft import LoraConfig, PeftConfig

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        return None
    config = PeftConfig.from_pretrained(str(folder))
    if not isinstance(config, LoraConfig):
        raise LoraError(f"{folder / 'adapter_config.json'}: a {config.peft_type} adapter; hfpipe trains LoRA only")
    if not config.base_model_name_or_path:
        raise LoraError(f"{folder / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    config.inference_mode = False  # PEFT would freeze the adapters; hfpipe finds them as the trainable ones
    return config.base_model_name_or_path, config


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
