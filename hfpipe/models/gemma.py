"""Gemma, Gemma-2, Gemma-3 (text): what their forward does around the layers.

- The embedding is scaled by sqrt(hidden_size) *inside* ``embed_tokens``
  (``Gemma*TextScaledWordEmbedding``), from a non-persistent buffer that the loader rebuilds with
  the model's own initialiser: no piece needed here.
- Gemma-2/3 soft-cap the final logits (``final_logit_softcapping``); the attention soft-capping
  is inside the layers.
- Gemma-3 uses a local and a global rope: its rotary module takes the layer type.
"""

from __future__ import annotations

from hfpipe.models.adapter import Adapter, Softcap

__all__ = ["ADAPTERS"]

ADAPTERS = (
    Adapter(("gemma",)),
    Adapter(("gemma2",), logits=(Softcap("final_logit_softcapping"),)),
    Adapter(("gemma3_text",), logits=(Softcap("final_logit_softcapping"),), rope_by_layer_type=True,
            refuse_if={"use_bidirectional_attention": "bidirectional attention builds other masks"}),
)
