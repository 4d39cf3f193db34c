"""Spec of the quickstart's honesty and pacing (the full run is in tests/cli/test_cli_e2e.py): a second
run in the same folder says what it reuses and trains afresh, silent stretches get a line every
few seconds, and its prompts are answerable from the shipped chat set with its own tokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hfpipe import quickstart as qs
from hfpipe.config.names import ConfigError
from hfpipe.tiny import make_tiny_tokenizer

CHAT = Path(qs.__file__).parent / "assets" / "data" / "tiny_chat.jsonl"


def test_a_second_run_replaces_the_previous_run_and_says_so(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000120").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    said: list[str] = []
    qs._clear_previous_run(run, said.append)
    assert not run.exists()
    assert said == [f"    removed the previous quickstart run in {run}: this one starts afresh"]


def test_a_folder_that_is_not_a_quickstart_run_is_left_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a quickstart run; choose another --out"):
        qs._clear_previous_run(run, print)
    assert (run / "notes.txt").read_text() == "mine"


def test_silent_stretches_get_a_line_every_tick_and_none_while_others_report(monkeypatch):
    from hfpipe.progress import ticker as progress

    monkeypatch.setattr(progress, "TICK_S", 0.05)
    said: list[str] = []
    state = {"what": "starting workers"}
    with qs._ticker(said.append, lambda: state["what"]):
        time.sleep(0.18)
        state["what"] = None  # the run's own progress bar is showing
        time.sleep(0.15)
        quiet = len(said)
        state["what"] = "stopping workers"
        time.sleep(0.12)
    assert said[0].startswith("    starting workers... (") and quiet >= 2
    assert all("starting" in line for line in said[:quiet])
    assert any(line.startswith("    stopping workers... (0 s)") for line in said[quiet:])


def test_the_prompts_are_in_the_shipped_chat_set_and_its_words_are_tokens():
    users = {m["content"] for line in CHAT.read_text().splitlines()
             for m in json.loads(line)["messages"] if m["role"] == "user"}
    assert set(qs.PROMPTS) <= users
    tok = make_tiny_tokenizer(qs._MODEL["vocab_size"], qs._chat_corpus())
    assert len(tok) <= qs._MODEL["vocab_size"]
    assert tok.tokenize("A cat says meow.") == ["A", "Ġcat", "Ġsays", "Ġmeow", "."]
