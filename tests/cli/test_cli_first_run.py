"""What a new user meets on a first run of `hfpipe finetune`, in real processes: no warnings from
any rank, one log format with each thing said once, no stretch of 5 s without a line (the start-up
of the workers told as it goes), and `next:` commands that work as printed, also after a resumed run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from _dist import tiny_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
ENV.pop("PYTHONWARNINGS", None)
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
LOG_LINE = re.compile(rf"{STAMP} (DEBUG|INFO|WARNING|ERROR) (\[rank\d+\] )?hfpipe[\w.]*: .+")


def hfpipe(args: list[str], cwd, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hfpipe.cli.main", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
    assert done.returncode == 0, (args, done.stderr[-3000:])
    return done


def printed_next(stderr: str) -> list[list[str]]:
    """The `hfpipe ...` commands under `next:`, split as a shell would (comments dropped)."""
    block = stderr.split("next:\n", 1)[1]
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines()
            if line.strip().startswith("hfpipe ")]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("first-run")
    model = tiny_checkpoint("llama_tied", num_hidden_layers=4)
    args = ["finetune", model, "--pp", 2, "--max-steps", 2, "--seq-len", 64, "--batch-size", 4,
            "--microbatches", 2, "--output-dir", "out"]
    return cwd, args, hfpipe(args, cwd)


def test_a_default_run_warns_nothing_on_any_rank(first_run):
    stderr = first_run[2].stderr
    assert not re.search(r"(?i)warn", stderr), stderr


def test_every_log_line_has_one_format_and_says_each_thing_once(first_run):
    logs = first_run[2].stderr.split("next:\n", 1)[0].splitlines()
    assert logs and all(LOG_LINE.fullmatch(line) for line in logs), logs
    assert sum("documents ->" in line for line in logs) == 1, logs  # the data, once
    assert any("[rank1] hfpipe.train.lines: step 2/2 loss" in line for line in logs), logs
    assert any(" INFO hfpipe.data.load: " in line for line in logs), logs  # the launcher's: no rank


def test_no_stretch_of_5_s_passes_without_a_line(first_run):
    from datetime import datetime

    logs = first_run[2].stderr.split("next:\n", 1)[0].splitlines()
    stamps = [datetime.strptime(m.group(), "%Y-%m-%d %H:%M:%S") for m in map(re.compile(STAMP).match, logs) if m]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) <= 5, list(zip(gaps, logs[1:]))  # stamps are whole seconds: a 4 s tick reads as 4 or 5
    assert "INFO hfpipe.progress.ticker: starting 2 worker processes..." in " ".join(logs), logs  # seconds, always


def test_every_printed_next_command_works_as_printed_also_after_a_resume(first_run):
    cwd, args, run = first_run
    commands = printed_next(run.stderr)
    assert [c[0] for c in commands] == ["export", "generate"]
    hfpipe(commands[0], cwd)  # generate is run after the resume below
    resumed = hfpipe(args + ["--max-steps", 3, "--resume", "auto"], cwd)  # the last --max-steps counts
    commands = printed_next(resumed.stderr)
    assert commands[0][:2] == ["export", "out/checkpoints/step-00000003"]
    for command in commands:
        hfpipe(command, cwd)
