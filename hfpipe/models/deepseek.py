"""DeepSeek V2, V3 and V3.2.

- V3 and V3.2 checkpoints hold multi-token-prediction layers after the decoder layers
  (``num_nextn_predict_layers``); the HF model has no module for them, so they are skipped with a
  note on load (and in the cost model).
- V3.2's attention has a lightning indexer that needs the causal mask materialised
  (``allow_is_causal_skip=False``, as its base model builds it).
- V4's hidden states are ``hc_mult`` hyper-connection streams (B, T, hc, H), expanded from the
  embedding; every layer takes ``input_ids`` (hash-routed MoE layers), the sliding-window mask and
  both rotary tables (``main``, ``compress``); ``hc_head`` folds the streams before the norm.
"""

from __future__ import annotations

from hfpipe.models.adapter import Adapter, ExpandStreams

__all__ = ["ADAPTERS"]

ADAPTERS = (
    # output_router_logits only returns the router logits: DeepSeek-V2's causal LM adds no aux loss.
    Adapter(("deepseek_v2",)),
    Adapter(("deepseek_v3",), mtp_attr="num_nextn_predict_layers"),
    Adapter(("deepseek_v32",), mtp_attr="num_nextn_predict_layers", mask_kwargs={"allow_is_causal_skip": False}),
    Adapter(("deepseek_v4",), mtp_attr="num_nextn_predict_layers", embed=(ExpandStreams("hc_mult"),),
            streams_attr="hc_mult", rope_table=("main", "compress"), mask_kind="sliding_attention",
            layer_inputs=("input_ids",), head_modules=("hc_head",)),
)
