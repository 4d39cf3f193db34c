"""``--fp8`` as a user runs it: ``finetune`` and ``plan`` take it, refuse what it cannot run with in one
line (exit 2, before anything loads), and an ``--fp8`` run's checkpoint resumes without the flag and
exports an ordinary HF folder.

The refusals run in process (cheap); the end-to-end run starts real ranks (``pytest -m slow``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _dist import folder_tensors, tiny_checkpoint
from test_cli_e2e import hfpipe
from test_export_force_and_damage import _refused

pytest.importorskip("torchao", reason="--fp8 needs torchao (pip install 'hfpipe[qlora]')")

REFUSED = {
    "fp32": (["--fp8", "--dtype", "fp32"], "--fp8 multiplies bf16 activations in float8; use --dtype bf16-mixed"),
    "a recipe without --fp8": (["--fp8-recipe", "tensorwise", "--dtype", "bf16-mixed"],
                               "--fp8-recipe tensorwise applies with --fp8; add --fp8"),
    "an unknown recipe": (["--fp8", "--fp8-recipe", "delayed", "--dtype", "bf16-mixed"],
                          "--fp8-recipe must be one of rowwise, tensorwise, blockwise; got 'delayed'"),
    "an NF4 base": (["--fp8", "--dtype", "bf16-mixed", "--lora-rank", "8", "--quantize-base", "nf4"],
                    "--fp8 with --quantize-base nf4"),
    "torchao's recipe on an FP8 base": (["--fp8", "--dtype", "bf16-mixed", "--lora-rank", "8", "--quantize-base",
                                         "fp8"], "--fp8-recipe rowwise casts a full-precision weight"),
    "blockwise without an FP8 base": (["--fp8", "--fp8-recipe", "blockwise", "--dtype", "bf16-mixed"],
                                      "--fp8-recipe blockwise multiplies a block-FP8 base's own tiles"),
}


@pytest.fixture(scope="module")
def llama() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=2)


@pytest.mark.parametrize("command", ["finetune", "plan"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_fp8_refusals_are_one_line_in_finetune_and_plan(llama, tmp_path, command, case):
    flags, message = REFUSED[case]
    out = ["--output-dir", tmp_path / "out"] if command == "finetune" else []
    _refused([command, llama, "--pp", "1", *out, *flags], message, tmp_path)


def _finetune(model: Path, cwd: Path, out: str, *flags) -> list[dict]:
    run = hfpipe("finetune", model, "--pp", 2, "--seq-len", 32, "--batch-size", 4, "--microbatches", 2,
                 "--lr", 5e-3, "--dtype", "bf16-mixed", "--output-dir", out, *flags, cwd=cwd, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (cwd / out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two runs of two ranks each
def test_finetune_fp8_resumes_without_fp8_and_exports_an_ordinary_folder(llama, tmp_path):
    """(That --fp8 tracks bf16-mixed is checked in process: tests/quant/test_quant_fp8_training.py.)"""
    _finetune(llama, tmp_path, "fp8", "--max-steps", 2, "--fp8", "--save-every", 2)
    (ckpt,) = (tmp_path / "fp8" / "checkpoints").glob("step-*")
    assert json.loads((ckpt / "hfpipe.json").read_text())["config"]["fp8"] is True
    rows = _finetune(llama, tmp_path, "fp8", "--max-steps", 4, "--resume", "latest", "--save-hf-at-end")
    assert [r["step"] for r in rows] == [1, 2, 3, 4], "two --fp8 steps, then two resumed without it"
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 0.1, losses
    exported, source = folder_tensors(tmp_path / "fp8" / "hf"), folder_tensors(llama)
    assert {k: (v.dtype, v.shape) for k, v in exported.items()} == {k: (v.dtype, v.shape) for k, v in source.items()}

def test_plan_prices_fp8_as_bf16_mixed(llama):
    """torchao saves the bf16 input and weight for backward, as a plain linear does: the same price."""
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    args = ["plan", str(llama), "--pp", "2", "--dtype", "bf16-mixed", "--seq-len", "64", "--batch-size", "4"]
    plain, fp8 = (CliRunner().invoke(app, args + extra) for extra in ([], ["--fp8", "--fp8-recipe", "tensorwise"]))
    assert plain.exit_code == fp8.exit_code == 0, fp8.stderr[-2000:]
    assert fp8.stdout == plain.stdout and "rank" in plain.stdout
