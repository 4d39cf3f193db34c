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

import functools
import json
import logging
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hfpipe.errors import HfpipeError

__all__ = ["head_bytes_per_token", "layer_bytes_per_token"]

log = logging.getLogger(__name__)

_TOKENS = 64
_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp64": torch.float64}


def layer_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None) -> tuple[int, ...]:
    """Bytes each decoder layer keeps per token until its backward, at ``dtype`` (plan's names).

    ``lora``: ``(rank, targets)`` of a LoRA run, measured on the layer with PEFT's adapters in it and
    its base frozen, as the run builds it (a frozen linear keeps no input; each adapter keeps its own
    copy of its input in the adapters' dtype, fp32 over a bf16 base: see :func:`_add_lora`).
    """
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return _measure_all(key, type(config), dtype, lora)


@functools.lru_cache(maxsize=32)
def _measure_all(key: str, config_cls, dtype: str, lora: tuple[int, str] | None = None) -> tuple[int, ...]:
    from hfpipe.models.meta import build_meta_model, model_config

    fields = json.loads(key)
    try:
        config = model_config(config_cls.from_dict(fields))
        full = build_meta_model(config, _DTYPES[dtype])
        by_kind: dict[str, int] = {}
        out = []
        for i, layer in enumerate(full.model.layers):
            kind = _signature(config, i, layer)
            if kind not in by_kind:
                by_kind[kind] = _measure_layer(config, full, i, dtype, lora)
                if lora is not None and _adapts_parameters(full, lora):  # experts' adapters: not measured
                    by_kind[kind] = max(by_kind[kind], _measure_layer(config, full, i, dtype))
            out.append(by_kind[kind])
        return tuple(out)
    except HfpipeError:  # the user's input (a --lora-targets that matches nothing): said once, by the caller
        raise
    except Exception as e:  # noqa: BLE001 - a family the measurement cannot run gets the formula
        log.info("activation memory of %s by formula (measuring a layer failed: %s: %s)",
                 fields.get("model_type"), type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        per = 34 * fields["hidden_size"] * (4 if dtype == "fp32" else 2) // 2
        return (per,) * fields["num_hidden_layers"]


def _signature(config, index: int, layer) -> str:
    """Layers with the same module classes, parameter shapes and layer type keep the same bytes."""
    kinds = getattr(config, "layer_types", None)
    shapes = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
    classes = [type(m).__name__ for m in layer.modules()]
    return json.dumps([classes, shapes, kinds[index] if kinds else None])


def _measure_layer(cfg, full, index: int, precision: str, lora: tuple[int, str] | None = None) -> int:
    """Bytes autograd keeps, per token, when hfpipe's one-layer stage runs ``_TOKENS`` tokens.

    The stage takes its modules from ``full`` (the meta model) and gives them real buffers and
    zero-stride parameters, as loading would give them weights; a LoRA run's adapters then go in
    as :func:`hfpipe.lora.adapters.add_adapters` puts them.
    """
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import PipelineStageModule

    adapter = adapter_for(cfg)
    stage = PipelineStageModule(StageSpec(0, (index,), embed=False, head=False), cfg, full, adapter)
    dtype = _DTYPES[precision]
    _materialise(stage, dtype)
    if lora is not None:
        _add_lora(stage, full, lora, precision)
    rng = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    x = torch.randn(adapter.hidden_shape(cfg, 1, _TOKENS), generator=rng, dtype=dtype, requires_grad=True)
    extra = {"input_ids": torch.zeros(1, _TOKENS, dtype=torch.long)} if adapter.layer_inputs else {}
    return _saved_bytes(stage, lambda: stage(x, **extra)) // _TOKENS


def _saved_bytes(stage: torch.nn.Module, run) -> int:
    """Bytes autograd still keeps for backward once ``run()`` has returned (``stage``'s parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    kept: list[tuple[weakref.ref, int, int]] = []  # (tensor, storage address, storage bytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            kept.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _SkipMatmuls():
        out = run()
    # Only what is still alive waits for backward: a branch the output does not depend on (a
    # router's statistics) frees its saved tensors during forward, and the allocator may reuse
    # their addresses, so counting by address alone over- or under-counted by chance.
    alive = {ptr: nbytes for ref, ptr, nbytes in kept if ref() is not None}
    del out
    return sum(alive.values())


def head_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None) -> int:
    """Bytes the last stage's head keeps per token until its backward when the loss is not chunked:
    the final norm, the head and the family's logit transforms (measured as a layer is), and the
    cross-entropy's fp32 log-probabilities (``4 * vocab``; the logits themselves are not kept) and its
    int64 targets."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return _measure_head(key, type(config), dtype, lora)


@functools.lru_cache(maxsize=32)
def _measure_head(key: str, config_cls, dtype: str, lora: tuple[int, str] | None) -> int:
    from hfpipe.models.meta import build_meta_model, model_config
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import PipelineStageModule

    fields = json.loads(key)
    loss = 4 * fields["vocab_size"] + 8
    try:
        cfg = model_config(config_cls.from_dict(fields))
        full = build_meta_model(cfg, _DTYPES[dtype])
        adapter = adapter_for(cfg)
        stage = PipelineStageModule(StageSpec(0, (), embed=False, head=True), cfg, full, adapter)
        _materialise(stage, _DTYPES[dtype])
        if lora is not None:
            _add_lora(stage, full, lora, dtype)
        x = torch.zeros(adapter.hidden_shape(cfg, 1, _TOKENS), dtype=_DTYPES[dtype], requires_grad=True)
        return _saved_bytes(stage, lambda: stage.logits(x)) // _TOKENS + loss
    except HfpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - the norm and the head's input, by formula
        log.info("head memory of %s by formula (measuring failed: %s)", fields.get("model_type"), e)
        return loss + fields["hidden_size"] * (4 + 2 * (4 if dtype == "fp32" else 2))


def _adapts_parameters(full, lora: tuple[int, str]) -> bool:
    from hfpipe.lora.adapters import lora_config, resolve_config

    return bool(resolve_config(lora_config(lora[0], targets=lora[1]), full).target_parameters)


def _add_lora(stage: torch.nn.Module, full, lora: tuple[int, str], precision: str) -> None:
    """PEFT's adapters on ``stage`` as a LoRA run adds them, in the dtype they compute in.

    Over a bf16 base they are fp32 (PEFT's ``autocast_adapter_dtype``), and PEFT casts each adapted
    linear's input to them: every adapter keeps its own fp32 copy of its input (q, k and v one each),
    more than the frozen base saves (a frozen linear keeps none). Under ``bf16-mixed`` FSDP2 casts
    the adapters to bf16 for the forward like every parameter, so they keep bf16 inputs.
    """
    from hfpipe.lora.adapters import add_adapters, lora_config, resolve_config

    rank, targets = lora
    config = resolve_config(lora_config(rank, targets=targets), full)
    # PEFT's adapters on fused expert stacks (target_parameters) make every expert's whole delta weight
    # in forward (256 experts: 15 GB); the measurement adapts the linears only, and the caller bounds
    # the layer by the full run's bytes too (see _measure_all)
    config.target_parameters = None
    add_adapters([stage], config)
    if precision == "bf16-mixed":
        for name, p in stage.named_parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)


class _SkipMatmuls(TorchDispatchMode):
    """Matrix products return zeros of their result's shape, dtype and strides, uncomputed.

    The bytes autograd keeps depend on shapes only, and the products were 90% of a measurement
    (a DeepSeek-V3 MoE layer took 10-20 s on 2 CPU cores, most of ``hfpipe plan``'s time). Zeros
    route tokens as the zero-stride weights did: every weight row is the same, so every router
    logit of a token ties, and ties go to the lowest expert either way. The dispatch mode sits
    below autograd, so what autograd saves is unchanged (the test compares both ways).
    """

    _OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._OPS and func.overloadpacket is not torch.ops.aten._grouped_mm:
            return func(*args, **kwargs)
        # the result's layout, not its values; grouped_mm's meta kernel takes bf16 only (the CPU
        # kernel also runs fp32), so its shape is asked in bf16 and the dtype put back
        cast = torch.bfloat16 if func.overloadpacket is torch.ops.aten._grouped_mm else None
        meta = func(*_to_meta(args, cast), **_to_meta(kwargs, cast))
        dtype = args[0].dtype if cast is not None and meta.dtype == cast else meta.dtype
        return torch.zeros_like(meta, dtype=dtype, device=_device(args))


def _to_meta(tree, cast: torch.dtype | None):
    from torch.utils._pytree import tree_map

    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to("meta", dtype=cast if cast is not None and t.is_floating_point() else t.dtype)

    return tree_map(meta, tree)


def _device(args) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def _materialise(stage: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters as zero-stride views (shapes, almost no memory); buffers as zeros.

    A matrix is a view of one element; a stack of expert matrices repeats one real matrix,
    because grouped matmuls need a row or column stride of 1.
    """
    for module in stage.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            one = torch.full(p.shape[-2:] if p.dim() > 2 else (), 0.01, dtype=p.dtype)
            setattr(module, name, torch.nn.Parameter(one.expand(p.shape), requires_grad=p.requires_grad))
    for module in stage.modules():  # rotary tables and the like: zeros give the same shapes
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                module.register_buffer(name, torch.zeros(b.shape, dtype=b.dtype), persistent=False)
