"""Routed MoE experts kept quantized on their ranks (``--quantize-base fp8|nf4`` on a MoE model).

transformers holds a MoE layer's routed experts as fused 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, or ``up_proj``; GPT-OSS stores them transposed), which its conversion
tables build from the checkpoint's per-expert 2-D weights. Under ``--quantize-base fp8`` each becomes two
buffers in the layout of transformers' own ``FP8Experts``: the codes ``[E_local, N, K]`` and
``<name>_scale_inv`` ``[E_local, ceil(N/b), ceil(K/b)]``, one tile grid per expert. A checkpoint's own FP8
experts are stacked (gate and up concatenated) as stored, so no value is rounded twice; a bf16 checkpoint's
are quantized expert by expert as they load. ``nf4`` keeps one torchao ``NF4Tensor`` per expert's
matrix (:class:`ExpertStacks`). With ``--ep`` a rank holds only its experts' rows.

They run through hfpipe's experts forward (:mod:`hfpipe.models.experts`, which the quantizer
registers), dequantizing one expert's weight at a time, in forward and again in backward.
"""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.models.experts import STACKS, experts_state
from hfpipe.quant.fp8 import FP8, dequantize_blocks, quantize_blocks, take_ranges, tile_ranges
from hfpipe.quant.nf4 import QuantError, check_nf4, quantize_nf4

__all__ = ["STACKS", "ExpertStacks", "fused_experts", "routed_expert_key", "split_seam"]



def fused_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Name -> each fused-experts module of ``module`` (transformers' ``@use_experts_implementation``)."""
    return {name: m for name, m in module.named_modules()
            if hasattr(m, "has_gate") and any(_stack(m, s) is not None for s in STACKS)}


def routed_expert_key(key: str) -> bool:
    """Whether checkpoint key ``key`` is a routed expert's weight (per expert 2-D, or a fused 3-D stack)."""
    return ".experts." in key and "shared_expert" not in key and not key.endswith(("bias", "_scale_inv"))


def _stack(module: nn.Module, name: str):
    """``module``'s fused weight ``name``: a 3-D parameter, or its buffer once quantized."""
    t = module._parameters.get(name, module._buffers.get(name))
    return t if t is not None and t.dim() == 3 else None


def split_seam(module: nn.Module, attr: str) -> bool:
    """Whether stack ``attr`` of ``module`` is gate and up stacked row-wise (``[gate; up]`` per expert): two
    matrices in the checkpoint, so NF4 quantizes the halves apart, as a merged export meets them."""
    return attr == "gate_up_proj" and getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed", False)


class ExpertStacks:
    """Swaps one experts module's 3-D weights for quantized storage (on meta) and fills it while loading.

    - ``fp8``: two buffers per stack, the codes and ``<name>_scale_inv`` (see the module docstring);
    - ``nf4``: torchao's ``NF4Tensor`` is 2-D and cannot be sliced, so each expert's matrix is one
      ``NF4Tensor`` (two for a gate/up stack: :func:`split_seam`), kept in the module's
      :class:`~hfpipe.models.experts.ExpertsState`; the
      stack's name holds a zero broadcast to its local shape (no memory), so loading finds it.

    Args:
        module: A fused-experts module (its stacks may be ep-sharded DTensors: only local rows are kept).
        name: Its full-model name.
        kind: ``fp8`` or ``nf4``.
        block: The FP8 tile edge, or the NF4 block.
    """

    def __init__(self, module: nn.Module, name: str, kind: str, block: int) -> None:
        self.module, self.kind, self.block = module, kind, block
        state = experts_state(module)  # before the stacks are swapped: it reads the first expert off them
        self.rows: dict[str, tuple[int, int]] = {}  # full-model weight name -> the experts [lo, hi) held here
        for attr in STACKS:
            old = module._parameters.get(attr)
            if old is None or old.dim() != 3:
                continue
            local = old.to_local() if hasattr(old, "to_local") else old
            lo = state.first
            self.rows[f"{name}.{attr}"] = (lo, lo + local.shape[0])
            state.shapes[attr] = tuple(old.shape)
            e, n, k = local.shape
            del module._parameters[attr]
            if kind == "nf4":
                for half in ((n // 2, k), (n // 2, k)) if split_seam(module, attr) else ((n, k),):
                    check_nf4(f"{name}.{attr}", half, block)
                module.register_buffer(attr, torch.zeros((), dtype=torch.uint8, device="meta").expand(e, n, k))
                continue
            module.register_buffer(attr, torch.empty(e, n, k, dtype=FP8, device="meta"))
            module.register_buffer(attr + "_scale_inv", torch.empty(e, -(-n // block), -(-k // block),
                                                                    dtype=torch.float32, device="meta"))
        state.block, state.dequantize = block, dequantize_blocks

    def place(self, target: str, tensor: torch.Tensor, scale: torch.Tensor | None, device) -> None:
        """Set stack ``target`` from the checkpoint's codes and ``scale`` (FP8), or quantize it here."""
        attr = target.rpartition(".")[2]
        part = getattr(self.module, "tp_parts", {}).get(attr)  # split over tp: hfpipe.quant.tensor
        if part is not None and tensor.shape[part[0]] == experts_state(self.module).shapes[attr][part[0]]:
            tensor = take_ranges(tensor, *part)
            scale = None if scale is None else take_ranges(scale, part[0], tile_ranges(part[1], self.block))
        want = tuple(self.module._buffers[attr].shape)
        if tuple(tensor.shape) != want:
            raise QuantError(f"{target}: the checkpoint gives shape {tuple(tensor.shape)}, this rank holds {want}; "
                             "config.json does not match the weights")
        if self.kind == "nf4":  # one expert (or half) at a time: one full-precision matrix is the transient
            halves = 2 if split_seam(self.module, attr) else 1
            nf4 = [tuple(quantize_nf4(h.to(device).contiguous(), self.block) for h in w.chunk(halves)) for w in tensor]
            experts_state(self.module).nf4[attr] = nf4
            self.module._buffers[attr] = torch.zeros((), dtype=torch.uint8, device=device).expand(*want)
            return
        if scale is None:  # full precision: one expert at a time, so one fp32 expert is the transient
            parts = [quantize_blocks(w.to(device), self.block) for w in tensor]
            tensor, scale = torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
        if tuple(scale.shape) != tuple(self.module._buffers[attr + "_scale_inv"].shape):
            raise QuantError(f"{target}_scale_inv has shape {tuple(scale.shape)}, but {self.block}x{self.block} tiles "
                             f"of {want} need {tuple(self.module._buffers[attr + '_scale_inv'].shape)}; "
                             "weight_block_size in config.json does not match the scales")
        self.module._buffers[attr] = tensor.to(device)
        self.module._buffers[attr + "_scale_inv"] = scale.to(device=device, dtype=torch.float32)
