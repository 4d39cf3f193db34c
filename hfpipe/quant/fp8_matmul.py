"""A block-FP8 base multiplied in float8 (``--fp8-recipe blockwise`` with ``--quantize-base fp8``).

DeepSeek-V3's recipe, on the weights as :class:`~hfpipe.quant.fp8.FP8Linear` holds them: a weight keeps
its e4m3 codes and one scale per ``block x block`` tile (the checkpoint's own, or quantized at load);
each token's activations are cast to e4m3 in ``1 x block`` tiles along the contraction dim, one scale
per tile; and ``y = sum over the K tiles t of (codes_x[:, t] @ codes_w[:, t].T) * scale_x[:, t] *
scale_w[:, t]``, each tile's product summed in fp32. The backward's input gradient takes the output
gradient in ``1 x block`` tiles along the output dim against the same codes. No weight is dequantized,
and nothing of the input is saved for backward: the base is frozen, so only the input gets a gradient.
A token's tiles are its own, so a row's output does not depend on the rows it is batched with (a
microbatch computes what the whole batch computes). Routed experts take the same product, one expert's
codes at a time (:attr:`hfpipe.models.experts.ExpertsState.multiply`, set by :mod:`hfpipe.quant.linear`).

Written here because no library does it for training on these weights everywhere: torchao's float8
training casts a full-precision weight (rowwise or tensorwise: one scale per row or tensor, which 128 x 128
tiles are not); transformers' ``FP8LinearFunction`` runs this forward only on a GPU, through DeepGEMM or a
Triton kernel fetched from the Hub by the ``kernels`` package (neither on a CPU nor offline without a
cached build), and its backward dequantizes the weight for a bf16 matmul. Two kernels compute it here,
both torch's own:

- **torch's one-GEMM kernel** (``F.scaled_mm`` with ``BlockWise1x128`` x ``BlockWise128x128`` scales; cuBLASLt
  12.9 or later, which torch runs on SM90 only: H100, H200) where the tile edge is 128 and both dims of the
  product divide by it. Whether it runs, and agrees with the tile loop, is checked once per device on a
  small product (:func:`cublas_blockwise`) before it is used; if not, the loop runs.
- **the tile loop** everywhere else (CPU, other GPUs, other tile edges): each K tile's product is one
  ``torch._scaled_mm`` with unit scales (float8 operands, fp32 out: exact products, fp32 sums); the tile
  scales are applied after, in fp32 (the run's dtype above it: fp64 runs), and the tiles summed.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn import functional as F

__all__ = ["SCALED_MM_DIVISOR", "cublas_blockwise", "fits_float8_tiles", "float8_tile_linear", "quantize_row_tiles",
           "tile_matmul"]

log = logging.getLogger(__name__)

_CODES = torch.float8_e4m3fn
_MAX = torch.finfo(_CODES).max

#: ``torch._scaled_mm`` multiplies matrices whose dims divide by this (torchao's float8 linears too,
#: :mod:`hfpipe.quant.float8`). Here the weight's dims and the tile edge must, so that every tile does.
SCALED_MM_DIVISOR = 16


def fits_float8_tiles(in_features: int, out_features: int, block: int) -> bool:
    """Whether a block-FP8 linear of these dims can multiply tile by tile in float8 (else it dequantizes)."""
    return all(n % SCALED_MM_DIVISOR == 0 for n in (in_features, out_features, block))


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for an fp64 run


def quantize_row_tiles(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, k) as e4m3 codes (rows, k) and one scale per ``1 x block`` tile (rows, ceil(k / block)):
    each tile's largest magnitude maps to e4m3's largest value, as :func:`hfpipe.quant.fp8.quantize_blocks`
    maps a weight's tiles."""
    rows, k = x.shape
    tiles = -(-k // block)
    wide = x.to(_scale_dtype(x.dtype))
    if k != tiles * block:  # a partial last tile: zeros do not change its largest magnitude
        wide = F.pad(wide, (0, tiles * block - k))
    wide = wide.view(rows, tiles, block)
    scale = wide.abs().amax(dim=-1).clamp(min=1e-12) / _MAX
    codes = (wide / scale[..., None]).clamp_(-_MAX, _MAX).view(rows, tiles * block)[:, :k]
    return codes.to(_CODES), scale


#: The tile edge torch's one-GEMM kernel takes (DeepSeek-V3's).
_CUBLAS_BLOCK = 128


def _cublas_fits(k: int, n: int, block: int) -> bool:
    return block == _CUBLAS_BLOCK and k % block == 0 and n % block == 0


def _scaled_blockwise(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`tile_matmul` as one ``F.scaled_mm``, its scales laid out as torch's checks require: the
    activations' column-major, the weight's grid padded to a multiple of 4 tiles along the contraction and
    read transposed (torch's own tests lay them out so)."""
    from torch.nn.functional import ScalingType, SwizzleType

    k_tiles = a_scale.shape[1]
    a_s = a_scale.float().t().contiguous().t()  # (m, k tiles), stride (1, m)
    b_s = F.pad(b_scale.float(), (0, -(-k_tiles // 4) * 4 - k_tiles), value=1.0).t()  # (k tiles padded, n tiles)
    return F.scaled_mm(a, b.t(), a_s, ScalingType.BlockWise1x128, b_s, ScalingType.BlockWise128x128,
                       swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=out_dtype,
                       use_fast_accum=False)  # (torch refuses fast accumulation with these scales)


# A custom op, so that a compiled layer runs it as it runs eagerly: its scales are laid out in strides that
# torch's checks require and that inductor, which has no lowering for F.scaled_mm before torch 2.13, could
# otherwise make contiguous around a fallback kernel.
@torch.library.custom_op("hfpipe::blockwise_scaled_mm", mutates_args=())
def _cublas_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_blockwise(a, a_scale, b, b_scale, out_dtype)


@_cublas_matmul.register_fake
def _(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def tile_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                block: int, out_dtype: torch.dtype, cublas: bool = False) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale).T`` from codes as ``out_dtype``, summed in ``a_scale``'s dtype (fp32
    through cuBLAS): ``a`` (m, k) e4m3 with one scale per ``1 x block`` tile of each row (m, ceil(k / block));
    ``b`` (n, k) e4m3 with one scale per ``block x block`` tile (ceil(n / block), ceil(k / block)). ``b`` is
    read as strided columns, which ``_scaled_mm`` takes as a column-major right operand. ``cublas``: torch's
    one-GEMM kernel where the shapes allow (:func:`cublas_blockwise` said it runs on this device)."""
    m, k = a.shape
    n = b.shape[0]
    if cublas and _cublas_fits(k, n, block):
        direct = out_dtype in (torch.bfloat16, torch.float32)  # what the kernel writes
        return _cublas_matmul(a, a_scale, b, b_scale, out_dtype if direct else torch.float32).to(out_dtype)
    per_row = b_scale.repeat_interleave(block, dim=0)[:n].to(a_scale.dtype)  # (n, k tiles): each row's scale
    one = torch.ones((), dtype=torch.float32, device=a.device)
    out = None
    for t in range(a_scale.shape[1]):
        lo, hi = t * block, min(k, (t + 1) * block)
        part = torch._scaled_mm(a[:, lo:hi], b[:, lo:hi].t(), one, one, out_dtype=torch.float32)
        part = part.to(a_scale.dtype).mul_(a_scale[:, t, None]).mul_(per_row[None, :, t])  # in place: two (m, n)
        out = part if out is None else out.add_(part)  # buffers at a time, the sum and a tile's product
    return out.to(out_dtype)


@functools.cache
def cublas_blockwise(device: torch.device) -> bool:
    """Whether torch's one-GEMM blockwise kernel runs on ``device`` and agrees with the tile loop, checked
    once per device on a 64 x 256 x 256 product. torch runs it on SM90 only, with cuBLASLt 12.9 or later (not
    the cu128 wheels); a build or GPU without it raises, and the loop runs instead."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    g = torch.Generator(device).manual_seed(0)
    codes, x_scale = quantize_row_tiles(torch.randn(64, 256, device=device, generator=g), _CUBLAS_BLOCK)
    q = torch.randn(256, 256, device=device, generator=g).mul_(64).to(_CODES)  # a weight's codes and tile scales
    scale = torch.rand(2, 2, device=device, generator=g).add_(0.5)
    want = tile_matmul(codes, x_scale, q, scale, _CUBLAS_BLOCK, torch.float32)
    try:
        got = _cublas_matmul(codes, x_scale, q, scale, torch.float32)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        log.info("--fp8-recipe blockwise: torch's blockwise kernel does not run here (%s); multiplying tile by "
                 "tile", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False
    agree = torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if not agree:
        log.warning("--fp8-recipe blockwise: torch's blockwise kernel is %.3g off the tile loop on %s; "
                    "multiplying tile by tile", (got - want).abs().max().item(), torch.cuda.get_device_name(device))
    return agree


class _Float8TileLinear(torch.autograd.Function):
    """``x @ W.T (+ bias)`` for a frozen block-FP8 ``W`` (codes ``q``, tile scales ``scale``), in float8."""

    @staticmethod
    def forward(ctx, x, q, scale, block: int, bias, cublas: bool):
        ctx.save_for_backward(q, scale)  # the codes only: no input, no dequantized weight
        ctx.block, ctx.cublas = block, cublas
        flat = x.reshape(-1, x.shape[-1])
        codes, tile_scale = quantize_row_tiles(flat, block)
        y = tile_matmul(codes, tile_scale, q, scale, block, x.dtype, cublas)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        codes, tile_scale = quantize_row_tiles(flat, ctx.block)  # 1 x block tiles along the output dim
        # dX = dY @ W: W.T's tiles are W's tiles transposed; its codes laid out (in, out) for the column reads
        grad_in = tile_matmul(codes, tile_scale, q.t().contiguous(), scale.t(), ctx.block, grad.dtype, ctx.cublas)
        return grad_in.view(*grad.shape[:-1], q.shape[1]), None, None, None, None, None


def float8_tile_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int,
                       bias: torch.Tensor | None, cublas: bool = False) -> torch.Tensor:
    """A frozen block-FP8 linear's output, multiplied in float8 (module docstring); ``cublas``: torch's
    one-GEMM kernel where the shapes allow (:func:`cublas_blockwise`)."""
    return _Float8TileLinear.apply(x, q, scale, block, bias, cublas)
