"""Whether hfpipe can split a config's architecture: the table, or a proof on a tiny replica.

:func:`get_adapter` is what entry points (``load_pipeline``, ``finetune``'s preflight, ``plan``,
``verify``) call first. A family in :mod:`hfpipe.models.registry` is answered at once; another
transformers causal LM with the skeleton is run through :mod:`hfpipe.models.proof` and remembered
in the registry once proven, so stage building finds it there.
"""

from __future__ import annotations

from hfpipe.models.adapter import MOE_REFUSALS, Adapter, UnsupportedModelError
from hfpipe.models.proof import missing_skeleton, prove
from hfpipe.models.registry import SUPPORTED_MODEL_TYPES, known_adapter, remember_proven

__all__ = ["get_adapter"]


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type``, after checking the config's features.

    Raises:
        UnsupportedModelError: unknown or refused architecture (one line, lists the supported ones).
    """
    adapter = known_adapter(config)
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
    remember_proven(config, adapter)
    return adapter


def _is_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` builds ``config`` (registered classes included)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
