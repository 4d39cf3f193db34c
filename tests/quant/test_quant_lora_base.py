"""LoRA on a quantized frozen base (``--quantize-base nf4|fp8``) equals PEFT on the same quantized model.

The oracle is one process: transformers' ``from_pretrained`` model whose decoder-layer linears
hold the same quantized weights (torchao's ``NF4Tensor`` of the same block sizes; block-FP8
codes and scales of the same tiles, or, for a checkpoint that ships FP8, transformers' own FP8
dequantization at load), under PEFT's ``get_peft_model``, trained as
:mod:`test_lora_equivalence` trains it. Loss and grad norm per step, and every adapter after 3
steps, agree within 1e-5; so do logits and adapter gradients of one batch.

The default run takes a slice (NF4 quantized at load, and a checkpoint's own FP8 kept as stored,
each at pp 2 with 1F1B on a 4-layer model); ``pytest -m slow`` runs every schedule at pp 2 and
pp 3 for both kinds (8 layers), dp 2 (FSDP2) alone and with pp 2, and bf16.
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


def quantized_hf_model(kind: str, block: int | None = None, float8: bool = False):
    """A ``build`` for the oracle: ``from_pretrained``, then the same quantization as the pipeline's
    (``float8``: the FP8 linears multiply their codes in float8, as ``fp8="blockwise"`` has them)."""

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
                new = FP8Linear(linear.in_features, linear.out_features, block, bias=linear.bias is not None,
                                compute_dtype=dtype)
                new.weight, new.weight_scale_inv = quantize_blocks(linear.weight.detach(), block)
                new.float8 = float8
                if linear.bias is not None:
                    new.bias = linear.bias
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, new)
        return model

    return build


def fp8_checkpoint(layers: int = LAYERS) -> str:
    """A block-FP8 copy of the tiny Llama (fp32 elsewhere), as DeepSeek-V3 ships its weights."""
    import tempfile

    from hfpipe.tiny import make_fp8_checkpoint

    base = tiny_checkpoint("llama", num_hidden_layers=layers)
    return str(make_fp8_checkpoint(base, tempfile.mkdtemp(prefix="hfpipe-fp8-"), FP8_BLOCK, dtype=None))


def transformers_fp8(path: str, dtype: torch.dtype):
    """transformers' own reading of an FP8 checkpoint: dequantized at load (its CPU path)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                quantization_config=FineGrainedFP8Config(dequantize=True))


NF4 = {"quantize_base": "nf4"}
FP8 = {"quantize_base": "fp8", "quantize_block_size": FP8_BLOCK}


SMALL = 4  # layers of the default run's models (the slow matrix uses LAYERS)


def test_nf4_pp2_matches_peft_on_the_same_nf4_model():
    run_and_check("llama", 2, ("1f1b",), options=NF4, build=quantized_hf_model("nf4"),
                  path=str(tiny_checkpoint("llama", num_hidden_layers=SMALL)))


def test_fp8_checkpoint_kept_as_stored_pp2_matches_transformers_dequantized():
    run_and_check("llama", 2, ("1f1b",), options={"quantize_base": "fp8"}, build=transformers_fp8,
                  path=fp8_checkpoint(SMALL))


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
def test_fp8_checkpoint_every_schedule_pp3():  # kept as stored, against transformers' own dequantization
    run_and_check("llama", 3, ALL_SCHEDULES, options={"quantize_base": "fp8"}, build=transformers_fp8,
                  path=fp8_checkpoint())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_bf16_run_keeps_the_base_quantized_and_matches_peft_in_bf16(kind):
    options = NF4 if kind == "nf4" else FP8
    # bf16 is rounding, not exactness (the fp32 tests are): 1-row microbatches round unlike one
    # 8-row batch; over an FP8 base the grad norm differed by 2.0e-3 (0.25%, under bf16's 0.4% step).
    run_and_check("llama", 2, ("1f1b",), options={**options, "dtype": "bf16"}, dtype=torch.bfloat16,
                  tol=2.5 * BF16_TOL, build=quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None))


def test_fp8_blocks_are_the_checkpoint_format_and_dequantize_as_transformers_does():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from hfpipe.quant.fp8 import dequantize_blocks, quantize_blocks
    from hfpipe.tiny import _quantize_blocks

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    q, s = quantize_blocks(w, 32)
    q_tiny, s_tiny = _quantize_blocks(w, 32)  # how the FP8 test checkpoints are written
    assert torch.equal(q.view(torch.uint8), q_tiny.view(torch.uint8)) and torch.equal(s, s_tiny)
    assert s.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(dequantize_blocks(q, s, 32), Fp8Dequantize(None)._dequantize_one(q, s, torch.float32),
                               atol=0, rtol=0)
    assert 0 < (dequantize_blocks(q, s, 32) - w).abs().max() < 0.07 * w.abs().max()


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_backward_keeps_only_the_quantized_weight(kind):
    """Just in time: what autograd saves for backward holds no full-precision copy of the weight."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    from hfpipe.quant.fp8 import FP8Linear, quantize_blocks
    from hfpipe.quant.nf4 import quantize_nf4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 64, generator=g)
    root = nn.Module()
    root.norm = nn.LayerNorm(64)  # PEFT reads the device from a parameter; an FP8 linear holds buffers only
    if kind == "nf4":
        root.proj = nn.Linear(64, 128, bias=False)
        root.proj.weight = nn.Parameter(quantize_nf4(w), requires_grad=False)
        dense = root.proj.weight.get_original_weight()
    else:
        root.proj = FP8Linear(64, 128, 32)
        root.proj.weight, root.proj.weight_scale_inv = quantize_blocks(w, 32)
        dense = root.proj.dequantized()
    LoraModel(root, LoraConfig(r=4, target_modules=["proj"]), "default")
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = root.proj(x)
    full_size = [t for t in saved if t.is_floating_point() and t.numel() >= w.numel() and type(t) is torch.Tensor
                 and t.dtype in (torch.float32, torch.bfloat16)]
    assert not full_size, [(t.dtype, tuple(t.shape)) for t in full_size]
    y.sum().backward()
    torch.testing.assert_close(y, x @ dense.T, atol=1e-6, rtol=0)  # lora_B starts at zero
    torch.testing.assert_close(x.grad, torch.ones(3, 128) @ dense, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_deepseek_v3_attention_experts_and_shared_experts_nf4_pp2():
    """MoE: attention, dense and shared-expert linears and the fused routed experts (adapted through
    PEFT's target_parameters) quantized; the router stays in the run's dtype."""
    from test_lora_equivalence import DSV3_LORA
    from test_quant_experts import quantized_moe_model

    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_LORA, options={"quantize_base": "nf4", "quantize_block_size": 16},
                  build=quantized_moe_model(16, "nf4"))


def _nf4_losses(path: str) -> dict:
    """Three steps of an NF4 base's LoRA in fp32 and in bf16-mixed, at pp 1 (a spawned rank: its own world)."""
    from peft import LoraConfig

    from hfpipe.api import load_pipeline
    from hfpipe.train.optim import build_optimizer

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 100, (2, 16), generator=g) for _ in range(3)]
    losses = {}
    for dtype in ("fp32", "bf16-mixed"):
        pm = load_pipeline(path, pp=1, dtype=dtype, quantize_base="nf4",
                           lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-3), max_grad_norm=1.0)
        losses[dtype] = [trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).loss
                         for ids in batches]
    return losses


def test_nf4_base_under_bf16_mixed_on_one_rank_trains_as_its_fp32_run():
    """bf16-mixed at --dp 1 runs FSDP2 on a one-rank mesh for its casts, whose shortcut cannot gather an NF4
    tensor (torch 2.13): the frozen base is left out of it there (hfpipe.parallel.fsdp) and trains; its losses
    track the fp32 run of the same NF4 base as bf16 tracks fp32 (tests/pipeline/test_pipeline_precision.py)."""
    from _dist import run_ranks

    losses = run_ranks(_nf4_losses, 1, str(tiny_checkpoint("llama", num_hidden_layers=2)))[0]
    fp32, mixed = torch.tensor(losses["fp32"]), torch.tensor(losses["bf16-mixed"])
    assert not torch.equal(mixed, fp32), "bf16-mixed must really compute in bf16"
    torch.testing.assert_close(mixed, fp32, atol=5e-2, rtol=0)
