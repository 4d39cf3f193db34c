"""The issue's bar for ``--quantize-base``, run as a user runs it (the ``hfpipe`` command).

A tiny untied Llama, LoRA rank 8, ``--quantize-base nf4`` and then ``fp8``: 3 steps at ``--pp 2``
equal the same flags at ``--pp 1`` (losses and grad norms within 1e-5), the checkpoint is less
than half the base's size, and ``hfpipe export`` gives an adapter folder PEFT loads. Both run in the
slow suite (about a minute each of process starts); the default run covers the same path in
process-level tests (test_quant_lora_base.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import tiny_checkpoint
from test_cli_e2e import hfpipe

pytest.importorskip("torchao", reason="--quantize-base nf4 needs torchao (pip install 'hfpipe[qlora]')")

# wide enough that rank-8 adapters and their AdamW state are small beside the base, as on real models
WIDE = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512)


def _finetune(model: Path, pp: int, kind: str, cwd: Path) -> tuple[list[dict], Path]:
    out = f"out-{kind}-pp{pp}"
    run = hfpipe("finetune", model, "--pp", pp, "--max-steps", 3, "--seq-len", 32, "--batch-size", 4,
                 "--microbatches", 2, "--lr", 3e-3, "--lora-rank", 8, "--quantize-base", kind,
                 "--output-dir", out, "--save-every", 3, cwd=cwd, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (cwd / out / "metrics.jsonl").read_text().splitlines()]
    (ckpt,) = sorted((cwd / out / "checkpoints").glob("step-*"))
    return rows, ckpt


def _size(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


def check_issue_bar(kind: str, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", **WIDE)
    rows1, _ = _finetune(model, 1, kind, tmp_path)
    rows2, ckpt = _finetune(model, 2, kind, tmp_path)
    assert [r["step"] for r in rows2] == [1, 2, 3]
    for what in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[what] for r in rows2]), torch.tensor([r[what] for r in rows1]),
                                   atol=1e-5, rtol=0, msg=lambda m: f"{kind} {what} pp2 vs pp1: {m}")
    base = _size(model, "*.safetensors")
    assert _size(ckpt) < base / 2, (_size(ckpt), base)
    meta = json.loads((ckpt / "hfpipe.json").read_text())
    assert meta["quantize_base"]["kind"] == kind
    run = hfpipe("export", ckpt, tmp_path / f"adapter-{kind}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), tmp_path / f"adapter-{kind}")
    lora = {n: p for n, p in peft.named_parameters() if ".lora_B." in n}
    assert lora and any(p.abs().max() > 0 for p in lora.values()), "trained adapters were loaded"


@pytest.mark.slow
def test_nf4_pp2_equals_pp1_small_checkpoint_and_peft_loads_the_adapter(tmp_path):
    check_issue_bar("nf4", tmp_path)


@pytest.mark.slow
def test_fp8_pp2_equals_pp1_small_checkpoint_and_peft_loads_the_adapter(tmp_path):
    check_issue_bar("fp8", tmp_path)


@pytest.mark.slow
def test_fp8_moe_pp2_dp2_ep2_equals_pp1_and_peft_loads_the_adapter(tmp_path):
    """DeepSeek-V3's own FP8 (routed experts included, kept as codes on their ranks): ``--pp 2 --dp 2
    --ep 2 --batch-size 2`` against ``--pp 1 --batch-size 4``, LoRA on attention."""
    from test_quant_lora_base import transformers_fp8
    from test_quant_experts import fp8_moe_checkpoint

    model = Path(fp8_moe_checkpoint())
    flags = ("--max-steps", 3, "--seq-len", 32, "--microbatches", 2, "--lr", 3e-3, "--lora-rank", 8,
             "--quantize-base", "fp8", "--lora-targets", "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj",
             "--save-every", 3)
    runs = {}
    for name, mesh in (("one", ("--pp", 1, "--batch-size", 4)),
                       ("ep", ("--pp", 2, "--dp", 2, "--ep", 2, "--batch-size", 2))):
        run = hfpipe("finetune", model, *mesh, *flags, "--output-dir", f"out-{name}", cwd=tmp_path, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (tmp_path / f"out-{name}" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs["ep"]] == [1, 2, 3]
    for what in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[what] for r in runs["ep"]]),
                                   torch.tensor([r[what] for r in runs["one"]]), atol=1e-5, rtol=0,
                                   msg=lambda m: f"{what} ep vs pp1: {m}")
    (ckpt,) = sorted((tmp_path / "out-ep" / "checkpoints").glob("step-*"))
    run = hfpipe("export", ckpt, tmp_path / "adapter", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    from peft import PeftModel

    peft = PeftModel.from_pretrained(transformers_fp8(str(model), torch.float32), tmp_path / "adapter")
    lora = {n: p for n, p in peft.named_parameters() if ".lora_B." in n}
    assert lora and any(p.abs().max() > 0 for p in lora.values()), "trained adapters were loaded"
