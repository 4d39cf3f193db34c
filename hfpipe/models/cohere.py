"""Cohere and Cohere-2: the logits are multiplied by ``logit_scale`` after the head."""

from __future__ import annotations

from hfpipe.models.adapter import Adapter, ConfigFactor

__all__ = ["ADAPTERS"]

ADAPTERS = (Adapter(("cohere", "cohere2"), logits=(ConfigFactor("logit_scale"),)),)
