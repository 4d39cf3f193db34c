"""Which architecture a config is, and whether hfpipe can split it: the table, or a proof.

:func:`get_adapter` is what everything calls before planning, building or loading stages. A family
in the table (one small file per family) or refused with a reason is answered at once; another
transformers causal LM with the skeleton is run through :mod:`hfpipe.models.proof` on a tiny
replica of its config first, and remembered once proven.
"""

from __future__ import annotations

from hfpipe.models import cohere, deepseek, gemma, granite, plain
from hfpipe.models.adapter import MOE_REFUSALS, Adapter, UnsupportedModelError
from hfpipe.models.proof import missing_skeleton, prove

__all__ = ["REFUSED", "SUPPORTED_MODEL_TYPES", "get_adapter"]

_ADAPTERS = plain.ADAPTERS + gemma.ADAPTERS + granite.ADAPTERS + cohere.ADAPTERS + deepseek.ADAPTERS

# Architectures whose forward does more than the stages reproduce; refused with the reason because
# running them stage by stage would give silently different logits.
REFUSED = {
    "gemma3": "the multimodal model merges image features into the embeddings; use its text-only "
              "checkpoint (model_type gemma3_text)",
    "falcon_h1": "its Mamba layers take a separate mask built by the base model",
}

_BY_TYPE = {t: a for a in _ADAPTERS for t in a.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_TYPE))


#: Families outside the table proven exact in this process, by their config's JSON.
_PROVEN: dict[str, Adapter] = {}


def _key(config) -> str:
    return config.to_json_string(use_diff=False)


def _known(config) -> Adapter | None:
    """The table's (or an earlier proof's) adapter for ``config``, checked; None for an unknown family.

    Raises:
        UnsupportedModelError: a refused architecture, or a config feature its adapter refuses.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported: {REFUSED[model_type]}, which a "
            f"stage-by-stage forward would not reproduce; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    adapter = _BY_TYPE.get(model_type) or _PROVEN.get(_key(config))
    if adapter is not None:
        adapter.check(config)
    return adapter


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type``, after checking the config's features.

    Raises:
        UnsupportedModelError: unknown or refused architecture (one line, lists the supported ones).
    """
    adapter = _known(config)
    if adapter is not None:
        return adapter
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if not _is_causal_lm(config):
        raise UnsupportedModelError(f"unknown architecture {model_type!r} (not a transformers causal LM); "
                                    f"supported: {supported}")
    missing = missing_skeleton(config)
    if missing:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported: its model has no {missing[0]} (hfpipe splits "
            f"model.embed_tokens -> model.layers -> model.norm -> lm_head); supported: {supported}")
    adapter = Adapter((config.model_type,), tested=False, refuse_if=MOE_REFUSALS)
    adapter.check(config)  # before the proof, which builds and runs a replica
    prove(config, adapter)
    _PROVEN[_key(config)] = adapter
    return adapter


def _is_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` builds ``config`` (registered classes included)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
