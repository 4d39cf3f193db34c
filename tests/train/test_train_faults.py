"""Spec of how a run ends when the world interferes: signals, a busy folder, divergence, hung ranks.

Real processes: the ``hfpipe`` console runs as its own process (through a wrapper that slows each
step, so a test can interrupt it mid-run) and is sent SIGTERM (as Slurm or Kubernetes do) or a
Ctrl-C (SIGINT to its whole process group, as a terminal does). It must save, print one line with
the resume command and exit 143 / 130; ``--resume auto`` then ends bitwise equal to a run that was
never interrupted. Only the SIGTERM run and a user error in a worker are in the default run; the
SIGINT twin, divergence, an lr change on resume, a crash and a hung rank are ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _dist import tiny_checkpoint
from hfpipe.cli.main import app
from hfpipe.config.run import FinetuneConfig
from hfpipe.train.runner import run_finetune

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
RUN = dict(pp=2, batch_size=2, seq_len=32, max_steps=STEPS, lr=1e-3, warmup_steps=0, threads_per_rank=1)

SLOW_STEPS = '''
"""`hfpipe` with each optimizer step followed by a pause (env HFPIPE_TEST_SLEEP) so a test can
interrupt a run mid-way. Spawned workers import this file as __mp_main__ and get the patch too."""
import os, time

from hfpipe.train.step import StepEngine

_step = StepEngine.step


def step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    time.sleep(float(os.environ.get("HFPIPE_TEST_SLEEP", "0")))
    if os.environ.get("HFPIPE_TEST_HANG_RANK") == os.environ.get("RANK") and out is not None:
        time.sleep(3600)  # a hung rank
    return out


StepEngine.step = step

if __name__ == "__main__":
    from hfpipe.cli.main import app

    app()
'''


def flags(model, out, **extra) -> list[str]:
    args = [str(model)]
    for key, value in {**RUN, **extra, "output_dir": out}.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def metrics(out) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def dcp_state(ckpt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dump = Path(ckpt).parent / f".{Path(ckpt).name}.pt"
    dcp_to_torch_save(ckpt, dump)
    state = torch.load(dump, weights_only=True)
    dump.unlink()
    return state


def assert_same_state(got, want, prefix="") -> None:
    assert sorted(got) == sorted(want), prefix
    for key, value in want.items():
        if isinstance(value, dict):
            assert_same_state(got[key], value, f"{prefix}.{key}")
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{prefix}.{key}"
        else:
            assert got[key] == value, f"{prefix}.{key}"


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference") / "out"
    result = run_finetune(FinetuneConfig(model=str(model), output_dir=str(out), **RUN))
    return {"losses": {r["step"]: r["loss"] for r in result["history"]},
            "final": dcp_state(out / "checkpoints" / f"step-{STEPS:08d}")}


def start(args: list[str], tmp: Path, **env) -> subprocess.Popen:
    script = tmp / "slow_hfpipe.py"
    script.write_text(SLOW_STEPS)
    environ = {**os.environ, "HFPIPE_TEST_SLEEP": "1.0", **env}
    return subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for(proc, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.05)


def interrupt(model, tmp: Path, sig: int) -> dict:
    """Run `hfpipe finetune` as a process, send ``sig`` after its first step; what it left."""
    out = tmp / "out"
    proc = start(["finetune", *flags(model, out)], tmp)
    wait_for(proc, lambda: len(metrics(out)) >= 1)
    busy = CliRunner().invoke(app, ["finetune", *flags(model, out, resume="auto")])
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals every process of the job
    else:
        os.kill(proc.pid, sig)  # Kubernetes: only the main process
    stdout, stderr = proc.communicate(timeout=180)
    return {"out": out, "code": proc.returncode, "stderr": stderr, "busy": busy}


def check_interrupted_then_resumed(run: dict, model, reference, sig: int) -> None:
    name = signal.Signals(sig).name
    assert run["code"] == 128 + sig, run["stderr"]
    assert "Traceback" not in run["stderr"]
    (line,) = [x for x in run["stderr"].splitlines() if x.startswith("interrupted: ")]
    step = int(line.split(" after step ")[1].split(":")[0])
    ckpt = run["out"] / "checkpoints" / f"step-{step:08d}"
    assert line.startswith(f"interrupted: {name} after step {step}: saved {ckpt}; resume with --resume auto: ")
    assert line.endswith(f"--output-dir {run['out']} --resume auto") and line.split(": ")[-1].startswith("hfpipe finetune ")
    assert 1 <= step < STEPS and (ckpt / "hfpipe.json").is_file()
    assert [r["step"] for r in metrics(run["out"])] == list(range(1, step + 1))
    resumed = run_finetune(FinetuneConfig(model=str(model), output_dir=str(run["out"]), resume="auto", **RUN))
    assert {r["step"]: r["loss"] for r in resumed["history"]} == {
        s: v for s, v in reference["losses"].items() if s > step}
    assert_same_state(dcp_state(run["out"] / "checkpoints" / f"step-{STEPS:08d}"), reference["final"])
    assert [r["step"] for r in metrics(run["out"])] == list(range(1, STEPS + 1))  # each step once


@pytest.fixture(scope="module")
def sigterm_run(model, tmp_path_factory) -> dict:
    return interrupt(model, tmp_path_factory.mktemp("sigterm"), signal.SIGTERM)


def test_sigterm_saves_says_how_to_resume_and_resume_auto_is_bitwise_exact(sigterm_run, model, reference):
    check_interrupted_then_resumed(sigterm_run, model, reference, signal.SIGTERM)


def test_a_second_run_into_a_busy_folder_is_refused_naming_the_process(sigterm_run):
    busy = sigterm_run["busy"]
    assert busy.exit_code == 2, busy.stderr
    (line,) = busy.stderr.splitlines()
    assert line.startswith(f"error: --output-dir {sigterm_run['out']} is in use by process ")
    assert "choose another --output-dir" in line


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_resume_auto_is_bitwise_exact(model, reference, tmp_path):
    run = interrupt(model, tmp_path, signal.SIGINT)
    assert run["busy"].exit_code == 2
    check_interrupted_then_resumed(run, model, reference, signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"pp": 1, "tp": 2}, {"pp": 1, "cp": 2}], ids=["pp2", "tp2", "cp2"])
def test_a_diverging_step_stops_the_run_naming_it_and_keeps_the_last_good_checkpoint(model, tmp_path, layout):
    """On every rank alike (tests/train/test_train_divergence.py: a fault on one rank alone under tp and cp)."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["finetune", *flags(model, out, lr=1e30, max_steps=3, save_every=1,
                                                          max_grad_norm=1e30, **layout)])
    assert result.exit_code == 2, result.stderr
    line = result.stderr.splitlines()[-1]  # after the run's own log lines
    assert [x for x in result.stderr.splitlines() if x.startswith("error:")] == [line]
    good = out / "checkpoints" / "step-00000001"
    assert line.startswith("error: step 2: loss ") and "is not finite; stopped without saving it" in line
    assert f"the last good checkpoint is {good}" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None


@pytest.mark.slow
def test_a_changed_lr_applies_from_the_resumed_step_and_says_so(model, reference, tmp_path, caplog):
    import shutil

    from hfpipe.train.optim import lr_lambda

    out = tmp_path / "out"
    first = run_finetune(FinetuneConfig(model=str(model), output_dir=str(out), **{**RUN, "max_steps": 2}))
    assert [r["step"] for r in first["history"]] == [1, 2]
    final = out / "checkpoints" / "step-00000002" / "hfpipe.json"
    written = final.stat().st_mtime_ns
    again = run_finetune(FinetuneConfig(model=str(model), output_dir=str(out), resume="auto", **{**RUN, "max_steps": 2}))
    assert again["history"] == [] and final.stat().st_mtime_ns == written  # a finished run is not rewritten
    resumed = run_finetune(FinetuneConfig(model=str(model), output_dir=str(out), resume="auto",
                                      **{**RUN, "lr": 5e-4, "max_steps": 6}))
    lrs = {r["step"]: r["lr"] for r in resumed["history"]}
    want = {s: 5e-4 * lr_lambda(s - 1, warmup_steps=0, total_steps=6, schedule="cosine", min_ratio=0.0)
            for s in range(3, 7)}
    assert lrs.keys() == want.keys() and all(abs(lrs[s] - want[s]) < 1e-12 for s in want), (lrs, want)
    assert all(v > 0 for v in list(lrs.values())[:-1])
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
    shutil.rmtree(out)


@pytest.mark.slow
def test_a_hung_rank_is_named_within_the_timeout(model, tmp_path):
    out = tmp_path / "out"
    proc = start(["finetune", *flags(model, out, timeout=15)], tmp_path, HFPIPE_TEST_SLEEP="0",
                 HFPIPE_TEST_HANG_RANK="1")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    # the error follows rank 0's progress bar (cut short, so no newline) on the terminal line
    (line,) = ["error: " + x.split("error: ", 1)[1] for x in stderr.replace("\r", "\n").splitlines() if "error: " in x]
    assert line.startswith("error: unexpected WorkerFailed: rank 1 did not answer within --timeout 15 s "
                           "(hung, or stuck in I/O); rank 0 waited for it"), stderr


# --- errors inside workers -----------------------------------------------------------------------


def fail_on_rank_1(kind: str) -> None:
    """Rank 1 fails (a user error, or a crash); rank 0 would have gone on."""
    from hfpipe.source.folder import SourceError

    if os.environ["RANK"] == "1":
        raise SourceError("model-00002.safetensors: truncated shard; re-download it") if kind == "user" \
            else RuntimeError("boom")
    time.sleep(5)


@pytest.mark.parametrize("kind, error, message", [
    ("user", "WorkerError", "model-00002.safetensors: truncated shard; re-download it"),
    pytest.param("crash", "WorkerFailed", "rank 1 failed: RuntimeError: boom",
                 marks=pytest.mark.slow),
])
def test_an_error_inside_a_worker_reaches_the_user_as_one_line(kind, error, message, capfd):
    from hfpipe.parallel import worker_errors
    from hfpipe.parallel.launch import launch

    with pytest.raises(getattr(worker_errors, error)) as caught:
        launch(fail_on_rank_1, 2, kind, threads_per_rank=1)
    assert str(caught.value) == message
    assert "Traceback" not in capfd.readouterr().err  # no torch-elastic report without --debug


def test_debug_is_accepted_after_the_subcommand(tmp_path):
    result = CliRunner().invoke(app, ["plan", str(tiny_checkpoint("llama", num_hidden_layers=2)), "--pp", "9",
                                      "--batch-size", "9", "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and result.stderr.splitlines()[-1].startswith("error: --pp 9")


@pytest.mark.slow
def test_a_second_signal_aborts_at_once(model, tmp_path):
    out = tmp_path / "out"
    proc = start(["finetune", *flags(model, out, max_steps=50)], tmp_path)
    wait_for(proc, lambda: len(metrics(out)) >= 1)
    workers = children(proc.pid)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - t0 < 10, stderr
    assert "Traceback" not in stderr
    time.sleep(1)
    assert not [pid for pid in workers if alive(pid)]  # the workers went down with the launcher


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def rank_of_this_process() -> str:
    return os.environ["RANK"]


@pytest.mark.slow
def test_a_single_node_run_ignores_rdzv_endpoint_so_two_runs_never_join(caplog):
    import socket

    from hfpipe.parallel.launch import launch

    with socket.socket() as busy:  # another job's endpoint: a launch that used it would hang there
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"127.0.0.1:{busy.getsockname()[1]}"
        results = launch(rank_of_this_process, 2, threads_per_rank=1, rdzv_endpoint=endpoint, timeout_s=20)
    assert sorted(results.values()) == ["0", "1"]
    assert f"--rdzv-endpoint {endpoint} ignored: it is only used with --nnodes > 1" in caplog.text
