"""The table of model families hfpipe splits, the ones it refuses, and the families proven at load.

A lookup here never runs a model: :func:`adapter_for` answers from the table (one small file per
family) or from a family :mod:`hfpipe.models.support` proved earlier in this process. Stage
building and loading ask here; entry points ask :func:`hfpipe.models.support.get_adapter`, which
also proves an unknown family (a step that runs the stage module, and so sits above it).
"""

from __future__ import annotations

from hfpipe.models import cohere, deepseek, gemma, granite, plain
from hfpipe.models.adapter import Adapter, UnsupportedModelError

__all__ = ["REFUSED", "SUPPORTED_MODEL_TYPES", "adapter_for", "known_adapter", "remember_proven"]

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


def known_adapter(config) -> Adapter | None:
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


def remember_proven(config, adapter: Adapter) -> None:
    """Record that ``adapter`` was proven exact on ``config`` (by :mod:`hfpipe.models.support`)."""
    _PROVEN[_key(config)] = adapter


def adapter_for(config) -> Adapter:
    """The adapter stages of ``config`` are built with: the table's, or one proven earlier.

    Raises:
        UnsupportedModelError: a refused architecture, or one not yet proven (entry points prove
            unknown families first, through :func:`hfpipe.models.support.get_adapter`).
    """
    adapter = known_adapter(config)
    if adapter is None:
        raise UnsupportedModelError(f"architecture {config.model_type!r} is not proven exact yet; call "
                                    "hfpipe.models.support.get_adapter(config) before building its stages")
    return adapter
