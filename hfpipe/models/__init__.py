"""Model adapters: which HF architectures hfpipe can split, and what each needs.

Support is by structure: any causal LM with ``model.embed_tokens -> model.layers -> model.norm ->
lm_head`` is split the same way (:mod:`hfpipe.models.adapter`), and what a family's forward does
around its layers is declared in one small file per family (``plain``, ``gemma``, ``granite``,
``cohere``, ``deepseek``). Adding a family is a line in such a file plus a row of the test table.
Another transformers causal LM is run with the plain skeleton only once its forward is proven
equal on a tiny replica of its config (:mod:`hfpipe.models.proof`); families whose forward a
stage-by-stage run cannot reproduce are refused with the reason.
"""

from __future__ import annotations

from hfpipe.models import cohere, deepseek, gemma, granite, plain
from hfpipe.models.adapter import Adapter, UnsupportedModelError

__all__ = ["Adapter", "UnsupportedModelError", "get_adapter", "SUPPORTED_MODEL_TYPES", "REFUSED"]

_ADAPTERS = plain.ADAPTERS + gemma.ADAPTERS + granite.ADAPTERS + cohere.ADAPTERS + deepseek.ADAPTERS

# Architectures whose forward does more than the stages reproduce; refused with the reason because
# running them stage by stage would give silently different logits.
REFUSED = {
    "gemma3": "the multimodal model merges image features into the embeddings; use its text-only "
              "checkpoint (model_type gemma3_text)",
    "falcon_h1": "its Mamba layers take a separate mask built by the base model",
}

# The MoE router aux loss is carried through the pipeline for the tested families
# (hfpipe.pipeline.router_loss); the proof at load compares logits only, so it says nothing of it.
_AUX_UNTESTED = {"output_router_logits": "hfpipe carries the router aux loss only for the families of its "
                 "tested table; set output_router_logits=false in config.json"}

_BY_TYPE = {t: a for a in _ADAPTERS for t in a.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_TYPE))


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type``, after checking the config's features.

    Raises:
        UnsupportedModelError: unknown or refused architecture (one line, lists the supported ones).
    """
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type in REFUSED:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported: {REFUSED[model_type]}, which a "
            f"stage-by-stage forward would not reproduce; supported: {supported}"
        )
    adapter = _BY_TYPE.get(model_type)
    if adapter is None:
        if not _is_causal_lm(config):
            raise UnsupportedModelError(f"unknown architecture {model_type!r} (not a transformers causal LM); "
                                        f"supported: {supported}")
        from hfpipe.models.proof import missing_skeleton

        missing = missing_skeleton(config)
        if missing:
            raise UnsupportedModelError(
                f"architecture {model_type!r} is not supported: its model has no {missing[0]} (hfpipe splits "
                f"model.embed_tokens -> model.layers -> model.norm -> lm_head); supported: {supported}")
        adapter = _proven(config)
    adapter.check(config)
    return adapter


def _is_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` builds ``config`` (registered classes included)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING


_PROVEN: dict[str, Adapter] = {}


def _proven(config) -> Adapter:
    """The plain skeleton adapter for a family outside the table, once proven exact on its config."""
    from hfpipe.models.proof import prove

    key = config.to_json_string(use_diff=False)
    if key not in _PROVEN:
        adapter = Adapter((config.model_type,), tested=False, refuse_if=_AUX_UNTESTED)
        adapter.check(config)  # before the proof, which builds and runs a replica
        prove(config, adapter)
        _PROVEN[key] = adapter
    return _PROVEN[key]
