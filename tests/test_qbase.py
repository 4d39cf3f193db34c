"""LoRA on a quantized frozen base (``--quantize-base nf4|fp8``) equals PEFT on the same quantized model.

The oracle is one process: transformers' ``from_pretrained`` model whose decoder-layer linears
hold the same quantized weights (torchao's ``NF4Tensor`` of the same block sizes; block-FP8
codes and scales of the same tiles, or, for a checkpoint that ships FP8, transformers' own FP8
dequantization at load), under PEFT's ``get_peft_model``, trained as
:mod:`test_lora_equivalence` trains it. Loss and grad norm per step, and every adapter after 3
steps, agree within 1e-5; so do logits and adapter gradients of one batch.

The default run takes a slice (NF4 at pp 2 with 1F1B and a V schedule; a checkpoint's own FP8
at pp 2 interleaved; :mod:`test_qbase_export` adds FP8 quantized at load); ``pytest -m slow`` runs
every schedule at pp 2 and pp 3 for both kinds, dp 2 (FSDP2) alone and with pp 2, and bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import tiny_checkpoint
from test_lora_equivalence import BF16_TOL, hf_model, run_and_check
from test_train_equivalence import ALL_SCHEDULES, LAYERS

pytest.importorskip("torchao", reason="--quantize-base nf4 needs torchao (pip install 'hfpipe[qlora]')")

FP8_BLOCK = 32  # tiles of 32 x 32: every tiny weight holds several, and transformers' dequantizer takes them


def quantized_hf_model(kind: str, block: int | None = None):
    """A ``build`` for the oracle: ``from_pretrained``, then the same quantization as the pipeline's."""

    def build(path: str, dtype: torch.dtype):
        from hfpipe.quant.fp8 import FP8Linear, quantize_blocks
        from hfpipe.quant.linear import quantized_linears
        from hfpipe.quant.nf4 import DEFAULT_BLOCK, quantize_nf4

        model = hf_model(path, dtype)
        with torch.no_grad():
            for name, linear in quantized_linears(model).items():
                if kind == "nf4":
                    q = quantize_nf4(linear.weight.detach(), block or DEFAULT_BLOCK)
                    linear.weight = nn.Parameter(q, requires_grad=False)
                    continue
                new = FP8Linear(linear.in_features, linear.out_features, block, compute_dtype=dtype)
                new.weight, new.weight_scale_inv = quantize_blocks(linear.weight.detach(), block)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, new)
        return model

    return build


def fp8_checkpoint() -> str:
    """A block-FP8 copy of the tiny Llama (fp32 elsewhere), as DeepSeek-V3 ships its weights."""
    import tempfile

    from hfpipe.tiny import make_fp8_checkpoint

    base = tiny_checkpoint("llama", num_hidden_layers=LAYERS)
    return str(make_fp8_checkpoint(base, tempfile.mkdtemp(prefix="hfpipe-fp8-"), FP8_BLOCK, dtype=None))


def transformers_fp8(path: str, dtype: torch.dtype):
    """transformers' own reading of an FP8 checkpoint: dequantized at load (its CPU path)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                quantization_config=FineGrainedFP8Config(dequantize=True))


NF4 = {"quantize_base": "nf4"}
FP8 = {"quantize_base": "fp8", "quantize_block_size": FP8_BLOCK}


def test_nf4_pp2_matches_peft_on_the_same_nf4_model():
    run_and_check("llama", 2, ("1f1b", "zbv"), options=NF4, build=quantized_hf_model("nf4"))


def test_fp8_checkpoint_kept_as_stored_pp2_matches_transformers_dequantized():
    run_and_check("llama", 2, ("interleaved-1f1b",), options={"quantize_base": "fp8"},
                  build=transformers_fp8, path=fp8_checkpoint())


@pytest.mark.slow
def test_nf4_dp2_fsdp2_equals_one_process():
    """accelerate#3983 reports FSDP2 silently corrupting training on bitsandbytes' Params4bit:
    torchao's NF4Tensor shards over dp and trains exactly as one process."""
    run_and_check("llama", 1, ("1f1b",), dp=2, options=NF4, build=quantized_hf_model("nf4"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_dp2_x_pp2_matches_peft(kind):
    options = NF4 if kind == "nf4" else FP8
    run_and_check("llama", 2, ("1f1b", "interleaved-1f1b"), dp=2, options=options,
                  build=quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
@pytest.mark.parametrize("pp", [2, 3])
def test_every_schedule(kind, pp):
    options = NF4 if kind == "nf4" else FP8
    run_and_check("llama", pp, ALL_SCHEDULES, options=options,
                  build=quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None))


@pytest.mark.slow
def test_fp8_checkpoint_every_schedule_pp3():
    run_and_check("llama", 3, ALL_SCHEDULES, options={"quantize_base": "fp8"}, build=transformers_fp8,
                  path=fp8_checkpoint())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_bf16_run_keeps_the_base_quantized_and_matches_peft_in_bf16(kind):
    options = NF4 if kind == "nf4" else FP8
    run_and_check("llama", 2, ("1f1b",), options={**options, "dtype": "bf16"}, dtype=torch.bfloat16, tol=BF16_TOL,
                  build=quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None))
