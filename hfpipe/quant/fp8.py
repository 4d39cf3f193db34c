"""Block-FP8 weights as DeepSeek-V3 ships them, kept quantized on the device.

A weight ``W`` (out x in) is stored as ``float8_e4m3fn`` values ``Q`` of the same shape and one fp32
scale per ``block x block`` tile (``weight_scale_inv``, ``ceil(out/block) x ceil(in/block)``), so
that ``W ~= Q.float() * scale`` tile by tile (edge tiles may be partial). :class:`FP8Linear` holds
``Q`` and the scales under the checkpoint's own names and dequantizes just in time: in forward, and
again in backward (:class:`_DequantLinear` saves only ``Q`` and the scales), so no full-precision
copy of a weight outlives its matmul.

Under ``--fp8-recipe blockwise`` a linear whose dims allow it multiplies the codes in float8 instead
(:mod:`hfpipe.quant.fp8_matmul`), so no weight is dequantized at all.

The dequantization is the checkpoint's definition, ``Q.float() * scale`` in fp32, as transformers'
``Fp8Dequantize`` computes it, then one cast to the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.quant.fp8_matmul import float8_tile_linear

__all__ = ["FP8", "FP8_DTYPES", "FP8_DEFAULT_BLOCK", "FP8Linear", "quantize_blocks", "dequantize_blocks", "is_fp8", "take_ranges",
           "tile_ranges"]

FP8_DEFAULT_BLOCK = 128  # DeepSeek-V3's weight_block_size

#: The storage dtype of the checkpoint's FP8 weights (DeepSeek ``"fmt": "e4m3"``).
FP8 = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` holds FP8 values (which mean nothing without their scales)."""
    return t.dtype in FP8_DTYPES


def _tiles(rows: int, cols: int, block: int) -> tuple[int, int]:
    return -(-rows // block), -(-cols // block)


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, scale)`` of ``w`` in the checkpoint's format: each tile's max maps to e4m3's max.

    Computed in fp32 on ``w``'s device; the transient is one fp32 copy of ``w``.
    """
    rows, cols = w.shape
    r, c = _tiles(rows, cols, block)
    padded = w.new_zeros((r * block, c * block), dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(r, block, c, block)  # (r, block, c, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
    q = (tiles / scale[:, None, :, None]).view(r * block, c * block)[:rows, :cols]
    return q.to(FP8).contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Q.float() * scale`` tile by tile, in fp32, cast once to ``dtype``."""
    rows, cols = q.shape
    s = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]  # (rows, cols)
    return (q.float() * s).to(dtype)


def take_ranges(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The ranges ``[(lo, hi), ...]`` of ``t`` along ``dim``, concatenated: a tensor-parallel rank's part
    (one range; one per half of a packed gate/up stack)."""
    parts = [t.narrow(dim, lo, hi - lo) for lo, hi in ranges]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()


def tile_ranges(ranges, block: int) -> list[tuple[int, int]]:
    """The scale-grid ranges of the tiles over the value ranges (each starting on a tile edge)."""
    return [(lo // block, -(-hi // block)) for lo, hi in ranges]


class _DequantLinear(torch.autograd.Function):
    """``x @ dequant(Q).T``; backward dequantizes again instead of keeping the weight."""

    @staticmethod
    def forward(ctx, x, q, scale, block: int, bias):
        ctx.save_for_backward(q, scale)
        ctx.block = block
        b = None if bias is None else bias.to(x.dtype)
        return nn.functional.linear(x, dequantize_blocks(q, scale, block, x.dtype), b)

    @staticmethod
    def backward(ctx, grad):  # the base (bias included) is frozen: only the input gets a gradient
        q, scale = ctx.saved_tensors
        w = dequantize_blocks(q, scale, ctx.block, grad.dtype)
        return grad @ w, None, None, None, None


class FP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is block-FP8 (``weight``) with ``weight_scale_inv``.

    Both are persistent buffers, not parameters: nothing trains them, FSDP2 leaves them whole on
    each rank (its mixed-precision cast would otherwise turn the FP8 codes into bf16 numbers), and
    the state dict keys are the checkpoint's. ``compute_dtype`` tells PEFT which dtype its
    adapters take (as for bitsandbytes' layers); the bias, if any, stays a run-dtype parameter.
    """

    plain_linear = True  # x @ W.T + b, as nn.Linear: a target of all-linear (hfpipe.models.targets)
    #: Multiply the codes in float8, tile by tile (``--fp8-recipe blockwise``: hfpipe.quant.fp8_matmul),
    #: instead of dequantizing the weight for a matmul in the compute dtype. Set by the quantizer.
    float8 = False
    cublas = False  # ... through torch's one-GEMM kernel, which runs on this device (fp8_matmul.cublas_blockwise)

    def __init__(self, in_features: int, out_features: int, block: int, bias: bool = False,
                 compute_dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=compute_dtype)
        del self.weight
        r, c = _tiles(out_features, in_features, block)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale_inv", torch.empty(r, c, dtype=torch.float32, device=device))
        self.block = block
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8:
            return float8_tile_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias, self.cublas)
        return _DequantLinear.apply(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weight (for merging and tests)."""
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype or self.compute_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 block={self.block}" + (", multiplied in float8" if self.float8 else "")
