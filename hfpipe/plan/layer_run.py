"""Running one layer of transformers' model as hfpipe's stage would, cheaply, to measure its memory.

Shared by :mod:`hfpipe.plan.activations` (what autograd saves) and :mod:`hfpipe.plan.transient` (what a
backward holds on top): the stage gets zero-stride parameters, a LoRA run's adapters as the run adds them,
and its matrix products are skipped (zeros of the result's layout).
"""

from __future__ import annotations

import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__: list[str] = []

_TOKENS = 64
_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp64": torch.float64}


def _signature(config, index: int, layer) -> str:
    """Layers with the same module classes, parameter shapes and layer type keep the same bytes."""
    kinds = getattr(config, "layer_types", None)
    shapes = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
    classes = [type(m).__name__ for m in layer.modules()]
    return json.dumps([classes, shapes, kinds[index] if kinds else None])


def _add_lora(stage: torch.nn.Module, full, lora: tuple[int, str, bool], experts: bool = False) -> None:
    """PEFT's adapters on ``stage`` as a LoRA run adds them, in the dtype they compute in.

    Over a bf16 base they are fp32 (PEFT's ``autocast_adapter_dtype``), and PEFT casts each adapted
    linear's input to them: every adapter keeps its own fp32 copy of its input (q, k and v one each),
    more than the frozen base saves (a frozen linear keeps none). Under FSDP2 (``lora[2]``: ``bf16-mixed``,
    or ``bf16`` sharded over dp x cp) its mixed-precision policy casts the adapters to the compute dtype for
    the forward like every parameter, so they read the base's input as it is (no copy).
    """
    from hfpipe.lora.adapters import add_adapters, lora_config, resolve_config
    from hfpipe.lora.experts import attach_expert_adapters

    rank, targets, fsdp = lora
    config = resolve_config(lora_config(rank, targets=targets), full)
    # PEFT's adapters on fused expert stacks (target_parameters) make every expert's whole delta weight
    # in forward (256 experts: 15 GB): measured apart, on few experts (``experts``, see _expert_adapters),
    # unless the experts are dispatched as under --ep (hfpipe.plan.dispatch), where no such fold runs
    if not experts:
        config.target_parameters = None
    add_adapters([stage], config)
    attach_expert_adapters([stage])  # dispatched experts: hfpipe's experts forward adapts them, as the run's
    if fsdp:
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
