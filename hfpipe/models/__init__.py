"""Model adapters: which HF architectures hfpipe can split, and what each needs.

Every supported architecture has the same skeleton, ``model.embed_tokens -> model.layers ->
model.norm -> lm_head``, and transformers' own modules do all the math. An adapter only records
what differs between families around that skeleton: extra checkpoint tensors to skip (DeepSeek-V3's
multi-token-prediction layer), and forward features that a stage-by-stage forward cannot
reproduce (those are refused, never silently approximated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Adapter", "UnsupportedModelError", "get_adapter", "SUPPORTED_MODEL_TYPES"]


class UnsupportedModelError(ValueError):
    """The architecture cannot be pipelined exactly by hfpipe."""


@dataclass(frozen=True)
class Adapter:
    """What hfpipe needs to know about one model family.

    Attributes:
        model_types: ``config.model_type`` values this adapter serves.
        mtp_attr: Config attribute counting multi-token-prediction layers stored in the checkpoint
            after the decoder layers (DeepSeek-V3); the HF model has no module for them.
        refuse_if: Config attribute -> reason; the model is refused when the attribute is truthy,
            because the HF forward then does more than embed -> layers -> norm -> head.
    """

    model_types: tuple[str, ...]
    mtp_attr: str | None = None
    refuse_if: dict[str, str] = field(default_factory=dict)

    def num_mtp_layers(self, config) -> int:
        """Number of MTP layers the checkpoint holds beyond ``num_hidden_layers``."""
        return int(getattr(config, self.mtp_attr, 0) or 0) if self.mtp_attr else 0

    def check(self, config) -> None:
        """Raise :class:`UnsupportedModelError` when ``config`` enables a refused feature."""
        for attr, reason in self.refuse_if.items():
            if getattr(config, attr, None):
                raise UnsupportedModelError(
                    f"{config.model_type} with {attr}={getattr(config, attr)!r} is not supported: {reason}"
                )


_MOE_AUX = (
    "the router auxiliary loss is computed over all layers at once by the HF model; "
    "set output_router_logits=false in config.json"
)

_ADAPTERS = (
    Adapter(("llama",)),
    Adapter(("mistral",)),
    Adapter(("qwen2",)),
    Adapter(("qwen3",)),
    Adapter(("qwen3_moe",), refuse_if={"output_router_logits": _MOE_AUX}),
    Adapter(("deepseek_v2",), refuse_if={"output_router_logits": _MOE_AUX}),
    Adapter(("deepseek_v3",), mtp_attr="num_nextn_predict_layers"),
)

# Architectures that look like the skeleton but whose forward does more; refused with the reason
# because running them stage by stage would give silently different logits.
_REFUSED = {
    "gemma": "the embedding output is scaled by sqrt(hidden_size)",
    "gemma2": "the embedding is scaled and attention/final logits are soft-capped",
    "gemma3": "the embedding is scaled and layers need per-type rotary embeddings",
    "gemma3_text": "the embedding is scaled and layers need per-type rotary embeddings",
    "cohere": "the logits are multiplied by logit_scale",
    "cohere2": "the logits are multiplied by logit_scale",
    "granite": "embedding, residual and logits multipliers are applied outside the layers",
    "granitemoe": "embedding, residual and logits multipliers are applied outside the layers",
}

_BY_TYPE = {t: a for a in _ADAPTERS for t in a.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_TYPE))


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type``, after checking the config's features.

    Raises:
        UnsupportedModelError: unknown or refused architecture (one line, lists the supported ones).
    """
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type in _REFUSED:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported: {_REFUSED[model_type]}, which a "
            f"stage-by-stage forward would not reproduce; supported: {supported}"
        )
    if model_type not in _BY_TYPE:
        raise UnsupportedModelError(f"unknown architecture {model_type!r}; supported: {supported}")
    adapter = _BY_TYPE[model_type]
    adapter.check(config)
    return adapter
