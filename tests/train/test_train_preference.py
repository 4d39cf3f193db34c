"""Spec of ``hfpipe finetune --method dpo``: TRL's DPO through the pipeline, the same at any pipeline size.

The run first computes the reference log-probs of every pair with a forward-only pass of the pipeline and
stores them in the run folder; a resumed run reads them back. Its export is the source model's folder again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import folder_tensors, tiny_checkpoint

pytest.importorskip("trl")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
DPO = ("--method", "dpo", "--dataset", "builtin:tiny-preference", "--seq-len", 64, "--batch-size", 4,
       "--microbatches", 2, "--lr", 1e-3, "--report-to", "jsonl", "--dpo-loss", "sigmoid")


def hfpipe(*args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hfpipe.cli.main", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model():
    return tiny_checkpoint("llama", num_hidden_layers=4)


def test_finetune_dpo_runs_at_pp2_from_a_stored_reference_and_exports_the_source_keys(model, tmp_path):
    """One run: the reference pass is stored, step 1's policy is the reference (loss ln 2, rewards 0), the
    rewards are logged under TRL's names, and the export is the source's keys and shapes."""
    run = hfpipe("finetune", model, *DPO, "--pp", 2, "--max-steps", 2, "--output-dir", "out", "--save-hf-at-end",
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = rows(tmp_path / "out")
    assert first["loss"] == pytest.approx(0.6931472, abs=1e-6)  # -log sigmoid(0)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert second["rewards/chosen"] != 0.0 and second["loss"] != first["loss"]
    assert set(first) >= {"rewards/accuracies", "logps/chosen", "logps/rejected", "grad_norm"}
    assert (tmp_path / "out" / "reference_logps.safetensors").is_file()
    source, exported = folder_tensors(model), folder_tensors(tmp_path / "out" / "hf")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in source.items()}
    assert any(not torch.equal(exported[k], source[k]) for k in source)  # trained


@pytest.mark.slow  # two runs: the default suite runs one (above)
@pytest.mark.timeout(1800)
def test_finetune_dpo_at_pp2_equals_pp1_and_exports_the_source_keys(model, tmp_path):
    runs = {}
    for pp in (1, 2):
        run = hfpipe("finetune", model, *DPO, "--pp", pp, "--max-steps", 3, "--output-dir", f"pp{pp}",
                     *(["--save-hf-at-end"] if pp == 2 else []), cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[pp] = rows(tmp_path / f"pp{pp}")
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    for one, two in zip(runs[1], runs[2]):
        for key in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "rewards/chosen"):
            assert abs(one[key] - two[key]) <= 1e-5, (key, one, two)
    assert runs[2][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # the policy is the reference at step 1
    for pp in (1, 2):
        assert (tmp_path / f"pp{pp}" / "reference_logps.safetensors").is_file()
    source, exported = folder_tensors(model), folder_tensors(tmp_path / "pp2" / "hf")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in source.items()}
    assert any(not torch.equal(exported[k], source[k]) for k in source)  # trained


# --- the stored reference log-probs (read back on resume, never recomputed) ---------------------------------


def test_stored_reference_log_probs_read_back_exactly(tmp_path):
    from hfpipe.train.preference import read_reference, store_reference

    chosen, rejected = torch.tensor([-3.5, -1.25, -7.0]), torch.tensor([-4.0, -2.5, -6.75])
    path = tmp_path / "reference_logps.safetensors"
    record = store_reference(path, chosen, rejected, "abc", "m")
    c, r, again = read_reference(path, "abc", 3)
    assert torch.equal(c, chosen) and torch.equal(r, rejected) and again == record
    assert not list(tmp_path.glob(".*"))  # written into a hidden sibling, then renamed


@pytest.mark.parametrize("damage, says", [
    ("flip", "its bytes differ from what was stored (damaged)"),
    ("other data", "holds the reference log-probs of 3 other pairs, not of these 3"),
    ("missing", "is missing: a resumed --method dpo run reads the reference log-probs"),
    ("not safetensors", "cannot be read"),
])
def test_damaged_or_foreign_reference_log_probs_are_refused_in_one_line(tmp_path, damage, says):
    from hfpipe.errors import CheckpointError
    from hfpipe.train.preference import read_reference, store_reference

    path = tmp_path / "reference_logps.safetensors"
    store_reference(path, torch.tensor([-3.5, -1.25, -7.0]), torch.tensor([-4.0, -2.5, -6.75]), "abc", "m")
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # inside the last tensor's bytes
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    elif damage == "not safetensors":
        path.write_bytes(b"\x80\x04K\x01.")  # a pickle: never loaded as one
    with pytest.raises(CheckpointError) as e:
        read_reference(path, "other" if damage == "other data" else "abc", 3)
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # three runs
@pytest.mark.timeout(2400)
def test_a_resumed_dpo_run_reads_its_reference_back_and_equals_the_uninterrupted_run(model, tmp_path):
    flags = (*DPO, "--pp", 2, "--lr-schedule", "constant", "--save-every", 2)
    whole = hfpipe("finetune", model, *flags, "--max-steps", 4, "--output-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = hfpipe("finetune", model, *flags, "--max-steps", 2, "--output-dir", "parts", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    stored = tmp_path / "parts" / "reference_logps.safetensors"
    written = stored.stat().st_mtime_ns
    rest = hfpipe("finetune", model, *flags, "--max-steps", 4, "--output-dir", "parts", "--resume", "auto",
                  cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert re.search(r"read the reference log-probs of \d+ pairs", rest.stderr)
    assert stored.stat().st_mtime_ns == written  # read back, not written again
    want, got = rows(tmp_path / "whole"), rows(tmp_path / "parts")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert abs(a[key] - b[key]) <= 1e-6, (key, a, b)
    data = bytearray(stored.read_bytes())  # a damaged store is refused, never recomputed
    data[-1] ^= 0x01
    stored.write_bytes(bytes(data))
    again = hfpipe("finetune", model, *flags, "--max-steps", 6, "--output-dir", "parts", "--resume", "auto",
                   cwd=tmp_path)
    assert again.returncode != 0 and "its bytes differ from what was stored (damaged)" in again.stderr


@pytest.mark.slow  # two runs each
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("one, other", [
    (("--pp", 1, "--dp", 1, "--batch-size", 4, "--microbatches", 1),
     ("--pp", 1, "--dp", 2, "--batch-size", 2, "--microbatches", 1)),  # each replica its half of the pairs
    (("--pp", 1, "--lora-rank", 4), ("--pp", 2, "--lora-rank", 4)),  # the reference: the base, adapters off
    (("--pp", 1, "--tp", 1), ("--pp", 1, "--tp", 2)),  # each pair's log-probs from the vocabulary-parallel head
    (("--pp", 1, "--lora-rank", 4, "--quantize-base", "nf4"),
     ("--pp", 2, "--lora-rank", 4, "--quantize-base", "nf4")),
], ids=["dp2", "lora-pp2", "tp2", "qlora-pp2"])
def test_dpo_layouts_train_the_same_steps(model, tmp_path, one, other):
    runs = []
    for name, flags in (("one", one), ("other", other)):
        run = hfpipe("finetune", model, *DPO, *flags, "--max-steps", 2, "--output-dir", name, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(rows(tmp_path / name))
    assert runs[0][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # the policy starts as its reference
    for a, b in zip(*runs):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/rejected"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a, b)
