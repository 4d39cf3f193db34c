"""The base weights a quantized-base LoRA run trained on, and the dtypes a merged export writes.

``hfpipe export --merge`` of such a run merges the adapters into the base *as the run saw it*:
each quantized linear's weight (and each routed expert's matrix) goes through the same
quantization the loader applied (NF4 codes of the same blocks, FP8 tiles kept as stored or
quantized at load) and is dequantized to fp32 before PEFT's ``merge()`` adds the adapter delta.
The merged folder is then written:

- in bf16 (``--dtype auto``/``bf16``): the dequantized base plus the adapters, rounded once;
- in a float dtype the user names (``--dtype fp16``/``fp32``/``fp64``), of any base: merged in the wider of the
  base's dtype and that one, so a wider dtype gets PEFT's ``merge_and_unload()`` of the base loaded in it
  (``--dtype fp64``: the base widened exactly, the delta added in fp64), a narrower one a single rounding;
- in the FP8 block format (``--dtype fp8``): every linear the run quantized (and every routed
  expert's 2-D weight), requantized per ``block x block`` tile with a ``weight_scale_inv``, and
  config.json's ``quantization_config`` saying so, as DeepSeek-V3 ships (transformers loads it).

Either way the merged model differs from training by rounding: training ran ``dequant(Q(W)) x +
B A x`` with the adapters in fp32, the folder holds ``round(dequant(Q(W)) + B A)``.
"""

from __future__ import annotations

import torch

from hfpipe.quant.experts import fused_experts, routed_expert_key, split_seam
from hfpipe.quant.fp8 import FP8_DEFAULT_BLOCK, dequantize_blocks, is_fp8, quantize_blocks
from hfpipe.quant.nf4 import DEFAULT_BLOCK, QuantError, quantize_nf4
from hfpipe.models.targets import quantized_linears

__all__ = ["MergedBase", "MERGE_DTYPES"]

#: ``--dtype`` of a merged export: auto (the base's dtypes; bf16 for a quantized base), a float dtype, fp8.
MERGE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp64", "fp8")
_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_SCALE = "_scale_inv"
_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}


class MergedBase:
    """Turns a base checkpoint's shard into the weights a run trained on, and back into output dtypes.

    Args:
        cfg_json: The base's config.json (its ``quantization_config``, if any).
        meta_model: The full model on the meta device (which linears are quantized).
        quant: ``hfpipe.json``'s ``quantize_base`` (kind, block, dtype), or ``None``.
        dtype: ``--dtype`` of the export (one of :data:`MERGE_DTYPES`).
    """

    def __init__(self, cfg_json: dict, meta_model, quant: dict | None, dtype: str) -> None:
        qc = cfg_json.get("quantization_config") or None
        if qc and qc.get("quant_method") != "fp8":
            raise QuantError(f"--merge: base quantization {qc.get('quant_method')!r} is not supported "
                             "(block-FP8 is); export the adapter instead")
        if dtype not in MERGE_DTYPES:
            raise QuantError(f"--dtype {dtype} does not apply to --merge of a LoRA checkpoint; "
                             f"choose one of {', '.join(MERGE_DTYPES)}")
        self.source_block = int((qc.get("weight_block_size") or [FP8_DEFAULT_BLOCK])[0]) if qc else None
        self.quant = quant
        self.linears = {name + ".weight" for name in quantized_linears(meta_model)}
        self.split_stacks = {f"{name}.gate_up_proj" for name, m in fused_experts(meta_model).items()
                             if split_seam(m, "gate_up_proj")}
        self.fp8_out = dtype == "fp8"
        quantized = dtype == "auto" and (quant is not None or qc is not None)
        self.out_dtype = torch.bfloat16 if quantized else _FLOATS.get(dtype)  # the floats written (not fp8's)
        self.changes = self.fp8_out or self.out_dtype is not None  # else the plain merge: the base's files, keys, dtypes
        kind_block = quant.get("block") if quant and quant.get("kind") == "fp8" else None
        self.out_block = kind_block or self.source_block or FP8_DEFAULT_BLOCK

    def as_trained(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shard's tensors as the run saw them: FP8 dequantized (scales dropped), the run's
        quantized linears round-tripped through its quantization, in fp32; widened to a wider ``--dtype``
        (the merge then runs in it)."""
        out = {}
        for key, t in tensors.items():
            if key.endswith(_SCALE):
                continue
            if is_fp8(t):
                if key + _SCALE not in tensors:
                    raise QuantError(f"--merge: FP8 weight {key!r} has no {key + _SCALE!r} in the checkpoint; "
                                     "the base checkpoint is incomplete")
                t = dequantize_blocks(t, tensors[key + _SCALE], self.source_block)
            if self.quant and (key in self.linears or self._quantized_expert(key)):
                t = self._round_trip_stack(key, t, is_fp8(tensors[key])) if t.dim() == 3 else \
                    self._round_trip(t, is_fp8(tensors[key]))
            out[key] = self._widened(t)
        return out

    def _widened(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the export's float dtype where that is wider (exact); else as it is (rounded once, at the end)."""
        wider = self.out_dtype is not None and t.is_floating_point() and t.dtype.itemsize < self.out_dtype.itemsize
        return t.to(self.out_dtype) if wider else t

    def _quantized_expert(self, key: str) -> bool:
        """A routed expert's weight (kept quantized by the run)."""
        return routed_expert_key(key)

    def _round_trip_stack(self, key: str, t: torch.Tensor, stored_fp8: bool) -> torch.Tensor:
        """A fused-layout checkpoint's 3-D stack, one expert at a time (NF4: gate and up apart, as loaded)."""
        halves = 2 if self.quant["kind"] == "nf4" and key in self.split_stacks else 1
        return torch.stack([torch.cat([self._round_trip(h, stored_fp8) for h in w.chunk(halves)]) for w in t])

    def _round_trip(self, w: torch.Tensor, stored_fp8: bool) -> torch.Tensor:
        kind, block = self.quant["kind"], self.quant.get("block")
        dtype = getattr(torch, self.quant.get("dtype", "float32"))
        if kind == "fp8" and stored_fp8:
            return w  # kept as stored: already the dequantized checkpoint values
        w = w.to(dtype)  # what the loader quantized: the tensor cast to the run's parameter dtype
        if kind == "nf4":
            return quantize_nf4(w, block or DEFAULT_BLOCK).get_original_weight().float()
        q, s = quantize_blocks(w, block or FP8_DEFAULT_BLOCK)
        return dequantize_blocks(q, s, block or FP8_DEFAULT_BLOCK)

    def output(self, tensors: dict[str, torch.Tensor], source_dtypes: dict) -> dict[str, torch.Tensor]:
        """Merged tensors in the export's dtypes (FP8 linears gain their ``weight_scale_inv``).

        Floating tensors take the export's float dtype (bf16 beside FP8), but those an FP8 checkpoint
        stores in fp32 (DeepSeek's router bias) stay fp32 in a narrower one, as it ships them.
        """
        out, dtype = {}, self.out_dtype or torch.bfloat16
        for key, t in tensors.items():
            if self.fp8_out and (key in self.linears or (routed_expert_key(key) and t.dim() == 2)):
                out[key], out[key + _SCALE] = quantize_blocks(t, self.out_block)
            elif t.is_floating_point() and not (self.source_block and source_dtypes.get(key) == torch.float32
                                                and dtype.itemsize < 4):
                out[key] = t.to(dtype)
            else:
                out[key] = t
        return out

    def config_json(self, cfg_json: dict) -> dict:
        """config.json of the merged folder: FP8's ``quantization_config`` only when writing FP8."""
        cfg = dict(cfg_json)
        cfg.pop("quantization_config", None)
        if self.fp8_out:
            cfg["quantization_config"] = {**_FP8_CONFIG, "weight_block_size": [self.out_block, self.out_block]}
        if self.changes:
            cfg["dtype"] = str(self.out_dtype or torch.bfloat16).removeprefix("torch.")
        return cfg
