"""Signals and dead peers with real processes: signals at every stage of a run, kill -9 of the launcher,
a rendezvous nobody answers, a full disk under an asynchronous save.

Each run is ``hfpipe finetune`` as its own process, through a wrapper that can hold the launcher in
its checks or the workers in their loading (each touches a marker file first), so a signal lands
exactly there. The spec: one line, exit 143 / 130 / 129, nothing written (no output folder either), no worker left behind.
Only the export's Ctrl-C and SIGTERM (in-process) and the launcher's kill of a starting worker that cannot
take a signal are in the default run; the rest are ``slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import tiny_checkpoint
from test_train_faults import wait_for

REPO = Path(__file__).resolve().parents[2]

HOLD = '''
"""`hfpipe` that can stop in the launcher's checks, in the workers' joining of the process group or in their
loading (HFPIPE_TEST_HOLD), touching a marker file there first; or pause after each step (HFPIPE_TEST_SLEEP)."""
import os, signal, time
from pathlib import Path

import hfpipe.train.runner
from hfpipe.train.step import StepEngine

_hold, _marks = os.environ.get("HFPIPE_TEST_HOLD", ""), Path(os.environ.get("HFPIPE_TEST_MARKS", "."))
# patched where the runner looks them up: its preflight (the launcher's), init_distributed and build_pipeline
# (each worker's)
_preflight, _load, _step = hfpipe.train.runner.preflight, hfpipe.train.runner.build_pipeline, StepEngine.step
_init = hfpipe.train.runner.init_distributed


def preflight(*args, **kwargs):
    if _hold == "preflight":
        (_marks / "preflight").touch()
        time.sleep(3600)
    return _preflight(*args, **kwargs)


def init_distributed(*args, **kwargs):
    if _hold == "init":  # rank 1 never comes (stuck where no signal reaches Python); rank 0 waits for it
        rank = os.environ.get("RANK")
        if rank == "1":
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
        (_marks / f"init-{rank}").touch()
        if rank == "1":
            time.sleep(3600)
    return _init(*args, **kwargs)


def build_pipeline(*args, **kwargs):
    if _hold == "load":
        (_marks / f"load-{os.environ.get('RANK')}").touch()
        time.sleep(3600)
    return _load(*args, **kwargs)


def step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    time.sleep(float(os.environ.get("HFPIPE_TEST_SLEEP", "0")))
    return out


hfpipe.train.runner.preflight, hfpipe.train.runner.build_pipeline, StepEngine.step = preflight, build_pipeline, step
hfpipe.train.runner.init_distributed = init_distributed

if __name__ == "__main__":
    from hfpipe.cli.main import app

    app()
'''


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=2)


def start(model: Path, tmp: Path, *flags: str, **env) -> tuple[subprocess.Popen, Path]:
    script = tmp / "hold_hfpipe.py"
    script.write_text(HOLD)
    out = tmp / "out"
    args = [str(model), "--pp", "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "50",
            "--threads-per-rank", "1", "--output-dir", str(out), *flags]
    environ = {**os.environ, "HFPIPE_TEST_MARKS": str(tmp), **env}
    proc = subprocess.Popen([sys.executable, str(script), "finetune", *args], cwd=REPO, env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    return proc, out


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        kids = [p for p, parent in parents.items() if parent == todo[-1]]
        todo.pop()
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def one_line(stderr: str, start: str) -> str:
    """The run's one error/interrupted line (log lines of the run may come before it)."""
    said = [x for x in stderr.splitlines() if x.startswith(("error:", "interrupted:"))]
    assert len(said) == 1 and said[0].startswith(start), stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    return said[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, True)])
def test_a_signal_while_the_workers_load_stops_at_once_in_one_line(model, tmp_path, sig, group):
    proc, out = start(model, tmp_path, HFPIPE_TEST_HOLD="load")
    wait_for(proc, lambda: len(list(tmp_path.glob("load-*"))) == 2)
    workers = descendants(proc.pid)
    (os.killpg if group else os.kill)(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    name = signal.Signals(sig).name
    assert one_line(stderr, "interrupted: ") == f"interrupted: {name} before the first step; nothing was written"
    assert not out.exists()  # not even the folder the lock made
    time.sleep(1)
    assert not [p for p in workers if alive(p)]


@pytest.mark.slow
def test_ctrl_c_while_a_rank_waits_for_one_that_never_joins_stops_every_worker_in_one_line(model, tmp_path):
    """Rank 0 waits inside the process group's start for rank 1, which never comes and cannot take the signal
    (stuck in C++); nor can rank 0 until the group's --timeout. The launcher kills both after a short grace."""
    proc, out = start(model, tmp_path, "--timeout", "3000", HFPIPE_TEST_HOLD="init")
    wait_for(proc, lambda: len(list(tmp_path.glob("init-*"))) == 2)
    time.sleep(1)  # rank 0 is in init_process_group by now
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=240)  # not the --timeout: within the grace, and the launcher's exit
    assert proc.returncode == 130, stderr[-3000:]
    assert one_line(stderr, "interrupted: ") == "interrupted: SIGINT before the first step; nothing was written"
    assert not out.exists()  # not even the folder the lock made
    time.sleep(1)
    assert not [p for p in workers if alive(p)]


def test_the_launcher_kills_a_starting_worker_that_cannot_take_the_signal(tmp_path):
    """A worker in start-up gets the launcher's copy of the signal; one blocked in C++ (where Python's handler
    cannot run) is killed once the grace is over, instead of keeping the run until its --timeout."""
    from hfpipe.parallel.signals import LauncherSignals

    deaf = "import signal, sys, time; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT]); print(); " \
           "sys.stdout.flush(); time.sleep(600)"
    worker = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True)
    try:
        worker.stdout.readline()  # its signal mask is set
        (tmp_path / "pid-0").write_text(str(worker.pid))
        LauncherSignals(tmp_path, grace_s=0.2)._handle(signal.SIGINT, None)
        assert (tmp_path / "stop").read_text() == str(int(signal.SIGINT))  # the workers' stop file
        assert worker.wait(timeout=60) == -signal.SIGKILL
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_launchers_checks_stops_in_one_line(model, tmp_path, sig):
    proc, out = start(model, tmp_path, HFPIPE_TEST_HOLD="preflight")
    wait_for(proc, lambda: (tmp_path / "preflight").exists())
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert one_line(stderr, "error: ") == f"error: stopped by {signal.Signals(sig).name}; nothing was written"
    assert not out.exists()


@pytest.mark.slow
def test_a_second_sigterm_kills_the_workers_and_says_so_in_one_line(model, tmp_path):
    proc, out = start(model, tmp_path, HFPIPE_TEST_SLEEP="1.0")
    wait_for(proc, lambda: (out / "metrics.jsonl").is_file())
    workers = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    line = one_line(stderr, "error: a second SIGTERM: ")
    assert line.endswith("the last complete checkpoint stays (--resume auto continues from it)")
    assert "resource_tracker" not in stderr
    time.sleep(1)
    assert not [p for p in workers if alive(p)]


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_worker_running(model, tmp_path):
    proc, out = start(model, tmp_path, HFPIPE_TEST_SLEEP="1.0")
    wait_for(proc, lambda: (out / "metrics.jsonl").is_file())
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGKILL)  # no handler sees it: the workers' parent-death signal does
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while [p for p in workers if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if alive(p)]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_an_export_removes_its_temporary_folder(model, tmp_path, monkeypatch, sig, code):
    import json

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from hfpipe.export import hf_folder as export
    from hfpipe.checkpoint.dcp import record_checksums
    from hfpipe.parallel.signals import StartupInterrupted

    ckpt = tmp_path / "ckpt"
    weights = AutoModelForCausalLM.from_pretrained(model).state_dict()
    dcp.save({"model." + k: v for k, v in weights.items()}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "hfpipe.json").write_text(json.dumps({"format": 1, "step": 1, "source": str(model),
                                                  "source_dtype": "float32", "tied": False, "config": {}}))
    record_checksums(ckpt)  # as every checkpoint hfpipe saves
    write_config = export._write_config

    def interrupted_midway(tmp, *args):  # the shards are written; the signal lands before the config
        os.kill(os.getpid(), sig)
        write_config(tmp, *args)

    monkeypatch.setattr(export, "_write_config", interrupted_midway)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(StartupInterrupted) as stopped:  # the console: "error: stopped by SIG..." in one line
        export.export_checkpoint(ckpt, work / "hf", progress=False)
    assert stopped.value.code == code
    assert list(work.iterdir()) == []  # no hf, no .hf.tmp-*, no lock


@pytest.mark.slow
def test_a_node_whose_head_never_comes_says_so_within_the_timeout():
    import socket

    from hfpipe.parallel.launch import launch
    from hfpipe.parallel.mesh import LaunchError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LaunchError) as caught:
        launch(os.getpid, 1, nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}", timeout_s=5)
    assert str(caught.value).startswith(f"--rdzv-endpoint 127.0.0.1:{port}: the 2 nodes did not meet within 5 s")
    assert str(caught.value).endswith("check that node 0 runs, its address and port, and the firewall")


@pytest.mark.slow
def test_a_full_disk_under_an_asynchronous_save_is_one_line_exit_2(model, tmp_path):
    import uuid

    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or 'not root'})")
    try:
        out = mount / "out"
        result = CliRunner().invoke(app, ["finetune", str(model), "--pp", "2", "--seq-len", "32", "--batch-size", "2",
                                          "--max-steps", "2", "--save-every", "1", "--async-save",
                                          "--threads-per-rank", "1", "--output-dir", str(out)])
        assert result.exit_code == 2, result.stderr[-2000:]
        line = result.stderr.splitlines()[-1]
        assert line.startswith(f"error: disk full while saving {out / 'checkpoints' / 'step-00000001'}"), line
        assert not any((out / "checkpoints").glob("*step-*"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
