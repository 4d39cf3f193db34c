"""Activation bytes a decoder layer keeps for backward, measured on transformers' own layer.

A closed formula (Korthikanti et al.'s ``34 * h`` bytes per token) assumes a GPT-style block; the
families hfpipe runs differ by more than it can say: SwiGLU MLPs of 3.5 h, RMSNorms that upcast
to fp32, per-head q/k norms, MLA's low-rank projections, a router and ``top_k`` experts per token.
Measured here on transformers' layers (bf16, 64 tokens): Llama-3.1-8B keeps 24.6 h elements per
token, DeepSeek-V3 42 (dense) and 61 (MoE) against the formula's 17, so ``plan`` under-priced
them 1.4x-3.6x. No library prices this per family, so it is measured: the stage hfpipe would
build for one layer of each kind runs 64 tokens forward on CPU under a saved-tensors hook, which
counts the bytes autograd keeps (parameters excluded). The parameters are zero-stride views of one
element (expert stacks: of one matrix), so even a 256-expert layer costs little memory.

The result is per token (activations grow linearly with tokens under SDPA's fused kernels, which
keep no T x T scores) and cached per config and dtype. A family the measurement cannot run
falls back to the formula, with a log line.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import weakref
from contextlib import nullcontext

import torch

from hfpipe.errors import HfpipeError
from hfpipe.plan.dispatch import dispatch_experts
from hfpipe.plan.layer_run import _DTYPES, _TOKENS, _SkipMatmuls, _add_lora, _materialise, _signature
from hfpipe.plan.layouts import SEQ, WHOLE, Layouts, share, weight_styles

__all__ = ["expert_adapter_bytes", "head_bytes_per_token", "layer_bytes_per_token", "layer_layouts"]

log = logging.getLogger(__name__)



def layer_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None) -> tuple[int, ...]:
    """Bytes each decoder layer keeps per token until its backward, at ``dtype`` (plan's names).

    ``lora``: ``(rank, targets)`` of a LoRA run, measured on the layer with PEFT's adapters in it and
    its base frozen, as the run builds it (a frozen linear keeps no input; each adapter keeps its own
    copy of its input in the adapters' dtype, fp32 over a bf16 base: see :func:`_add_lora`).
    """
    return tuple(sum(held) for held in layer_layouts(config, dtype, lora))


def layer_layouts(config, dtype: str, lora: tuple[int, str] | None = None, experts_whole: bool = False,
                  fsdp: bool = False, dispatched: bool = False) -> tuple[tuple[int, int, int], ...]:
    """Per decoder layer, the bytes per token of :func:`layer_bytes_per_token` as a tensor-parallel rank keeps
    them: ``(whole, by sequence, split)`` (:mod:`hfpipe.plan.layouts`; all whole for a family tp does not run).

    ``experts_whole``: the routed experts are sharded over ep instead of tp (``--ep``); ``fsdp``: the stages
    are FSDP2 modules (``dp * cp > 1``; ``bf16-mixed`` casts alike at one replica), which run a LoRA run's
    adapters in the compute dtype;
    ``dispatched``: the routed experts are reached by ``--ep``'s all-to-all dispatch (:mod:`hfpipe.plan.dispatch`);
    a quantized base's are priced so too (hfpipe's experts forward runs them, without the dispatch: a bound)."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    lora = (*lora, fsdp or dtype == "bf16-mixed") if lora is not None else None
    return _measure_all(key, type(config), dtype, lora, experts_whole, dispatched)


@functools.lru_cache(maxsize=32)
def _measure_all(key: str, config_cls, dtype: str, lora: tuple[int, str, bool] | None = None,
                 experts_whole: bool = False, dispatched: bool = False) -> tuple[tuple[int, int, int], ...]:
    from hfpipe.models.meta import build_meta_model, model_config

    fields = json.loads(key)
    try:
        config = model_config(config_cls.from_dict(fields))
        full = build_meta_model(config, _DTYPES[dtype])
        by_kind: dict[str, tuple[int, int, int]] = {}
        out = []
        for i, layer in enumerate(full.model.layers):
            kind = _signature(config, i, layer)
            if kind not in by_kind and dispatched:  # the experts as --ep runs them, adapters on their stacks too
                by_kind[kind] = _measure_layer(config, full, i, dtype, lora, experts_whole, experts=True,
                                               dispatched=True)
            if kind not in by_kind:
                by_kind[kind] = _measure_layer(config, full, i, dtype, lora, experts_whole)
                if lora is not None and _adapts_parameters(full, lora):  # adapters on the expert stacks
                    by_kind[kind] = max(by_kind[kind], _measure_layer(config, full, i, dtype),
                                        (_expert_adapters(config, i, dtype, lora)[0], 0, 0), key=sum)
            out.append(by_kind[kind])
        return tuple(out)
    except HfpipeError:  # the user's input (a --lora-targets that matches nothing): said once, by the caller
        raise
    except Exception as e:  # noqa: BLE001 - a family the measurement cannot run gets the formula
        log.info("activation memory of %s by formula (measuring a layer failed: %s: %s)",
                 fields.get("model_type"), type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        per = 34 * fields["hidden_size"] * (4 if dtype == "fp32" else 2) // 2
        # Korthikanti et al.'s split of those 34 h: 24 h between the split matmuls, 10 h on the residual stream
        held = (0, per * 10 // 34, per - per * 10 // 34)
        return (held,) * fields["num_hidden_layers"]


def _measure_layer(cfg, full, index: int, precision: str, lora: tuple[int, str, bool] | None = None,
                   experts_whole: bool = False, experts: bool = False, tokens: int = _TOKENS,
                   dispatched: bool = False) -> tuple[int, int, int]:
    """Bytes autograd keeps, per token, when hfpipe's one-layer stage runs ``tokens`` tokens: (whole, by
    sequence, split) as tp ranks keep them (:mod:`hfpipe.plan.layouts`).

    The stage takes its modules from ``full`` (the meta model) and gives them real buffers and
    zero-stride parameters, as loading would give them weights; a LoRA run's adapters then go in
    as :func:`hfpipe.lora.adapters.add_adapters` puts them (``dispatched``: after its routed experts are put
    behind ``--ep``'s dispatch, :func:`hfpipe.plan.dispatch.dispatch_experts`, as loading puts them).
    """
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import PipelineStageModule

    adapter = adapter_for(cfg)
    stage = PipelineStageModule(StageSpec(0, (index,), embed=False, head=False), cfg, full, adapter)
    dtype = _DTYPES[precision]
    _materialise(stage, dtype)
    if dispatched:
        dispatch_experts(stage)
    if lora is not None:
        _add_lora(stage, full, lora, experts)
    rng = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    x = torch.randn(adapter.hidden_shape(cfg, 1, tokens), generator=rng, dtype=dtype, requires_grad=True)
    extra = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)} if adapter.layer_inputs else {}
    layouts = _layouts(stage, cfg, experts_whole, x, SEQ)  # a layer takes the residual stream
    return tuple(b // tokens for b in _saved_bytes(stage, lambda: stage(x, **extra), layouts))


def _layouts(stage, cfg, experts_whole: bool, x: torch.Tensor, tag: int) -> Layouts | None:
    """The dispatch mode that tags what ``stage`` makes from ``x`` as tp ranks would hold it (None for a family
    tensor parallelism does not run: then everything is whole). One measurement serves every tp."""
    from hfpipe.parallel.tensor_plan import TP_FAMILIES

    if cfg.model_type not in TP_FAMILIES:
        return None
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    layouts = Layouts(weight_styles(stage, cfg, experts_whole), weights)
    layouts.set(x, tag)
    return layouts


def _saved_bytes(stage: torch.nn.Module, run, layouts: Layouts | None = None) -> tuple[int, int, int]:
    """Bytes autograd still keeps for backward once ``run()`` has returned (``stage``'s parameters not
    counted): (whole, by sequence, split) by ``layouts``' tags, or all whole without."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    kept: list[tuple[weakref.ref, int, int]] = []  # (tensor, storage address, storage bytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            kept.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _SkipMatmuls(), layouts or nullcontext():
        out = run()
    # Only what is still alive waits for backward: a branch the output does not depend on (a
    # router's statistics) frees its saved tensors during forward, and the allocator may reuse
    # their addresses, so counting by address alone over- or under-counted by chance.
    alive = {ptr: nbytes for ref, ptr, nbytes in kept if ref() is not None}
    del out
    held = [0, 0, 0]
    for ptr, nbytes in alive.items():  # tags read at the end: a block's input is whole once a matmul gathers it
        held[layouts.tags.get(ptr, WHOLE) if layouts else WHOLE] += nbytes
    return tuple(held)


def head_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None, tp: int = 1,
                         fsdp: bool = False) -> int:
    """Bytes the last stage's head keeps per token until its backward when the loss is not chunked:
    the final norm, the head and the family's logit transforms (measured as a layer is), and the
    cross-entropy's fp32 log-probabilities (``4 * vocab``; the logits themselves are not kept) and its
    int64 targets; on one rank of ``tp``, which splits the vocabulary but keeps the norm (it reads the
    whole hidden states) and the head's input whole (``fsdp``: as :func:`layer_layouts`)."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    lora = (*lora, fsdp or dtype == "bf16-mixed") if lora is not None else None
    loss = 4 * config.vocab_size // tp + 8  # log-probabilities over this rank's vocabulary; whole targets
    return int(share(_measure_head(key, type(config), dtype, lora), tp, True)) + loss


@functools.lru_cache(maxsize=32)
def _measure_head(key: str, config_cls, dtype: str, lora: tuple[int, str, bool] | None) -> tuple[int, int, int]:
    from hfpipe.models.meta import build_meta_model, model_config
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import PipelineStageModule

    fields = json.loads(key)
    try:
        cfg = model_config(config_cls.from_dict(fields))
        full = build_meta_model(cfg, _DTYPES[dtype])
        adapter = adapter_for(cfg)
        stage = PipelineStageModule(StageSpec(0, (), embed=False, head=True), cfg, full, adapter)
        _materialise(stage, _DTYPES[dtype])
        if lora is not None:
            _add_lora(stage, full, lora)
        x = torch.zeros(adapter.hidden_shape(cfg, 1, _TOKENS), dtype=_DTYPES[dtype], requires_grad=True)
        held = _saved_bytes(stage, lambda: stage.logits(x), _layouts(stage, cfg, False, x, WHOLE))
        return tuple(b // _TOKENS for b in held)
    except HfpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - the norm and the head's input, by formula
        log.info("head memory of %s by formula (measuring failed: %s)", fields.get("model_type"), e)
        return fields["hidden_size"] * (4 + 2 * (4 if dtype == "fp32" else 2)), 0, 0  # whole over tp


def expert_adapter_bytes(config, dtype: str, lora: tuple[int, str] | None, fsdp: bool = False,
                         dispatched: bool = False) -> tuple[int, ...]:
    """Per decoder layer, the bytes a LoRA run's adapters on the expert stacks keep per microbatch whatever its
    tokens: each expert's weight with its delta added, which PEFT's ``ParamWrapper`` makes in forward and the
    experts' matmuls save (all routed experts of the layer; a rank holds ``1 / ep`` of them). 0 without them,
    and 0 under ``--ep`` (``dispatched``): there hfpipe's experts forward builds one expert's weight at a time
    and saves only what it is made of, the adapter factors (:mod:`hfpipe.models.experts`)."""
    if lora is None or dispatched:
        return (0,) * config.num_hidden_layers
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return _expert_constants(key, type(config), dtype, (*lora, fsdp or dtype == "bf16-mixed"))


@functools.lru_cache(maxsize=32)
def _expert_constants(key: str, config_cls, dtype: str, lora: tuple[int, str, bool]) -> tuple[int, ...]:
    from hfpipe.models.meta import build_meta_model, model_config

    config = model_config(config_cls.from_dict(json.loads(key)))
    full = build_meta_model(config, _DTYPES[dtype])
    if not _adapts_parameters(full, lora):
        return (0,) * config.num_hidden_layers
    kinds: dict[str, int] = {}
    out = []
    for i, layer in enumerate(full.model.layers):
        kind = _signature(config, i, layer)
        if kind not in kinds:
            kinds[kind] = _expert_adapters(config, i, dtype, lora)[1]
        out.append(kinds[kind])
    return tuple(out)


def _expert_adapters(config, index: int, dtype: str, lora: tuple[int, str, bool]) -> tuple[int, int]:
    """Layer ``index`` measured with PEFT's adapters on its expert stacks too (``target_parameters``), on a copy
    of the model with only as many routed experts as a token is routed to: (bytes per token, bytes per
    microbatch for all the layer's routed experts).

    PEFT's ``ParamWrapper`` adds every expert's whole delta weight in forward (256 experts of DeepSeek-V3:
    15 GB), and the experts' matmuls save those weights: bytes per expert, not per token. What a token leaves
    does not depend on how many experts there are: each of its ``top_k`` experts keeps its copies of the token
    (a Qwen3-MoE run at ep2 kept an fp32 and a bf16 one per expert: 0.75x of the plan that measured the linears
    only). So the layer runs twice as many tokens once more: the difference is per token, the rest per expert.
    With routing ties (the zero weights) every token goes to the first ``top_k`` experts. ``(0, 0)`` where the
    copy cannot be made or run (then the layer is bounded by its linears' adapters and the full run)."""
    from hfpipe.models.meta import build_meta_model
    from hfpipe.models.moe import EP_KEYS, routed_experts

    count, top_k = routed_experts(config)
    few = copy.deepcopy(config)
    groups, chosen = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
    experts = groups * -(-top_k // chosen)  # group-limited routing picks top_k from topk_group groups
    try:
        setattr(few, next(k for k in EP_KEYS[0] if getattr(config, k, None) == count), min(count, experts))
        # a fresh model each time: the adapters go into the layer the stage takes from it
        once, twice = (sum(_measure_layer(few, build_meta_model(few, _DTYPES[dtype]), index, dtype, lora,
                                          experts=True, tokens=t)) * t for t in (_TOKENS, 2 * _TOKENS))
    except Exception as e:  # noqa: BLE001 - a family whose experts PEFT cannot adapt this way
        log.info("activations of LoRA on %s's experts not measured (%s: %s)", config.model_type, type(e).__name__, e)
        return 0, 0
    per_token = -(-(twice - once) // _TOKENS)
    return per_token, max(0, once - per_token * _TOKENS) * count // min(count, experts)


def _adapts_parameters(full, lora: tuple[int, str]) -> bool:
    from hfpipe.lora.adapters import lora_config, resolve_config

    return bool(resolve_config(lora_config(lora[0], targets=lora[1]), full).target_parameters)
