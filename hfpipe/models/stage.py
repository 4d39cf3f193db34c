"""Pipeline stage modules built from transformers' own classes.

A stage keeps HF submodules under the full model's names (``model.embed_tokens``,
``model.layers.17``, ``model.norm``, ``lm_head``), so its state dict is a slice of the full
model's and checkpoints reshard by name. Parts a stage does not own are ``None`` and its forward
skips them. Only hidden states cross stages: every stage rebuilds the causal mask, the position ids
and the rotary embeddings from the microbatch, exactly as the HF model's forward does.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hfpipe.models.adapter import ConfigFactor
from hfpipe.models.meta import build_meta_model
from hfpipe.models.router_loss import RouterSums, finish_router_loss, router_loss_spec, sums_with_tokens

__all__ = ["PipelineStageModule", "apply_ac", "build_meta_model", "build_stage_modules", "rebuild_rotary",
           "rebuild_buffers"]

log = logging.getLogger(__name__)


def _mask_kind(config, layer_idx: int) -> str:
    """Which mask layer ``layer_idx`` uses, by the same rule as the HF model's forward."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx]
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return "sliding_attention" if sliding else "full_attention"


class PipelineStageModule(nn.Module):
    """One pipeline stage: an optional embedding, some decoder layers, an optional norm + head.

    Args:
        spec: The stage's :class:`hfpipe.plan.split.StageSpec`.
        config: The model's transformers config.
        full: The full HF model on the meta device, whose submodules this stage takes.
        adapter: The family's adapter (default: looked up from ``config``).
    """

    def __init__(self, spec, config, full: nn.Module, adapter):
        super().__init__()
        self.spec = spec
        self.config = full.config  # carries the attention implementation chosen at build time
        object.__setattr__(self, "_hf_model", full)  # for names and conversion tables; not a submodule
        self.model = nn.Module()
        self.model.embed_tokens = full.model.embed_tokens if spec.embed else None
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in spec.layers})
        self.model.norm = full.model.norm if spec.head else None
        self.model.rotary_emb = full.model.rotary_emb
        self.lm_head = full.lm_head if spec.head else None
        self.adapter = adapter  # the family's pieces (hfpipe.models.registry.adapter_for)
        for name in self.adapter.head_modules:  # run before the norm (DeepSeek-V4's hc_head)
            setattr(self.model, name, getattr(full.model, name) if spec.head else None)
        self.activation_checkpointing = "none"
        # When set (training on the last stage), forward stops at the final hidden states and the
        # loss applies :meth:`logits` chunk by chunk (hfpipe.loss.chunked), never holding (B, T, V).
        self.head_in_loss = False
        self.hidden_dtype = full.dtype  # dtype of the hidden states it receives (the compute dtype)
        if self.lm_head is not None and self.model.embed_tokens is None and getattr(config, "tie_word_embeddings", False):
            # The head of a tied model lives apart from the embedding here: give it its own
            # parameter (loaded from the embedding's tensor; gradients summed by the trainer).
            self.lm_head.weight = nn.Parameter(torch.empty_like(self.lm_head.weight))
        self._mask_kinds = sorted({self._layer_kind(i) for i in spec.layers})
        # MoE router aux loss (hfpipe.models.router_loss): per-expert sums ride beside the hidden
        # states while the pipeline sets ``carry_router_sums`` (training and evaluation losses); the last
        # stage finishes each microbatch's aux loss (training) or returns its sums (``router_sums_out``:
        # evaluation, finished over the whole batch by the caller).
        self.router_loss = router_loss_spec(full)
        self._router_sums = RouterSums(self.router_loss, self.model.layers) if self.router_loss else None
        self.carry_router_sums = False
        self.router_sums_out = False
        # --cp: a hfpipe.parallel.context.ContextParallel; the stage then takes ``context_keys`` and builds
        # the context masks its attention (registered with transformers) reads.
        self.context = None

    @property
    def is_first(self) -> bool:
        return self.model.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def hidden_shape(self, batch_size: int, seq_len: int) -> tuple[int, ...]:
        """Shape of the hidden states this stage receives from the previous one."""
        return self.adapter.hidden_shape(self.config, batch_size, seq_len)

    def forward(self, x: torch.Tensor, router_sums=None, attention_mask=None, position_ids=None, input_ids=None,
                context_keys=None, router_mask=None):
        """Token ids (first stage) or hidden states in; hidden states or logits out.

        ``input_ids`` reaches every stage only for families whose layers take it (DeepSeek-V4).
        While ``carry_router_sums`` is set, a second tensor rides along: the router sums (received
        as ``router_sums``, sent on), and the last stage returns ``coef * aux`` of the microbatch
        instead, or with ``router_sums_out`` the sums and their token count (hfpipe.models.router_loss).
        ``router_mask`` (B, T), where given, says which tokens the router sums count in place of the
        attention mask (rows hfpipe added to fill a batch count none). Under ``--cp`` the stage holds its
        tokens only and ``context_keys`` describes the whole rows (hfpipe.parallel.context).
        """
        if context_keys is not None:
            attention_mask = context_keys  # the context masks are built from it (see _masks)
        if not (self.carry_router_sums and self._router_sums is not None):
            return self._forward(x, None, attention_mask, position_ids, input_ids)
        counted = router_mask if router_mask is not None else attention_mask
        sums = self._router_sums.start(router_sums, x.device)
        try:
            h, sums = self._forward(x, sums, attention_mask, position_ids, input_ids, counted)
        finally:
            self._router_sums.stop()
        if self.is_last and self.router_sums_out:
            return h, sums_with_tokens(sums, counted, x.shape[0] * x.shape[1])
        if self.is_last:
            return h, finish_router_loss(sums, counted, x.shape[0] * x.shape[1], self.router_loss)
        return h, sums

    def _forward(self, x, sums, attention_mask, position_ids, input_ids, counted=None):
        adapter = self.adapter
        h = adapter.embed_tokens(self.config, self.model.embed_tokens, x) if self.is_first else x  # (B, T, [hc,] H)
        flat = h[:, :, 0] if h.dim() == 4 else h  # (B, T, H): what masks and rope size themselves by
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.model.layers:
            masks = self._masks(flat, attention_mask, position_ids)
            types = [self._layer_kind(int(i)) for i in self.model.layers]
            ropes = adapter.position_embeddings(self.model.rotary_emb, flat, position_ids, types)
            ids = input_ids if input_ids is not None or not self.is_first else x
            extra = {"input_ids": ids} if "input_ids" in adapter.layer_inputs else {}
            for n, ((idx, layer), kind) in enumerate(zip(self.model.layers.items(), types)):
                h = self._run_layer(n, layer, h, masks[kind], ropes[adapter.rope_key(kind)], position_ids, extra)
                if sums is not None:
                    sums = self._router_sums.add(sums, counted)
        if self.is_last and not self.head_in_loss:
            h = self.logits(h)  # (B, T, V)
        return h if sums is None else (h, sums)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm -> lm_head -> the family's logit transforms (last stage only).

        Every step is per token, so ``logits(h[:, a:b]) == logits(h)[:, a:b]``: the chunked loss
        (:mod:`hfpipe.loss.chunked`) calls it on slices of the hidden states.
        """
        before = [getattr(self.model, name) for name in self.adapter.head_modules]
        return self.adapter.head(self.config, self.model.norm, self.lm_head, hidden, before)

    def head_parts(self):
        """``(inputs, lm_head, scale)`` with ``logits(h) == scale(lm_head(inputs(h)))``, where every logit
        transform of the family is a constant factor (``scale`` is ``None`` without any), else ``None``.

        Then ``scale`` applied to the logits' gradient is the chain rule through it, and the loss may run
        the head's matmuls itself (hfpipe.loss.linear_head).
        """
        transforms = self.adapter.logits
        if not all(isinstance(t, ConfigFactor) for t in transforms):
            return None
        before = [getattr(self.model, name) for name in self.adapter.head_modules]

        def inputs(h):
            for module in before:
                h = module(h)
            return self.model.norm(h)

        def scale(x):
            for transform in transforms:
                x = transform(self.config, x)
            return x

        return inputs, self.lm_head, (scale if transforms else None)

    def _layer_kind(self, idx: int) -> str:
        return self.adapter.mask_kind or _mask_kind(self.config, idx)

    def _masks(self, h, attention_mask, position_ids) -> dict:
        if self.context is not None:  # attention_mask is the context keys: (B, 2, T)
            return {kind: self.context.mask(attention_mask, self._window(kind)) for kind in self._mask_kinds}
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        # DeepSeek-V3.2's "indexed_attention" layers take the plain causal mask (materialised).
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
                "indexed_attention": create_causal_mask}
        unknown = [k for k in self._mask_kinds if k not in make]
        if unknown:
            raise ValueError(f"layer type {unknown[0]!r} needs a mask hfpipe does not build")
        # transformers 5.24 names the (absent) KV cache `cache`; `past_key_values` warns once per rank.
        kwargs = dict(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                      cache=None, position_ids=position_ids)
        kwargs.update(self.adapter.mask_kwargs)
        return {kind: make[kind](**kwargs) for kind in self._mask_kinds}

    def _window(self, kind: str) -> int | None:
        """The sliding window of a layer type under --cp (the kinds cp accepts: parallel.rules)."""
        return self.config.sliding_window if kind == "sliding_attention" else None

    def _run_layer(self, n: int, layer, h, mask, rope, position_ids, extra=None):
        """Run one layer; recompute it in backward under activation checkpointing.

        ``full`` checkpoints every layer, ``selective`` every other one (half the recompute,
        half the saved activations), as torchtitan's layer-wise selective mode does.
        """
        ac = self.activation_checkpointing
        if (ac == "full" or (ac == "selective" and n % 2 == 0)) and self.training and torch.is_grad_enabled():
            return checkpoint(self._call_layer, layer, h, mask, rope, position_ids, extra, use_reentrant=False)
        return self._call_layer(layer, h, mask, rope, position_ids, extra)

    @staticmethod
    def _call_layer(layer, h, mask, rope, position_ids, extra=None):
        out = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=position_ids, **(extra or {}))
        return out[0] if isinstance(out, tuple) else out


def build_stage_modules(config, specs, dtype: torch.dtype = torch.float32, *, adapter) -> list[PipelineStageModule]:
    """Meta-device stage modules for ``specs`` (one full meta model shared by all of them).

    Tied models whose first and last stage sit on this rank share one head/embedding parameter,
    so autograd sums both uses' gradients as in the HF model.
    """
    full = build_meta_model(config, dtype)
    stages = [PipelineStageModule(spec, config, full, adapter) for spec in specs]
    first = next((s for s in stages if s.is_first), None)
    last = next((s for s in stages if s.is_last), None)
    if getattr(config, "tie_word_embeddings", False) and first is not None and last is not None:
        last.lm_head.weight = first.model.embed_tokens.weight
    return stages


def apply_ac(modules: list[PipelineStageModule], activation_checkpointing: str, compute_dtype: torch.dtype) -> None:
    """Activation checkpointing (``none``, ``full`` or ``selective``: :meth:`PipelineStageModule._run_layer`
    recomputes the layers in backward) with the hidden states in ``compute_dtype``."""
    for m in modules:
        m.activation_checkpointing = activation_checkpointing
        m.hidden_dtype = compute_dtype


def rebuild_rotary(stage: PipelineStageModule, device: torch.device) -> None:
    """Recompute the rotary module's non-persistent buffers on ``device``.

    ``inv_freq`` is not in the checkpoint and meta construction leaves it undefined, so the
    module is rebuilt from the config with transformers' own rope initialisation.
    """
    rotary = stage.model.rotary_emb
    with torch.device(device):
        stage.model.rotary_emb = type(rotary)(config=rotary.config)


def rebuild_buffers(stage: PipelineStageModule, device: torch.device) -> None:
    """Recompute every non-persistent buffer of ``stage`` on ``device`` after loading.

    They are not in the checkpoint and meta construction leaves them undefined: the rotary
    module is rebuilt from the config; any other (Gemma's embedding scale) is set by the model's
    own ``_init_weights``, with the module's loaded parameters flagged as initialised so that
    transformers' guarded init functions leave them alone.
    """
    from transformers import initialization

    rebuild_rotary(stage, device)
    for module in stage.modules():
        if module is stage.model.rotary_emb:
            continue
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        for n in names:  # NaN marks what the initialiser did not set
            b = module._buffers[n]
            module._buffers[n] = (torch.full_like(b, float("nan"), device=device) if b.is_floating_point()
                                  else torch.zeros_like(b, device=device))
        params = list(module.parameters(recurse=False))
        for p in params:
            p._is_hf_initialized = True
        try:
            with torch.no_grad(), initialization.guard_torch_init_functions():
                stage._hf_model._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized
        for n in names:
            b = module._buffers[n]
            if b.is_floating_point() and torch.isnan(b).any():
                raise ValueError(f"{type(module).__name__}.{n}: a non-persistent buffer the model's "
                                 "initialiser does not set; hfpipe cannot rebuild it after a meta build")
