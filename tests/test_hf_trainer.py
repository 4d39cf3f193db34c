"""hfpipe.hf.PipelineTrainer / PipelineSFTTrainer (issue #26): the user's own Trainer script, pipelined.

The spec: one script (``tests/hf_scripts/train_lm.py``) run in one process with transformers' ``Trainer``
and under ``torchrun`` with ``PipelineTrainer``: the losses at every logging step, the eval loss and
``save_model()``'s tensors agree within 1e-5 (fp32, CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import TIMEOUT_S, folder_tensors, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hf_scripts" / "train_lm.py"
ATOL = 1e-5


def run_script(tmp_path: Path, name: str, nprocs: int = 1, **spec) -> Path:
    """Run the script with ``spec`` (in one process, or under torchrun); return its output folder."""
    out = tmp_path / name
    spec = {"model": str(tiny_checkpoint("llama", num_hidden_layers=4)), "out": str(out), **spec}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    launch = [sys.executable] if nprocs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "localhost:0", "--max-restarts", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([*launch, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=TIMEOUT_S,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def history(out: Path) -> list[dict]:
    return json.loads((out / "log_history.json").read_text())


def losses(out: Path, key: str = "loss") -> list[tuple[int, float]]:
    return [(h["step"], h[key]) for h in history(out) if key in h]


def assert_same_run(got: Path, want: Path, *, final: str = "final") -> None:
    """Same logged losses and grad norms step by step, same exported tensors, same eval loss."""
    for key in ("loss", "grad_norm", "eval_loss"):
        g, w = losses(got, key), losses(want, key)
        assert [s for s, _ in g] == [s for s, _ in w], f"{key} logged at other steps: {g} vs {w}"
        for (step, a), (_, b) in zip(g, w):
            assert abs(a - b) <= ATOL, f"{key} at step {step}: {a} vs the plain Trainer's {b}"
    g, w = folder_tensors(got / final), folder_tensors(want / final)
    assert sorted(g) == sorted(w), f"exported keys differ: {sorted(set(g) ^ set(w))[:5]}"
    for k in w:
        torch.testing.assert_close(g[k], w[k], rtol=0, atol=ATOL, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The oracle: transformers' Trainer in one process (3 steps, logging every step)."""
    return run_script(tmp_path_factory.mktemp("plain"), "plain", trainer="plain")


def test_the_bar_pp2_equals_the_plain_trainer(plain, tmp_path):
    out = run_script(tmp_path, "pp2", nprocs=2, trainer="pipeline", pp=2)
    assert len(losses(plain)) == 3
    assert_same_run(out, plain)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")  # save_model() wrote a folder from_pretrained loads
