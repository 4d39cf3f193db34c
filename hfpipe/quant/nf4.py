"""NF4 frozen base weights through torchao's ``NF4Tensor`` (QLoRA's 4-bit NormalFloat).

Why torchao and not bitsandbytes (measured 2026-11-23, torch 2.13 CPU, gloo, torchao 0.18.0 vs
bitsandbytes 0.50.2, both from PyPI):

- both quantize and run forward/backward on CPU;
- FSDP2 over dp=2 (``fully_shard`` of the quantized linears, LoRA-style trainable layers beside
  them): torchao's ``NF4Tensor`` trains exactly as one process (3 SGD steps, loss diff 0.0; it
  implements FSDP2's ``fsdp_pre/post_all_gather`` and the shard ops), while bitsandbytes'
  ``Params4bit`` loses its ``quant_state`` in FSDP2's all-gather and fails in forward
  (``ValueError: quant_state is required``; accelerate#3983 reports the silent variant);
- ``F.linear`` on an ``NF4Tensor`` is exactly ``x @ dequant(W).T`` (max diff 0.0) through an
  autograd function that saves only the NF4 weight and dequantizes again in backward, which is
  the just-in-time contract of ``--quantize-base``;
- installed size 26 MB (torchao) vs 125 MB (bitsandbytes, CUDA binaries included).

A weight of ``numel`` elements is cut (row-major) into blocks of ``block`` values, each scaled
by its absmax, and the absmaxes are themselves quantized to int8 in groups of
:func:`scaler_block` blocks (torchao's double quantization).
"""

from __future__ import annotations

import math

import torch

from hfpipe.errors import HfpipeError

__all__ = ["DEFAULT_BLOCK", "QuantError", "check_nf4", "quantize_nf4", "scaler_block", "torchao_nf4"]

#: QLoRA's and torchao's NF4 block (values per absmax scale).
DEFAULT_BLOCK = 64
_MAX_SCALER_BLOCK = 256  # torchao's default group of scales per int8 quantization factor
_MAX_DP = 8  # scale groups never straddle an eighth of the rows: FSDP2 can shard rows over dp | 8


class QuantError(HfpipeError):
    """A quantized-base setting that cannot work (one line: names the option or tensor and the fix).

    The layer's own ``ValueError`` (as ARCHITECTURE.md allows) rather than an ``HfpipeError``: importing
    ``hfpipe.errors`` would put ``quant/`` one floor higher, and the export path over it past nine.
    """


def torchao_nf4():
    """torchao's NF4 module, or a :class:`QuantError` saying how to install it."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise QuantError("--quantize-base nf4 needs torchao >= 0.18: pip install 'hfpipe[qlora]'") from None
    return nf4_tensor


def scaler_block(n_blocks: int) -> int:
    """Blocks per int8 scale group: torchao's 256, fewer for small weights.

    The group divides ``n_blocks / 8`` where it can, so that a weight whose rows split over
    ``dp`` in {2, 4, 8} FSDP2 shards splits along whole groups; the rule depends on the shape
    alone, so every dp size quantizes a weight to the same codes.
    """
    if n_blocks % _MAX_DP == 0:
        return math.gcd(_MAX_SCALER_BLOCK, n_blocks // _MAX_DP)
    return math.gcd(_MAX_SCALER_BLOCK, n_blocks)


def check_nf4(name: str, shape, block: int) -> None:
    """Raise :class:`QuantError` unless ``block`` divides the rows of weight ``name``."""
    if block <= 0 or block % 2:
        raise QuantError(f"--quantize-block-size {block}: NF4 needs an even, positive block size (e.g. 64)")
    if len(shape) != 2 or shape[1] % block:
        fits = [b for b in (128, 64, 32, 16, 8) if shape[-1] % b == 0][:2]
        hint = f" (e.g. {' or '.join(map(str, fits))})" if fits else ""
        raise QuantError(f"--quantize-block-size {block} does not divide the rows of {name} "
                         f"(shape {tuple(shape)}); pick a block size dividing {shape[-1]}{hint}")


def quantize_nf4(w: torch.Tensor, block: int = DEFAULT_BLOCK):
    """``w`` as an ``NF4Tensor`` (dequantizes to ``w.dtype``)."""
    n_blocks = w.numel() // block
    return torchao_nf4().to_nf4(w.contiguous(), block_size=block, scaler_block_size=scaler_block(n_blocks))
