"""Spec of the run's logs: rows follow --log-every, plain lines off a terminal, the sinks."""

from __future__ import annotations

import importlib.util
import json
import logging
import re

import pytest

from hfpipe.config.run import ConfigError, FinetuneConfig
from hfpipe.cli.next_steps import next_commands
from hfpipe.progress.logs import LINES, log_formatter
from hfpipe.progress.reporter import Reporter
from hfpipe.train.step import StepResult

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def results(n):
    """Step results with distinct losses and token counts, so a weighted mean shows."""
    return [StepResult(loss=1.0 + i, grad_norm=0.5, lr=1e-3, tokens=10 * (i + 1), seen=64) for i in range(n)]


def read_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rows_follow_log_every_and_carry_the_exact_window_loss(tmp_path):
    steps = results(7)
    report = Reporter(tmp_path, 7, enabled=True, log_every=3, report_to="jsonl", tty=False)
    history = [report.log(i + 1, r) for i, r in enumerate(steps)]
    report.close()
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == [3, 6, 7]  # every 3rd step and the last
    assert [h["loss"] for h in history] == [r.loss for r in steps]  # the summary keeps every step
    for row, window in zip(rows, (steps[0:3], steps[3:6], steps[6:7])):
        tokens = sum(r.tokens for r in window)
        assert row["tokens"] == tokens
        assert row["loss"] == pytest.approx(sum(r.loss * r.tokens for r in window) / tokens, abs=1e-12)


def test_off_a_terminal_each_row_is_one_plain_timestamped_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LINES.name)
    report = Reporter(tmp_path, 4, enabled=True, log_every=2, report_to="none", tty=False)
    for i, r in enumerate(results(4)):
        report.log(i + 1, r)
    report.log_eval({"step": 4, "eval_loss": 1.25, "eval_ppl": 3.49, "eval_tokens": 99})
    report.close()
    lines = [log_formatter(1).format(r) for r in caplog.records if r.name == LINES.name]
    assert len(lines) == 3 and not any("\r" in line for line in lines)
    head = rf"{STAMP} INFO \[rank1\] hfpipe\.train\.lines: "
    # the input positions read and the loss tokens trained, each named (trained alone once read as 11 tok/s)
    seen, trained = map(float, re.fullmatch(
        rf"{head}step 2/4 loss 1\.6667 grad_norm 0\.500 lr 1\.00e-03 tok/s seen (\d+) trained (\d+) "
        rf"eta \d\d:\d\d:\d\d", lines[0]).groups())
    assert seen == pytest.approx(trained * 128 / 30, rel=0.02)  # 2 x 64 positions, 10 + 20 loss tokens
    assert re.match(rf"{head}step 4/4 loss 3\.5714", lines[1])
    assert re.fullmatch(rf"{head}eval step 4/4 eval_loss 1\.2500 ppl 3\.490 tokens 99", lines[2])
    assert not (tmp_path / "metrics.jsonl").exists()  # report_to none


def test_tensorboard_gets_train_and_eval_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = Reporter(tmp_path, 2, enabled=True, log_every=1, report_to="tensorboard", tty=False)
    for i, r in enumerate(results(2)):
        report.log(i + 1, r)
    report.log_eval({"step": 2, "eval_loss": 1.25, "eval_ppl": 3.49, "eval_tokens": 99})
    report.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [1.0, 2.0]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 1.25)]
    assert "eval/ppl" in events.Tags()["scalars"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_logs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    report = Reporter(tmp_path, 1, enabled=True, report_to="wandb", tty=False)
    report.log(1, results(1)[0])
    report.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_report_to_is_checked():
    with pytest.raises(ConfigError, match="--report-to 'tensorbord' is unknown; .*did you mean tensorboard"):
        FinetuneConfig(model="m", report_to="jsonl,tensorbord")
    if importlib.util.find_spec("wandb") is None:
        from hfpipe.progress.logs import check_sinks

        with pytest.raises(ConfigError, match=r"pip install 'hfpipe\[wandb\]'"):
            check_sinks("jsonl,wandb")


def test_the_end_of_a_run_names_the_next_commands():
    lines = next_commands("out", "out/checkpoints/step-00000010", exported=False, best=None)
    assert lines[0] == "hfpipe export out/checkpoints/step-00000010 out/hf"
    assert lines[1] == 'hfpipe generate out/hf --prompt "..."'
    assert "--resume auto" in lines[2]
    assert next_commands("out", "c", exported=True, best=None)[0].startswith("hfpipe generate")


def test_the_next_export_replaces_an_earlier_export_and_never_anything_else(tmp_path):
    out, ckpt = tmp_path / "out", "out/checkpoints/step-00000020"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "hfpipe_export.json").write_text("{}")  # exported before a resume
    assert next_commands(str(out), ckpt, exported=False, best=None)[0].endswith(f"{out / 'hf'} --force")
    (out / "hf" / "hfpipe_export.json").unlink()  # a folder of the user's: --force would refuse it
    export, generate = next_commands(str(out), ckpt, exported=False, best=None)[:2]
    assert export == f"hfpipe export {ckpt} {out / 'hf-step-00000020'}"
    assert generate == f'hfpipe generate {out / "hf-step-00000020"} --prompt "..."'


def test_on_a_terminal_a_bar_shows_the_rows_and_eval_lines_stay_above_it(tmp_path, capsys):
    report = Reporter(tmp_path, 4, enabled=True, log_every=2, report_to="jsonl", tty=True)
    for i, r in enumerate(results(4)):
        report.log(i + 1, r)
    report.log_eval({"step": 4, "eval_loss": 1.25, "eval_ppl": 3.49, "eval_tokens": 99})
    report.close()
    err = capsys.readouterr().err
    assert "finetune" in err and "eval_loss=1.2500" in err  # the bar and its postfix
    assert re.search(rf"{STAMP} INFO (\[rank\d\] )?hfpipe\.train\.lines: eval step 4/4 eval_loss 1\.2500", err)
    assert [r["step"] for r in read_rows(tmp_path)] == [2, 4, 4]
