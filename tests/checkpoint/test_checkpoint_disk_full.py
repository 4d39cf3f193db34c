"""Spec of a full disk: a save or an export that runs out of space says so in one line (the path
and the bytes) and leaves no partial folder. The disk is a small tmpfs, mounted where this runs as
root; elsewhere the tests are skipped, saying why."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _dist import tiny_checkpoint
from hfpipe.cli.main import app
from hfpipe.checkpoint.dcp import record_checksums


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB tmpfs: room for logs, not for a checkpoint or an export of the tiny model."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or 'not root'}); "
                    "the disk-full path needs one")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=2)


def test_an_export_onto_a_full_disk_says_so_and_removes_its_folder(model, small_disk, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    weights = AutoModelForCausalLM.from_pretrained(model).state_dict()
    dcp.save({"model." + k: v for k, v in weights.items()}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "hfpipe.json").write_text(json.dumps({"format": 1, "step": 1, "source": str(model),
                                                  "source_dtype": "float32", "tied": False, "config": {}}))
    record_checksums(ckpt)  # as every checkpoint hfpipe saves
    out = small_disk / "hf"
    result = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--dtype", "fp32", "--no-progress",
                                      "--max-shard-size", "100KB"])
    assert result.exit_code == 2, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith(f"error: disk full while writing {out} (the export needs about ")
    assert "the partial folder was removed" in line
    assert list(small_disk.iterdir()) == []


@pytest.mark.slow  # a real two-process run (~40 s on 2 busy cores)
def test_a_save_onto_a_full_disk_says_so_and_leaves_no_partial_checkpoint(model, small_disk):
    out = small_disk / "out"
    result = CliRunner().invoke(app, ["finetune", str(model), "--pp", "2", "--seq-len", "32", "--batch-size", "2",
                                      "--max-steps", "1", "--threads-per-rank", "1", "--output-dir", str(out)])
    assert result.exit_code == 2, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith(f"error: disk full while saving {out / 'checkpoints' / 'step-00000001'} (this rank writes about ")
    assert "the partial checkpoint was removed" in line
    assert not any((out / "checkpoints").glob("*step-*"))
