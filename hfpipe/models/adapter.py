"""The structural adapter: how any embed -> layers -> norm -> head causal LM is split into stages.

Every family hfpipe runs has the skeleton ``model.embed_tokens -> model.layers -> model.norm ->
lm_head``, and transformers' own modules do all the math. What a family's HF forward does *around*
its layers is declared here as small, named pieces, each applied on the stage that owns the part:
the embedding (first stage), the rotary embeddings and masks (every stage with layers) and the
logits (last stage). A family file (``models/gemma.py`` ...) only lists its pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hfpipe.errors import HfpipeError


__all__ = ["Adapter", "ConfigFactor", "ExpandStreams", "MOE_REFUSALS", "Softcap", "UnsupportedModelError"]

# The MoE router aux loss is carried through the pipeline for the families of the tested table
# (hfpipe.models.router_loss); a family proven at load was compared on its logits only, so it
# refuses the aux loss, with the reason and the fix.
_MOE_AUX = (
    "hfpipe carries the router aux loss only for the families of its tested table; "
    "set output_router_logits=false in config.json"
)
MOE_REFUSALS = {"output_router_logits": _MOE_AUX}


class UnsupportedModelError(HfpipeError):
    """The architecture cannot be pipelined exactly by hfpipe.

    A ValueError like :class:`hfpipe.errors.HfpipeError`, but not a subclass: this module is the
    floor every family file stands on, and importing the error base here would lift the whole
    model and planning stack one floor.
    """


@dataclass(frozen=True)
class ConfigFactor:
    """Multiply (or divide) by a config attribute, as HF does outside the layers.

    Granite scales the embedding by ``embedding_multiplier`` and divides the logits by
    ``logits_scaling``; Cohere multiplies the logits by ``logit_scale``.
    """

    attr: str
    divide: bool = False

    def __call__(self, config, x: torch.Tensor) -> torch.Tensor:
        value = getattr(config, self.attr)
        if value is None:
            return x
        return x / value if self.divide else x * value


@dataclass(frozen=True)
class Softcap:
    """``cap * tanh(x / cap)`` with ``cap = config.<attr>`` (Gemma-2/3 final logits); off when None."""

    attr: str

    def __call__(self, config, x: torch.Tensor) -> torch.Tensor:
        cap = getattr(config, self.attr, None)
        if cap is None:
            return x
        return torch.tanh(x / cap) * cap


@dataclass(frozen=True)
class ExpandStreams:
    """Copy the embedding into ``config.<attr>`` hyper-connection streams: (B, T, H) -> (B, T, hc, H)."""

    attr: str

    def __call__(self, config, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(2).expand(-1, -1, getattr(config, self.attr), -1).contiguous()


@dataclass(frozen=True)
class Adapter:
    """What hfpipe needs to know about one model family.

    Attributes:
        model_types: ``config.model_type`` values this adapter serves.
        embed: Transforms of the embedding output, in order (first stage).
        logits: Transforms of ``lm_head``'s output, in order (last stage). They are per token, so
            the logits of a chunk of tokens are the chunk of the logits.
        rope_by_layer_type: The rotary module takes the layer type (Gemma-3's local/global rope)
            and each layer gets the embeddings of its type.
        mask_kwargs: Extra arguments of transformers' mask builders (DeepSeek-V3.2's indexer needs
            a materialised causal mask).
        mtp_attr: Config attribute counting multi-token-prediction layers stored in the checkpoint
            after the decoder layers (DeepSeek-V3); the HF model has no module for them.
        refuse_if: Config attribute -> reason; the model is refused when the attribute is truthy,
            because the HF forward then does more than the stages reproduce.
        tested: In hfpipe's test table; otherwise the structure is proven at load.
        streams_attr: Config attribute giving a stream axis of the hidden states, (B, T, hc, H)
            (DeepSeek-V4's hyper-connections).
        rope_table: Every layer gets a dict of these rotary embeddings (DeepSeek-V4: main, compress).
        mask_kind: One mask kind for every layer, whatever its ``layer_types`` entry.
        layer_inputs: Batch inputs every layer takes besides the hidden states (``input_ids``),
            so the pipeline passes them to every stage.
        head_modules: ``model.<name>`` modules the last stage runs before the final norm.
    """

    model_types: tuple[str, ...]
    embed: tuple = ()
    logits: tuple = ()
    rope_by_layer_type: bool = False
    mask_kwargs: dict = field(default_factory=dict)
    mtp_attr: str | None = None
    refuse_if: dict[str, str] = field(default_factory=dict)
    tested: bool = True
    streams_attr: str | None = None
    rope_table: tuple[str, ...] = ()
    mask_kind: str | None = None
    layer_inputs: tuple[str, ...] = ()
    head_modules: tuple[str, ...] = ()

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

    def embed_tokens(self, config, embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's hidden states (B, T, H)."""
        h = embedding(input_ids)
        for transform in self.embed:
            h = transform(config, h)
        return h

    def position_embeddings(self, rotary, h: torch.Tensor, position_ids, layer_types: list[str]) -> dict:
        """Rotary embeddings by layer type (key ``None`` when every layer shares one)."""
        if self.rope_table:
            return {None: {t: rotary(h, position_ids=position_ids, layer_type=t) for t in self.rope_table}}
        if self.rope_by_layer_type:
            return {t: rotary(h, position_ids, t) for t in sorted(set(layer_types))}
        return {None: rotary(h, position_ids)}

    def rope_key(self, layer_type: str):
        return layer_type if self.rope_by_layer_type else None

    def hidden_shape(self, config, batch_size: int, seq_len: int) -> tuple[int, ...]:
        """Shape of the hidden states that cross a stage boundary."""
        if self.streams_attr:
            return (batch_size, seq_len, getattr(config, self.streams_attr), config.hidden_size)
        return (batch_size, seq_len, config.hidden_size)

    def head(self, config, norm, lm_head, h: torch.Tensor, before_norm=()) -> torch.Tensor:
        """Head-side modules, final norm, head and the family's logit transforms (per token)."""
        for module in before_norm:
            h = module(h)
        logits = lm_head(norm(h))
        for transform in self.logits:
            logits = transform(config, logits)
        return logits
