"""The router load-balancing (auxiliary) loss of MoE models, carried through the pipeline.

transformers adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to the
loss of Mixtral, Qwen2/3-MoE, GPT-OSS, GraniteMoE and DeepSeek-V4 when ``output_router_logits``
is set (DeepSeek-V2/V3 return the router logits but add nothing). That function
collects every layer's router logits and reduces them to two per-expert sums over layers and
(unpadded) tokens before its only nonlinear step::

    counts[e] = sum over layers, tokens of mask * [e in top-k(softmax(logits))]   (no gradient)
    probs[e]  = sum over layers, tokens of mask * softmax(logits)[e]
    aux       = E * sum_e (counts[e] / rows) * (probs[e] / rows),   rows = layers * unpadded tokens

So no stage needs another stage's router logits: each stage adds its layers' sums to the ones it
received and sends them on beside the hidden states, as one 1-D fp32 tensor ``(2 * E,)`` (counts,
then probabilities); the last stage finishes ``aux``. Gradients reach every stage's router through
the ``probs`` half, as in the one-process model.

What "the same run" means across microbatches. ``aux`` is a product of two batch-wide sums, and
the counts (which set the gradient of ``probs``) are only known once every microbatch has run
forward, while torch's 1F1B, interleaved and V schedules start backward before the last forward.
So, as Megatron and DeepSpeed do, the loss is computed *per microbatch*: each microbatch's ``aux``
is exactly transformers' ``load_balancing_loss_func`` on that microbatch's rows, and the step's
router term is their mean over every microbatch of the step (all accumulation batches and dp ranks):
``loss = sum(CE) / tokens + coef * mean_m aux_m``. With one microbatch (and dp 1) that is
transformers' own loss on the whole batch; otherwise it equals transformers run microbatch by
microbatch with that mean (the oracle of tests/pipeline/test_pipeline_router_loss.py). Exact over the whole batch
would need every microbatch's counts before the first backward: a second forward pass per step.
The language-model part stays exact over the whole batch as before.

Evaluation runs no backward, so there the aux loss is exact over whole batches: the last stage returns
its microbatch's sums with the unpadded tokens they cover (:func:`sums_with_tokens`, ``(2 * E + 1,)``),
the caller adds them over microbatches, batches and dp ranks and finishes once
(:func:`finish_summed_router_loss`). An evaluation loss is then what transformers' model returns as
``loss`` on those rows: the language-model loss plus ``coef * aux``.

The hook sits on the router's output (the module transformers records as ``router_logits``), not
in the experts, so expert parallelism, which moves the experts' tokens, leaves it unchanged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RouterLossSpec", "router_loss_on", "router_loss_spec", "RouterSums", "finish_router_loss",
           "finish_summed_router_loss", "layer_sums", "sums_with_tokens"]


@dataclass(frozen=True)
class RouterLossSpec:
    """What transformers' load-balancing loss of one model needs.

    Attributes:
        router: The module class whose output transformers records as ``router_logits``.
        index: Which element of that module's output tuple are the logits.
        num_experts: ``E``.
        top_k: Experts per token counted in ``counts``.
        coef: ``router_aux_loss_coef``.
        layers: Router calls in one forward of the whole model (transformers' ``len(router_logits)``).
    """

    router: type
    index: int
    num_experts: int
    top_k: int
    coef: float
    layers: int

    @property
    def size(self) -> int:
        """Length of the carried tensor: counts, then probability sums."""
        return 2 * self.num_experts


def router_loss_on(config) -> bool:
    """Whether a model of this config adds a router aux loss to its objective (taken per microbatch here), from
    the config alone: it asks for router logits and its causal LM weighs them (``router_aux_loss_coef``)."""
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))


def router_loss_spec(model: nn.Module) -> RouterLossSpec | None:
    """The aux-loss recipe of the full HF causal LM ``model`` (meta is fine), or ``None``.

    ``None`` when the config does not ask for router logits, or when the family's causal LM returns
    them without adding a loss (DeepSeek-V2/V3 have no ``router_aux_loss_coef``).
    """
    if not getattr(model.config, "output_router_logits", False) or not hasattr(model, "router_aux_loss_coef"):
        return None
    if not hasattr(sys.modules[type(model).__module__], "load_balancing_loss_func"):
        raise ValueError(f"{model.config.model_type}: its aux loss is not transformers' load_balancing_loss_func; "
                         "set output_router_logits=false in config.json")
    recorder = model.model.can_record_outputs.get("router_logits")
    router, index = getattr(recorder, "target_class", None), getattr(recorder, "index", None)
    if router is None or getattr(recorder, "layer_name", None) is not None:
        raise ValueError(f"{model.config.model_type}: hfpipe cannot find its router module; "
                         "set output_router_logits=false in config.json")
    layers = sum(isinstance(m, router) for m in model.model.layers.modules())
    return RouterLossSpec(router, index, int(model.num_experts), int(model.num_experts_per_tok),
                          float(model.router_aux_loss_coef), layers)


class RouterSums:
    """Collects one stage forward's router logits and adds their sums to the incoming ones.

    A forward hook on each router of the stage keeps the logits between :meth:`start` and
    :meth:`stop`; they are reduced after each layer call, outside any activation checkpoint, so the
    recompute of a checkpointed layer in backward (hook inactive then) adds nothing twice.
    """

    def __init__(self, spec: RouterLossSpec, layers: nn.Module) -> None:
        self.spec = spec
        self._active: list | None = None
        for module in layers.modules():
            if isinstance(module, spec.router):
                module.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self._active is not None:
            self._active.append(output[self.spec.index] if isinstance(output, tuple) else output)

    def start(self, sums: torch.Tensor | None, device) -> torch.Tensor:
        """Begin a forward: the received sums, or zeros on the first stage."""
        self._active = []
        return sums if sums is not None else torch.zeros(self.spec.size, dtype=torch.float32, device=device)

    def add(self, sums: torch.Tensor, attention_mask) -> torch.Tensor:
        """Add the sums of the router logits seen since the last call (one layer's, in HF's order)."""
        for logits in self._active:
            sums = sums + layer_sums(logits, attention_mask, self.spec)
        self._active.clear()
        return sums

    def stop(self) -> None:
        self._active = None


def layer_sums(logits: torch.Tensor, attention_mask, spec: RouterLossSpec) -> torch.Tensor:
    """One layer's (counts, probability sums) over unpadded tokens, as ``load_balancing_loss_func``.

    Args:
        logits: Router logits (tokens, E), tokens in (batch, seq) order.
        attention_mask: The 2-D (B, T) padding mask of those tokens, or ``None`` (every token counts).
    """
    probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers
    _, chosen = torch.topk(probs, spec.top_k, dim=-1)  # (tokens, k)
    if attention_mask is None:
        mask = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        mask = attention_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)  # (tokens,)
    counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=probs.device)
    counts = counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(spec.top_k))
    return torch.cat([counts, (probs.float() * mask.unsqueeze(-1)).sum(dim=0)])  # (2E,)


def finish_router_loss(sums: torch.Tensor, attention_mask, tokens: int, spec: RouterLossSpec) -> torch.Tensor:
    """``coef * aux`` of one microbatch from its summed (counts, probs) over every layer.

    Args:
        tokens: Tokens of the microbatch (B * T), used when there is no mask.
    """
    return _finish(sums, _valid(attention_mask, tokens, sums.device), spec)


def sums_with_tokens(sums: torch.Tensor, attention_mask, tokens: int) -> torch.Tensor:
    """``(2 * E + 1,)``: a microbatch's summed (counts, probs) and the unpadded tokens they cover, a form that
    adds over microbatches, batches and ranks (evaluation's; :func:`finish_summed_router_loss` ends it)."""
    return torch.cat([sums, _valid(attention_mask, tokens, sums.device).reshape(1).to(sums.dtype)])


def finish_summed_router_loss(summed: torch.Tensor, spec: RouterLossSpec) -> torch.Tensor:
    """``coef * aux`` of every row whose :func:`sums_with_tokens` were added into ``summed``: transformers'
    aux loss of those rows run as one batch."""
    return _finish(summed[:-1], summed[-1], spec)


def _valid(attention_mask, tokens: int, device) -> torch.Tensor:
    """The unpadded tokens of a microbatch: its mask's sum, or all ``tokens`` without a mask."""
    valid = attention_mask.sum().float() if attention_mask is not None else torch.tensor(float(tokens))
    return valid.to(device)


def _finish(sums: torch.Tensor, valid: torch.Tensor, spec: RouterLossSpec) -> torch.Tensor:
    rows = valid.to(sums.device, sums.dtype) * spec.layers  # transformers adds the mask's sum once per layer
    # A microbatch of padding only has zero sums: transformers' 0/0 would be NaN; here it adds 0.
    rows = rows.clamp(min=1.0)
    counts, probs = sums[:spec.num_experts] / rows, sums[spec.num_experts:] / rows
    return spec.coef * (torch.sum(counts * probs.unsqueeze(0)) * spec.num_experts)
