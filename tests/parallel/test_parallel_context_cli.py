"""The issue's bar for ``--cp``, run as a user runs it (the ``hfpipe`` command).

A tiny Llama on packed rows of 64 tokens (several documents a row, restarting positions): 3 steps at
``--pp 2 --cp 2`` (four processes) equal the same flags at ``--pp 1`` (losses and grad norms within
1e-5); a run saved at cp 2 resumes at cp 1 equal to the uninterrupted run (checkpoints do not depend
on cp). Slow (process starts); the default run covers the same path in process-level tests
(test_parallel_context.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import tiny_checkpoint
from test_cli_e2e import hfpipe


def _finetune(model: Path, cwd: Path, *mesh, steps: int = 3, out: str | None = None, resume: bool = False):
    """``hfpipe finetune`` on packed rows for ``steps`` steps (constant lr); its metrics rows."""
    out = out or "out-" + "-".join(map(str, mesh))
    run = hfpipe("finetune", model, *mesh, "--max-steps", steps, "--seq-len", 64, "--batch-size", 4, "--packing",
                 "--microbatches", 2, "--lr", 3e-3, "--lr-schedule", "constant", "--output-dir", out,
                 "--save-every", 2, *(["--resume", "auto"] if resume else []), cwd=cwd, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (cwd / out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_pp2_x_cp2_on_packed_rows_equals_pp1(tmp_path):
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    rows1 = _finetune(model, tmp_path, "--pp", 1)
    rows2 = _finetune(model, tmp_path, "--pp", 2, "--cp", 2)
    assert [r["step"] for r in rows2] == [1, 2, 3]
    for what in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[what] for r in rows2]), torch.tensor([r[what] for r in rows1]),
                                   atol=1e-5, rtol=0, msg=lambda m: f"{what} pp2 x cp2 vs pp1: {m}")


@pytest.mark.slow
def test_a_run_saved_at_cp2_resumes_at_cp1_equal_to_the_uninterrupted_run(tmp_path):
    """FSDP2 shards over cp; DCP keeps the full names and shapes, so the checkpoint reshards to cp 1."""
    model = tiny_checkpoint("llama", num_hidden_layers=4)
    whole = _finetune(model, tmp_path, "--pp", 1, steps=4)
    _finetune(model, tmp_path, "--pp", 1, "--cp", 2, steps=2, out="resumed")
    rows = _finetune(model, tmp_path, "--pp", 1, steps=4, out="resumed", resume=True)
    resumed = {r["step"]: r for r in rows if "loss" in r}
    for step in (3, 4):
        for what in ("loss", "grad_norm"):
            assert abs(resumed[step][what] - whole[step - 1][what]) <= 1e-5, (step, what, resumed[step], whole[step - 1])
