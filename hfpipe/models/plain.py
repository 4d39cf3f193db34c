"""Families that are the skeleton, embed -> layers -> norm -> head, with nothing around it but
at most a mask or rope option.

Their differences (sliding windows, layers without rope as in SmolLM3, MoE routing, QK norms,
MLA attention) all live inside the decoder layers, whose own forward runs them.
"""

from __future__ import annotations

from hfpipe.models.adapter import Adapter

__all__ = ["ADAPTERS"]

ADAPTERS = (
    Adapter(("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3", "starcoder2",
             "glm", "glm4", "ernie4_5", "helium", "arcee", "apertus", "ministral", "seed_oss", "exaone4")),
    # With output_router_logits, their aux loss is carried through the pipeline (hfpipe.models.router_loss).
    Adapter(("qwen3_moe", "qwen2_moe", "mixtral")),
    # GPT-OSS builds its masks without position_ids: packed documents see each other, as in HF.
    Adapter(("gpt_oss",), mask_kwargs={"position_ids": None}),
    # OLMo-3 has a rope per layer type (sliding and full attention).
    Adapter(("olmo3",), rope_by_layer_type=True),
)
