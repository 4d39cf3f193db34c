"""The README's Python API example runs as written under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from _dist import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune_api.py"


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    body = EXAMPLE.read_text().split('"""', 2)[2].strip()  # the code after the module docstring
    assert body in readme


def test_api_example_trains_saves_and_exports(tmp_path):
    model = tiny_checkpoint("llama_tied", num_hidden_layers=4)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), str(model), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)", run.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert "eval loss" in run.stdout
    # a script that configured no logging still hears what its first seconds are spent on, from rank 0 only
    assert "INFO [rank0] hfpipe.pipeline.build: rank 0 loaded " in run.stderr, run.stderr[-3000:]
    assert "[rank1] hfpipe" not in run.stderr, run.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.config.tie_word_embeddings
    assert (tmp_path / "checkpoints" / "step-00000008" / ".metadata").is_file()
