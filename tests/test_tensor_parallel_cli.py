"""The issue's bar for ``--tp``, run as a user runs it (the ``hfpipe`` command).

A tiny Llama, 3 steps at ``--pp 2 --tp 2`` (four processes, sequence parallel) equal the same flags at
``--pp 1`` (losses and grad norms within 1e-5), and ``hfpipe export`` of the tp-split checkpoint
writes whole tensors under the source's keys, which ``from_pretrained`` loads. Slow (process starts);
the default run covers the same path in process-level tests (test_tensor_parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _dist import tiny_checkpoint
from test_e2e import hfpipe


def _finetune(model: Path, cwd: Path, *mesh, steps: int = 3, out: str | None = None, resume: bool = False):
    """``hfpipe finetune`` for ``steps`` steps (constant lr, so a resume continues the same run);
    (metrics rows, the last checkpoint)."""
    out = out or "out-" + "-".join(map(str, mesh))
    run = hfpipe("finetune", model, *mesh, "--max-steps", steps, "--seq-len", 32, "--batch-size", 4,
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
def test_a_run_saved_at_tp2_resumes_at_tp1_equal_to_the_uninterrupted_run(tmp_path):
    """DCP keeps tp-split tensors under their full names and shapes: the checkpoint reshards to tp 1."""
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    whole, _ = _finetune(model, tmp_path, "--pp", 1, steps=4)
    _finetune(model, tmp_path, "--pp", 2, "--tp", 2, steps=2, out="resumed")
    rows, _ = _finetune(model, tmp_path, "--pp", 1, steps=4, out="resumed", resume=True)
    resumed = {r["step"]: r for r in rows if "loss" in r}
    for step in (3, 4):
        for what in ("loss", "grad_norm"):
            assert abs(resumed[step][what] - whole[step - 1][what]) <= 1e-5, (step, what, resumed[step], whole[step - 1])
