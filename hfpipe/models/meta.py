"""The full transformers model on the meta device: every name and shape, no memory.

A floor module: stage building, LoRA's target resolution, planning and generation all start from
this model, and none of them should need the stage module to get it.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["build_meta_model", "model_config"]


def model_config(config):
    """A copy of ``config`` fit to build the bf16/fp32 HF model: no quantisation, no cache."""
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # FP8 checkpoints are dequantised on load
    cfg.use_cache = False
    return cfg


def build_meta_model(config, dtype: torch.dtype = torch.float32):
    """The full HF causal-LM on the meta device: structure and names, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # adapters exist only for transformers' own classes: never ask for code
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
