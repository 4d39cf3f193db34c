"""Routed MoE experts kept block-FP8 on their ranks (``--quantize-base fp8`` on a MoE model).

transformers holds a MoE layer's routed experts as fused 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, or ``up_proj``; GPT-OSS stores them transposed), which its conversion
tables build from the checkpoint's per-expert 2-D weights. Under ``--quantize-base fp8`` each becomes two
buffers in the layout of transformers' own ``FP8Experts``: the codes ``[E_local, N, K]`` and
``<name>_scale_inv`` ``[E_local, ceil(N/b), ceil(K/b)]``, one tile grid per expert. A checkpoint's own FP8
experts are stacked (gate and up concatenated) as stored, so no value is rounded twice; a bf16 checkpoint's
are quantized expert by expert as they load. With ``--ep`` a rank holds only its experts' rows.

They run through hfpipe's experts forward (:mod:`hfpipe.models.experts`), which dequantizes one
expert's weight at a time, in forward and again in backward.
"""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.models.experts import first_expert, register
from hfpipe.quant.fp8 import FP8, quantize_blocks
from hfpipe.quant.nf4 import QuantError

__all__ = ["STACKS", "FP8ExpertStacks", "fused_experts", "routed_expert_key"]

#: The fused 3-D weights of an experts module (transformers' names).
STACKS = ("gate_up_proj", "up_proj", "down_proj")


def fused_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Name -> each fused-experts module of ``module`` (transformers' ``@use_experts_implementation``)."""
    return {name: m for name, m in module.named_modules()
            if hasattr(m, "has_gate") and any(_stack(m, s) is not None for s in STACKS)}


def routed_expert_key(key: str) -> bool:
    """Whether checkpoint key ``key`` is a routed expert's weight (per expert 2-D, or a fused 3-D stack)."""
    return ".experts." in key and "shared_expert" not in key and not key.endswith(("bias", "_scale_inv"))


def _stack(module: nn.Module, name: str):
    """``module``'s fused weight ``name``: a 3-D parameter, or its FP8 buffer once quantized."""
    t = module._parameters.get(name, module._buffers.get(name))
    return t if t is not None and t.dim() == 3 else None


class FP8ExpertStacks:
    """Swaps one experts module's 3-D weights for FP8 buffers (on meta) and fills them while loading.

    Args:
        module: A fused-experts module (its stacks may be ep-sharded DTensors: only local rows are kept).
        name: Its full-model name.
        block: The FP8 tile edge.
    """

    def __init__(self, module: nn.Module, name: str, block: int) -> None:
        self.module, self.block = module, block
        self.rows: dict[str, tuple[int, int]] = {}  # full-model weight name -> the experts [lo, hi) held here
        for attr in STACKS:
            old = module._parameters.get(attr)
            if old is None or old.dim() != 3:
                continue
            local = old.to_local() if hasattr(old, "to_local") else old
            lo = first_expert(old)
            self.rows[f"{name}.{attr}"] = (lo, lo + local.shape[0])
            module._hfpipe_first_expert = lo
            module._hfpipe_shapes = {**getattr(module, "_hfpipe_shapes", {}), attr: tuple(old.shape)}
            e, n, k = local.shape
            del module._parameters[attr]
            module.register_buffer(attr, torch.empty(e, n, k, dtype=FP8, device="meta"))
            module.register_buffer(attr + "_scale_inv", torch.empty(e, -(-n // block), -(-k // block),
                                                                    dtype=torch.float32, device="meta"))
        module.fp8_block = block
        register(module)

    def place(self, target: str, tensor: torch.Tensor, scale: torch.Tensor | None, device) -> None:
        """Set stack ``target`` from the checkpoint's codes and ``scale`` (FP8), or quantize it here."""
        attr = target.rpartition(".")[2]
        want = tuple(self.module._buffers[attr].shape)
        if tuple(tensor.shape) != want:
            raise QuantError(f"{target}: the checkpoint gives shape {tuple(tensor.shape)}, this rank holds {want}; "
                             "config.json does not match the weights")
        if scale is None:  # full precision: one expert at a time, so one fp32 expert is the transient
            parts = [quantize_blocks(w.to(device), self.block) for w in tensor]
            tensor, scale = torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
        if tuple(scale.shape) != tuple(self.module._buffers[attr + "_scale_inv"].shape):
            raise QuantError(f"{target}_scale_inv has shape {tuple(scale.shape)}, but {self.block}x{self.block} tiles "
                             f"of {want} need {tuple(self.module._buffers[attr + '_scale_inv'].shape)}; "
                             "weight_block_size in config.json does not match the scales")
        self.module._buffers[attr] = tensor.to(device)
        self.module._buffers[attr + "_scale_inv"] = scale.to(device=device, dtype=torch.float32)
