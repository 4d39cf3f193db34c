"""PEFT's LoRA on fused routed experts that hfpipe keeps as FP8 codes or splits over ``--ep``.

PEFT adapts a fused expert stack (``target_parameters``; on transformers 5 also what ``all-linear``
and ``gate_proj``/``up_proj``/``down_proj`` become on DeepSeek-V2/V3) with a ``ParamWrapper`` that
folds its delta into the whole stack before the experts run. That fold needs every expert's
full-precision weight on the rank, which neither FP8 codes nor an ep shard are. So hfpipe lets PEFT
create its adapters as it always does (the same names, shapes and initialisation as one process),
then hands them to its own experts forward (:func:`hfpipe.models.experts.attach_adapter`), which adds
each expert's delta to that expert alone, by its global index.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from hfpipe.models.experts import attach_adapter, peek_state

__all__ = ["stacks_as_parameters", "attach_expert_adapters"]


@contextmanager
def stacks_as_parameters(modules: list[nn.Module], dtype: torch.dtype):
    """While PEFT injects: each quantized expert stack stands as a parameter of its global shape and ``dtype``.

    PEFT looks for ``target_parameters`` among parameters and reads their shape, dtype and device, never
    their values; the placeholder is one zero broadcast to the shape (no memory). The buffers come back after.
    """
    swapped = []
    for m in (sub for module in modules for sub in module.modules()):
        state = peek_state(m)
        for attr, shape in (state.shapes if state else {}).items():
            codes = m._buffers.pop(attr)
            m._parameters[attr] = nn.Parameter(torch.zeros((), dtype=dtype, device=codes.device).expand(shape),
                                               requires_grad=False)
            swapped.append((m, attr, codes))
    try:
        yield
    finally:
        for m, attr, codes in swapped:
            del m._parameters[attr]
            m._buffers[attr] = codes


def attach_expert_adapters(modules: list[nn.Module]) -> int:
    """Hand every PEFT ``ParamWrapper`` on quantized or ep-sharded experts to hfpipe's experts forward.

    Returns the number of adapters handed over.
    """
    from peft.tuners.lora.layer import ParamWrapper

    count = 0
    for wrapper in (sub for module in modules for sub in module.modules()):
        if not isinstance(wrapper, ParamWrapper):
            continue
        experts = wrapper.get_base_layer()
        state = peek_state(experts)
        if not ((state and state.shapes) or getattr(experts, "_is_expert_parallel", False)):
            continue  # a whole full-precision stack: PEFT's own fold is exact and stays
        attach_adapter(experts, wrapper)  # its ExpertsState reads the first expert off the ep shard
        count += 1
    return count
