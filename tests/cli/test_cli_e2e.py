"""End to end, as a user runs it: the `hfpipe` console command in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import tiny_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def hfpipe(*args, cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hfpipe.cli.main", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


@pytest.mark.slow  # the default run drives finetune --pp 2 end to end in test_quickstart and test_first_run
def test_finetune_pp2_runs_writes_metrics_and_the_loss_falls(tmp_path):
    model = tiny_checkpoint("llama_tied", num_hidden_layers=4)
    run = hfpipe("finetune", model, "--pp", 2, "--max-steps", 10, "--seq-len", 64, "--batch-size", 4,
                 "--microbatches", 2, "--lr", 3e-3, "--warmup-steps", 2, "--output-dir", "out",
                 "--save-hf-at-end", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert all(r["grad_norm"] > 0 and r["tokens"] > 0 for r in rows)
    assert (tmp_path / "out" / "hf" / "model.safetensors.index.json").is_file()


def test_quickstart_runs_offline_and_passes(tmp_path):
    run = hfpipe("quickstart", "--out", "qs", "--steps", 12, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for marker in ("1/4 a small Llama", "prompt: 'What colour is the sky on a clear day?'",
                   "before fine-tuning:", "2/4 fine-tuning 12 steps at pp=2", "    loss ",
                   "3/4 exported to", "4/4 checking the export", "(PASS)", "after fine-tuning:"):
        assert any(marker in line for line in lines), (marker, run.stdout)
    assert "nan" not in run.stdout
