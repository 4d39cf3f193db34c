"""Granite and GraniteMoE: the embedding is multiplied by ``embedding_multiplier`` (base model) and
the logits divided by ``logits_scaling`` (causal LM). The residual multiplier is inside the layers."""

from __future__ import annotations

from hfpipe.models.adapter import Adapter, ConfigFactor

__all__ = ["ADAPTERS"]

_PIECES = dict(embed=(ConfigFactor("embedding_multiplier"),), logits=(ConfigFactor("logits_scaling", divide=True),))

ADAPTERS = (
    Adapter(("granite",), **_PIECES),
    Adapter(("granitemoe",), **_PIECES),
)
