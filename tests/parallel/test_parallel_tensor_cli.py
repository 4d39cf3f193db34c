"""The issue's bar for ``--tp``, run as a user runs it (the ``hfpipe`` command).

A tiny Llama, 3 steps at ``--pp 2 --tp 2`` (four processes, sequence parallel) equal the same flags at
``--pp 1`` (losses and grad norms within 1e-5), and ``hfpipe export`` of the tp-split checkpoint
writes whole tensors under the source's keys, which ``from_pretrained`` loads. Slow (process starts);
the default run covers the same path in process-level tests (test_parallel_tensor_pipeline.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _dist import FP32_ULP, GRAD_ULPS, tiny_checkpoint
from test_cli_e2e import hfpipe


def _finetune(model: Path, cwd: Path, *mesh, steps: int = 3, out: str | None = None, resume: bool = False,
              batch: int = 4):
    """``hfpipe finetune`` for ``steps`` steps (constant lr, so a resume continues the same run);
    (metrics rows, the last checkpoint). ``mesh`` holds any other flags too (``--lora-rank``); ``batch``
    rows per replica."""
    out = out or "out-" + "-".join(map(str, mesh)).replace("--", "")
    run = hfpipe("finetune", model, *mesh, "--max-steps", steps, "--seq-len", 32, "--batch-size", batch,
                 "--microbatches", 2, "--lr", 3e-3, "--lr-schedule", "constant", "--output-dir", out,
                 "--save-every", steps, *(["--resume", "auto"] if resume else []), cwd=cwd, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (cwd / out / "metrics.jsonl").read_text().splitlines()]
    return rows, sorted((cwd / out / "checkpoints").glob("step-*"))[-1]


@pytest.mark.slow
def test_pp2_x_tp2_equals_pp1_and_exports_the_source_keys(tmp_path):
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    rows1, _ = _finetune(model, tmp_path, "--pp", 1)
    rows2, ckpt = _finetune(model, tmp_path, "--pp", 2, "--tp", 2)
    assert [r["step"] for r in rows2] == [1, 2, 3]
    for what in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[what] for r in rows2]), torch.tensor([r[what] for r in rows1]),
                                   atol=1e-5, rtol=0, msg=lambda m: f"{what} pp2 x tp2 vs pp1: {m}")
    assert json.loads((ckpt / "hfpipe.json").read_text())["world"]["tp"] == 2
    run = hfpipe("export", ckpt, tmp_path / "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    source = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(source)
    assert all(exported[k].shape == source[k].shape for k in source)  # whole tensors, not a rank's slice
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_run_saved_at_tp2_resumes_at_tp1_equal_to_the_uninterrupted_run(tmp_path, kind):
    """DCP keeps tp-split tensors under their full names and shapes: the checkpoint reshards to tp 1. A MoE's
    packed gate/up expert stacks are split in two strided runs of rows (transformers' packed colwise),
    which DCP cannot write as they are: hfpipe.checkpoint.strided hands it a contiguous split instead."""
    model = tiny_checkpoint(kind, num_hidden_layers=4)
    whole, _ = _finetune(model, tmp_path, "--pp", 1, steps=4)
    _finetune(model, tmp_path, "--pp", 2, "--tp", 2, steps=2, out="resumed")
    rows, _ = _finetune(model, tmp_path, "--pp", 1, steps=4, out="resumed", resume=True)
    resumed = {r["step"]: r for r in rows if "loss" in r}
    for step in (3, 4):
        for what in ("loss", "grad_norm"):
            # A grad norm sums every gradient's square: each gradient may move by reordered sums (GRAD_ULPS fp32
            # ulps of its size, tests/_dist.py), so the norm by as many ulps of itself (8.55 on the MoE: 6.5e-5).
            allowed = max(1e-5, GRAD_ULPS * FP32_ULP * abs(whole[step - 1][what])) if what == "grad_norm" else 1e-5
            assert abs(resumed[step][what] - whole[step - 1][what]) <= allowed, (step, what, resumed[step],
                                                                                  whole[step - 1])


def _same_rows(got: list[dict], want: list[dict], what: str) -> None:
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]),
                                   atol=1e-5, rtol=0, msg=lambda m: f"{key} {what}: {m}")


@pytest.mark.slow
def test_lora_at_pp2_x_tp2_equals_pp1_and_exports_whole_adapters_under_peft_keys(tmp_path):
    """``--lora-rank`` with ``--tp``: tp-split adapters train as at tp 1, and the exported adapter folder is
    PEFT's (its keys, whole tensors), which ``PeftModel.from_pretrained`` loads onto the base."""
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    lora = ("--lora-rank", 4, "--lora-targets", "all-linear")
    rows1, ckpt1 = _finetune(model, tmp_path, "--pp", 1, *lora)
    rows2, ckpt2 = _finetune(model, tmp_path, "--pp", 2, "--tp", 2, *lora)
    _same_rows(rows2, rows1, "LoRA pp2 x tp2 vs pp1")
    for ckpt, name in ((ckpt1, "tp1"), (ckpt2, "tp2")):
        run = hfpipe("export", ckpt, tmp_path / name, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = (load_file(tmp_path / n / "adapter_model.safetensors") for n in ("tp1", "tp2"))
    assert sorted(two) == sorted(one) and all(k.startswith("base_model.model.model.layers.") for k in two)
    assert all(two[k].shape == one[k].shape for k in one)  # whole tensors, not a rank's part
    # (their values after 3 steps are held to PEFT's in tests/lora/test_lora_tensor.py, with AdamW's drift)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), tmp_path / "tp2")
    loaded = {k.replace(".default", ""): v for k, v in peft.state_dict().items() if ".lora_" in k}
    assert sorted(loaded) == sorted(two) and all(torch.equal(loaded[k], two[k]) for k in two)


@pytest.mark.slow
@pytest.mark.parametrize("dp, later", [(1, ("--pp", 4, "--schedule", "gpipe")), (2, ("--pp", 2))],
                         ids=["tp2-pp2-to-tp1-pp4", "dp2-tp2-to-dp2-pp2-tp1"])
def test_a_tp2_checkpoint_resumes_at_tp1_on_another_pp_and_dp_mesh_equal_to_the_uninterrupted_run(tmp_path, dp, later):
    """DCP reshards the tp-split weights and their AdamW state by name: a pp 2 x tp 2 checkpoint resumes at
    tp 1 on 4 stages; a dp 2 x tp 2 one (FSDP2 shards of tp-split tensors, 2-D) at dp 2 x pp 2 x tp 1 (1-D
    FSDP2 shards). Steps 3-4 equal the uninterrupted run's. (--dp itself must match: with --batch-size it
    defines the data stream, hfpipe.train.resume_check.MUST_MATCH.)"""
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    whole, _ = _finetune(model, tmp_path, "--pp", 1, "--dp", dp, steps=4)
    _finetune(model, tmp_path, "--pp", 3 - dp, "--dp", dp, "--tp", 2, steps=2, out="resumed")
    rows, _ = _finetune(model, tmp_path, *later, "--dp", dp, steps=4, out="resumed", resume=True)
    resumed = [r for r in rows if "loss" in r and r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    _same_rows(resumed, [r for r in whole if "loss" in r and r["step"] > 2], f"resumed at {later} vs uninterrupted")


@pytest.mark.slow
def test_dp2_x_ep2_x_tp2_moe_equals_pp1_and_exports_the_source_keys(tmp_path):
    """``--tp`` with ``--ep`` through the command: Qwen3-MoE's experts whole on each tp rank, sharded over ep.
    ``--batch-size`` is per replica: 2 rows on each of dp 2 against 4 at dp 1."""
    model = tiny_checkpoint("qwen3_moe", num_hidden_layers=4)
    rows1, _ = _finetune(model, tmp_path, "--pp", 1)
    rows2, ckpt = _finetune(model, tmp_path, "--pp", 1, "--dp", 2, "--ep", 2, "--tp", 2, batch=2)
    _same_rows(rows2, rows1, "dp2 x ep2 x tp2 vs pp1")
    world = json.loads((ckpt / "hfpipe.json").read_text())["world"]
    assert (world["tp"], world["ep"], world["dp"]) == (2, 2, 2)
    run = hfpipe("export", ckpt, tmp_path / "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    source = {k: v.shape for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = {k: v.shape for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported == source  # per-expert keys, whole tensors
