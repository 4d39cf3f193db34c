"""Checkpoints and exports of a quantized-base LoRA run (``--quantize-base nf4|fp8``).

In the slow suite (three exports and four model loads each). A pp-2 run trains 3 steps and
saves; its checkpoint holds the adapters (and AdamW state) only.
``hfpipe export`` gives a PEFT adapter: PEFT on the same quantized model reproduces the
pipeline's logits within 1e-5. ``--merge`` gives a bf16 folder, ``--merge --dtype fp8`` a
block-FP8 folder; transformers loads both, their merged weights are exactly ``dequant(Q(W)) +
scale * B @ A`` rounded once, and their logits differ from the training model's by that rounding
only (the measured differences are printed, and quoted in the README).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_lora_equivalence import LORA, lora_config, start_adapters
from test_quant_lora_base import FP8_BLOCK, quantized_hf_model
from test_train_equivalence import _optimizer, make_batches

pytest.importorskip("torchao", reason="--quantize-base nf4 needs torchao (pip install 'hfpipe[qlora]')")

LAYERS = 4


def train_and_save(path: str, root: str, options: dict, kw: dict = LORA) -> dict:
    """3 LoRA steps at pp 2, then a checkpoint and the logits of the first batch (loss rank)."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(2, 1)
    pm = load_pipeline(path, pp=2, dp=1, schedule="1f1b", microbatches=4, dist=dist, lora=lora_config(kw), **options)
    start_adapters(pm)
    opt, sched = _optimizer(pm.named_parameters())
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=1.0)
    batches = make_batches(pm.source.config.vocab_size)
    for shards in batches:
        trainer.step(shards[0])
    ckpt = pm.save_checkpoint(root, 3, opt)
    logits = pm.forward(batches[0][0])
    return {"ckpt": str(ckpt), "logits": None if logits is None else logits.detach().clone()}


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()


def _run(kind: str, tmp_path: Path):
    path = str(tiny_checkpoint("llama", num_hidden_layers=LAYERS))
    options = {"quantize_base": kind, **({"quantize_block_size": FP8_BLOCK} if kind == "fp8" else {})}
    ranks = run_ranks(train_and_save, 2, path, str(tmp_path / "ckpts"), options)
    logits = next(r["logits"] for r in ranks.values() if r["logits"] is not None)
    return path, Path(ranks[0]["ckpt"]), logits


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_adapter_export_and_merges_of_a_quantized_run(kind, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hfpipe.export.hf_folder import export_checkpoint

    path, ckpt, trained = _run(kind, tmp_path)
    assert json.loads((ckpt / "hfpipe.json").read_text())["quantize_base"] == {
        "kind": kind, "block": FP8_BLOCK if kind == "fp8" else None, "dtype": "float32"}
    from transformers import AutoConfig

    batch = make_batches(AutoConfig.from_pretrained(path).vocab_size)[0][0]

    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    build = quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None)
    peft = PeftModel.from_pretrained(build(path, torch.float32), adapter).eval()
    torch.testing.assert_close(_logits(peft, batch), trained, atol=1e-5, rtol=0)

    bf16 = export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    _check_merged_weights(merged, peft)
    d_bf16 = (_logits(merged, batch) - trained).abs().max().item()

    fp8 = export_checkpoint(ckpt, tmp_path / "merged-fp8", merge=True, dtype="fp8")
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [FP8_BLOCK if kind == "fp8" else 128] * 2
    reloaded = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).float()  # CPU: dequantized at load
    d_fp8 = (_logits(reloaded, batch) - trained).abs().max().item()
    # the same adapters on the unquantized base: what the quantization itself changes
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter)
    d_base = (_logits(plain.eval(), batch) - trained).abs().max().item()
    with capsys.disabled():
        print(f"\n{kind}: logits of the merged bf16 folder differ from training by {d_bf16:.2e}, of the merged "
              f"fp8 folder by {d_fp8:.2e}, of the adapters on the unquantized base by {d_base:.2e} "
              f"(largest logit {trained.abs().max().item():.2f})")
    assert 0 < d_bf16 < 5e-2 and 0 < d_fp8 < 0.5


def _check_merged_weights(merged, peft) -> None:
    """Every quantized linear of the bf16 folder is PEFT's ``dequant(Q(W)) + delta`` rounded once."""
    from hfpipe.quant.linear import quantized_linears

    layers = dict(peft.base_model.model.named_modules())
    names = quantized_linears(merged)
    assert names
    for name in names:
        base = layers[name].get_base_layer()
        w = base.dequantized(torch.float32) if hasattr(base, "dequantized") else base.weight.get_original_weight()
        want = (w + layers[name].get_delta_weight("default")).to(torch.bfloat16).float()
        torch.testing.assert_close(merged.get_submodule(name).weight, want, atol=0, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
