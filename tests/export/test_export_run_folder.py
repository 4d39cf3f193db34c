"""Spec of exporting what a real run leaves: ``hfpipe export RUN_FOLDER`` takes its newest
checkpoint, a missing step lists the ones there, the files are readable by the group, and a run
at ``--lr 0`` exports its source model back bit for bit (a round trip through the real runner).
"""

from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

from _dist import folder_tensors as tensors
from hfpipe.cli.main import app
from hfpipe.tiny import make_tiny_checkpoint

runner = CliRunner()


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A real 2-rank run at --lr 0 with a checkpoint after each of its two steps (~25 s)."""
    root = tmp_path_factory.mktemp("lr0")
    src = make_tiny_checkpoint(root / "src", "llama")
    run = root / "run"
    result = runner.invoke(app, ["finetune", str(src), "--pp", "2", "--lr", "0", "--max-steps", "2",
                                 "--save-every", "1", "--seq-len", "32", "--batch-size", "2",
                                 "--output-dir", str(run)])
    assert result.exit_code == 0, result.stderr
    return src, run


def test_lr_0_run_exports_the_source_bit_for_bit_from_the_run_folder(run_folder, tmp_path):
    src, run = run_folder
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "hf"), "--no-progress"])
    assert result.exit_code == 0, result.stderr
    assert "step-00000002" in result.stdout  # the newest checkpoint
    got, want = tensors(tmp_path / "hf"), tensors(src)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].equal(want[key]), key


def test_exported_files_are_readable_like_a_plain_open_makes_them(run_folder, tmp_path):
    _, run = run_folder
    assert runner.invoke(app, ["export", str(run), str(tmp_path / "hf"), "--no-progress"]).exit_code == 0
    files = list((tmp_path / "hf").iterdir())
    assert any(p.suffix == ".safetensors" for p in files)
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask(), path.name


def test_a_missing_step_lists_the_steps_that_exist(run_folder, tmp_path):
    _, run = run_folder
    result = runner.invoke(app, ["export", str(run / "checkpoints" / "step-00000009"), str(tmp_path / "hf")])
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("not found; existing steps: step-00000001, step-00000002")
    assert not (tmp_path / "hf").exists()
