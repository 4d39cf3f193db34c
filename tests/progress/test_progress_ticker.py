"""The one ticker every silent stretch uses (``hfpipe.progress.ticker.Ticker``): it says what is going
on after a moment and then every few seconds with the time so far, says nothing about a stretch
over at once, counts a new stretch afresh, stays quiet while something else shows progress, and
speaks on rank 0 only."""

from __future__ import annotations

import time

from hfpipe.progress.ticker import FIRST_S, TICK_S, Ticker


def _lines(what, seconds: float, **options) -> list[str]:
    said: list[str] = []
    with Ticker(what, echo=said.append, every=0.05, **options):
        time.sleep(seconds)
    return said


def test_a_stretch_over_at_once_says_nothing():
    said: list[str] = []
    with Ticker("checking", echo=said.append):  # the real delays: a quick user error stays one line
        pass
    assert said == []


def test_a_silent_stretch_is_said_then_with_its_time():
    said = _lines("loading the stages", 0.32)
    assert said[0] == "loading the stages..."
    assert len(said) >= 4 and all(x.startswith("loading the stages... (") and x.endswith(" s)") for x in said[1:])


def test_a_new_stretch_counts_afresh_and_none_keeps_quiet():
    phases = iter(["starting"] * 3 + [None] * 4 + ["saving"] * 100)
    said = _lines(lambda: next(phases), 0.6)
    assert said[0] == "starting..."
    assert any(x.startswith("saving... (") for x in said)
    assert not any("None" in x for x in said)


def test_only_rank_0_speaks(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _lines("loading", 0.2) == []


def test_stretches_one_after_another_leave_no_gap_of_5_s():
    assert FIRST_S + TICK_S < 5.0
