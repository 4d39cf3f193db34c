"""The output folder's lock leaves nothing of its own: a run stopped before it wrote anything (Ctrl-C in start-up)
leaves no folder it created, while a folder the user had, or one holding anything, always stays."""

from __future__ import annotations

import signal

import pytest

from _dist import tiny_checkpoint


def test_released_it_removes_the_empty_folders_it_created_and_no_others(tmp_path):
    from hfpipe.parallel.lock import run_lock

    out = tmp_path / "runs" / "a" / "out"
    with run_lock(out):
        assert out.is_dir() and (out / ".hfpipe.parallel.lock").is_file()
    assert not (tmp_path / "runs").exists()
    assert tmp_path.is_dir()  # there before: never ours to remove


def test_a_folder_the_user_had_stays_even_empty(tmp_path):
    from hfpipe.parallel.lock import run_lock

    out = tmp_path / "out"
    out.mkdir()
    with run_lock(out):
        pass
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_folder_it_created_stays_once_it_holds_anything(tmp_path):
    from hfpipe.parallel.lock import run_lock

    out = tmp_path / "runs" / "out"
    with run_lock(out):
        (out / "metrics.jsonl").write_text("{}\n")
    assert (out / "metrics.jsonl").read_text() == "{}\n"

    other = tmp_path / "more" / "out"
    with run_lock(other):
        (tmp_path / "more" / "notes.txt").write_text("the user's")  # put beside it meanwhile
    assert not other.exists() and (tmp_path / "more" / "notes.txt").is_file()


def test_ctrl_c_in_the_workers_start_up_leaves_no_output_folder(tmp_path, monkeypatch):
    """The launcher's path: the workers stop in start-up (``launch`` raises Interrupted, as it does on Ctrl-C)."""
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.parallel.signals import Interrupted
    from hfpipe.train import runner

    out = tmp_path / "runs" / "out"
    cfg = FinetuneConfig(model=str(tiny_checkpoint("llama")), output_dir=str(out), pp=2, batch_size=2, seq_len=32,
                         max_steps=1, threads_per_rank=1)
    started = []

    def stopped_in_start_up(*args, **kwargs):
        started.append(out.is_dir())  # the lock made the folder before the workers started
        raise Interrupted(signal.SIGINT, None, None)

    monkeypatch.setattr(runner, "preflight", lambda *a, **k: None)
    monkeypatch.setattr(runner, "launch", stopped_in_start_up)
    with pytest.raises(Interrupted, match="before the first step; nothing was written"):
        runner.run_finetune(cfg)
    assert started == [True]
    assert not (tmp_path / "runs").exists()
