"""Bad input that is not one command line: a chat fed by a pipe, a resume that
changes AdamW's settings, the worker that failed first, the Python API's argument errors, an export
whose checkpoint is pruned under it, generation beyond the context, dynamic RoPE.

Default run: in-process or one short subprocess each. The multi-process ones (signals, kill -9 of
the launcher, a rendezvous nobody answers) are in tests/parallel/test_parallel_signals.py, ``slow``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _dist import run_ranks
from hfpipe.cli.main import app
from test_cli_bad_inputs import ckpt, edit_json, tiny, tree  # noqa: F401 - ckpt, tiny: fixtures

REPO = Path(__file__).resolve().parents[2]


# --- hfpipe chat reads its turns from a pipe --------------------------------------------------------


def test_chat_answers_piped_turns(tiny, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "hfpipe.cli.main", "chat", str(tiny), "--max-new-tokens", "3"],
                          input="hello there\nsecond turn\n/exit\n", capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # two prompts answered (the model's words are random: count the turns, not the text)
    assert proc.stdout.count("model> ") == 2 and proc.stdout.count("you> ") == 3, proc.stdout
    assert list(tmp_path.iterdir()) == []


# --- resume: every field is sorted; AdamW changes are applied and said -----------------------------


def test_every_config_field_is_in_exactly_one_resume_list():
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import FREE, MAY_CHANGE, MUST_MATCH, SUMMATION_ORDER

    lists = [*MUST_MATCH, *MAY_CHANGE, *SUMMATION_ORDER, *FREE]
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert fields <= set(lists), f"sort these into a list of resume_check: {sorted(fields - set(lists))}"
    assert len(lists) == len(set(lists)), "a field in two lists"


def _saved(**config) -> dict:
    from hfpipe.config.run import FinetuneConfig

    base = FinetuneConfig(model="m", seq_len=32, batch_size=2).to_dict()
    return {"config": {**base, **config}}


def test_changed_adamw_settings_apply_from_the_resumed_step_and_are_said():
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.optim import build_optimizer, build_scheduler
    from hfpipe.train.resume_check import apply_schedule_changes, check_resume

    saved = _saved(weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8)
    cfg = FinetuneConfig(model="m", seq_len=32, batch_size=2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6)
    changed = check_resume("ckpt", saved, cfg, tied=False)
    assert changed == ["weight_decay", "betas", "eps"]
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer([module], lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)  # as loaded
    scheduler = build_scheduler(optimizer, warmup_steps=0, total_steps=10, lr=cfg.lr)
    note = apply_schedule_changes(changed, saved, cfg, optimizer, scheduler, step=3)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0  # norms and biases keep 0
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in optimizer.param_groups)
    assert note == ("resumed at step 3 with --weight-decay 0.0 -> 0.1, --betas 0.9 0.95 -> 0.8 0.9, "
                    "--eps 1e-08 -> 1e-06: applied from step 4 on")


@pytest.mark.parametrize("field, old, new", [
    ("train_on_prompt", False, True), ("eval_fraction", None, 0.1), ("chat_template", None, "t.jinja"),
    ("lora_alpha", None, 16.0), ("lora_targets", "all-linear", "q_proj"), ("lora_rank", None, 4),
])
def test_a_resume_that_changes_what_is_trained_is_refused(field, old, new):
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import ResumeMismatch, check_resume

    lora = {"lora_rank": 4} if field.startswith("lora_") and field != "lora_rank" else {}
    cfg = FinetuneConfig(model="m", seq_len=32, batch_size=2, **lora, **{field: new})
    with pytest.raises(ResumeMismatch, match=f"--{field.replace('_', '-')} {old!r} -> "):
        check_resume("ckpt", _saved(**lora, **{field: old}), cfg, tied=False)


@pytest.mark.parametrize("pp, microbatches", [(2, None), (4, None), (1, 3)])
def test_another_microbatch_count_is_said_and_resumes_where_the_objective_is_per_token(caplog, pp, microbatches):
    """Started at --pp 1 (one microbatch by default), resumed at --pp 2 or 4 with their defaults: the same rows
    of each step, split another way."""
    import logging

    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import check_resume

    cfg = FinetuneConfig(model="m", seq_len=32, batch_size=12, pp=pp, microbatches=microbatches)
    with caplog.at_level(logging.INFO, logger="hfpipe.train.resume_check"):
        assert check_resume("ckpt", _saved(batch_size=12, pp=1, microbatches=None), cfg, tied=False) == []
    now = microbatches or pp
    assert f"each step's 12 rows now split into {now} microbatches (were 1)" in caplog.text


def test_another_microbatch_count_is_refused_where_each_microbatch_has_a_term_of_its_own():
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import ResumeMismatch, check_resume

    cfg = FinetuneConfig(model="m", seq_len=32, batch_size=4, pp=2)
    with pytest.raises(ResumeMismatch, match=r"--microbatches 1 -> 2 \(this model's router aux loss is taken per "
                                             r"microbatch: pass --microbatches 1 to keep it\)"):
        check_resume("ckpt", _saved(batch_size=4, pp=1), cfg, tied=False, per_microbatch=True)


# --- the worker error names the rank that failed first ----------------------------------------------


def test_the_first_failure_is_named_not_its_echoes(tmp_path, monkeypatch):
    from hfpipe.parallel.worker_errors import WorkerFailed, raise_from_failures

    monkeypatch.delenv("HFPIPE_DEBUG", raising=False)  # --debug re-raises the launcher's own error instead

    records = [  # rank 0 only lost its peer; rank 1 failed first, with an error of its own
        {"rank": 0, "kind": "crash", "type": "RuntimeError", "time": 2.0, "echo": True,
         "message": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5000"},
        {"rank": 1, "kind": "crash", "type": "OverflowError", "time": 1.0, "echo": False,
         "message": "Python int too large to convert to C int"},
        {"rank": 2, "kind": "crash", "type": "ValueError", "time": 1.5, "echo": False, "message": "later"},
    ]
    for r in records:
        (tmp_path / f"error-rank{r['rank']}.json").write_text(json.dumps(r))
    with pytest.raises(WorkerFailed) as caught:
        raise_from_failures(tmp_path, RuntimeError("elastic"), 3, 600)
    assert str(caught.value) == "rank 1 failed: OverflowError: Python int too large to convert to C int"


def test_a_peers_death_is_recognised_as_an_echo():
    from hfpipe.parallel.worker_errors import is_echo

    assert is_echo("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:51894")
    assert is_echo("Connection reset by peer") and is_echo("NCCL error: remote process exited or there was a network error")
    assert not is_echo("CUDA out of memory") and not is_echo("boom")


def fail_on_rank_1_while_0_waits() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise OverflowError("the root cause")
    dist.barrier()  # gloo: "Connection closed by peer" once rank 1 is gone


@pytest.mark.slow
def test_a_real_run_names_the_rank_that_failed_first():
    from hfpipe.parallel.launch import launch
    from hfpipe.parallel.worker_errors import WorkerFailed

    with pytest.raises(WorkerFailed) as caught:
        launch(fail_on_rank_1_while_0_waits, 2, threads_per_rank=1, timeout_s=120)
    assert str(caught.value) == "rank 1 failed: OverflowError: the root cause"


# --- the Python API names the argument ---------------------------------------------------------------


def _api_errors(model: str, file: str) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.errors import HfpipeError

    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "accepted"
        except HfpipeError as e:
            out[name] = str(e)
        except Exception as e:  # noqa: BLE001 - the test reports what else came
            out[name] = f"NOT AN HfpipeError: {type(e).__name__}: {e}"

    for name, kwargs in {"dp 0": {"dp": 0}, "microbatches 0": {"microbatches": 0}, "pp 0": {"pp": 0},
                         "checkpointing": {"activation_checkpointing": "some"}, "seed -1": {"seed": -1}}.items():
        attempt(name, lambda kwargs=kwargs: load_pipeline(model, **{"pp": 1, **kwargs}))
    pm = load_pipeline(model, pp=1)
    trainer = pm.trainer(torch.optim.AdamW(pm.parameters(), lr=1e-3))
    ids = torch.randint(0, pm.vocab_size, (2, 8))
    for name, batch in {"beyond vocab": {"input_ids": ids + pm.vocab_size, "labels": ids},
                        "negative label": {"input_ids": ids, "labels": ids - 200},
                        "float ids": {"input_ids": ids.float(), "labels": ids}, "no labels": {"input_ids": ids},
                        "empty batch": {"input_ids": ids[:0], "labels": ids[:0]}, "empty list": [],
                        "labels shape": {"input_ids": ids, "labels": ids[:, :4]}}.items():
        attempt(name, lambda batch=batch: trainer.step(batch))
    attempt("eval beyond vocab", lambda: trainer.eval_loss({"input_ids": ids + 10**6, "labels": ids}))
    attempt("save into a file", lambda: pm.save_checkpoint(file, 1))
    return out


def test_the_python_api_raises_an_hfpipe_error_naming_the_argument(tiny, tmp_path):
    (tmp_path / "a-file").write_text("x")
    before = tree(tmp_path)
    got = run_ranks(_api_errors, 1, str(tiny), str(tmp_path / "a-file"))[0]
    want = {
        "dp 0": "load_pipeline(dp=0): dp must be an integer >= 1",
        "microbatches 0": "load_pipeline(microbatches=0): microbatches must be an integer >= 1",
        "pp 0": "load_pipeline(pp=0): pp must be an integer >= 1",
        "checkpointing": "load_pipeline(activation_checkpointing='some'): choose one of none, full, selective",
        "seed -1": "load_pipeline(seed=-1): seed must be an integer >= 0",
        "beyond vocab": "trainer.step: the batch: input_ids holds ",
        "negative label": "trainer.step: the batch: labels holds -",
        "float ids": "trainer.step: the batch: input_ids must hold integer token ids, got torch.float32",
        "no labels": "trainer.step: the batch has no 'labels' tensor",
        "empty batch": "trainer.step: the batch: input_ids must be [batch, sequence] with at least one token",
        "empty list": "trainer.step: no batch given",
        "labels shape": "trainer.step: the batch: labels shape [2, 4] differs from input_ids [2, 8]",
        "eval beyond vocab": "trainer.eval_loss: the batch: input_ids holds ",
        "save into a file": f"save_checkpoint(root='{tmp_path / 'a-file'}'): it is a file; give a folder",
    }
    for name, message in want.items():
        assert got[name].startswith(message), (name, got[name])
    assert got["beyond vocab"].endswith("outside the model's vocabulary of 384 tokens (0 .. 383)")
    assert got["negative label"].endswith("outside the model's vocabulary of 384 tokens (0 .. 383, or -100)")
    assert tree(tmp_path) == before


# --- an export whose checkpoint is pruned under it ----------------------------------------------------


def test_an_export_whose_checkpoint_is_deleted_midway_says_so_in_one_line(ckpt, tmp_path, monkeypatch):
    import shutil

    from hfpipe.export import hf_folder as export

    victim = shutil.copytree(ckpt.parents[1], tmp_path / "run") / "checkpoints" / ckpt.name
    plan = export.plan_groups

    def pruned(*args, **kwargs):  # as a run's --keep does, once the export has planned
        out = plan(*args, **kwargs)
        shutil.rmtree(victim)
        return out

    monkeypatch.setattr(export, "plan_groups", pruned)
    result = CliRunner().invoke(app, ["export", str(victim), str(tmp_path / "hf"), "--no-progress"])
    assert result.exit_code == 2, result.stderr[-2000:]
    line = result.stderr.splitlines()[-1]
    assert line == (f"error: checkpoint {victim} was deleted while it was being exported (pruned by --keep "
                    "of a run still training?); export a newer checkpoint, or raise --keep; OUT was left as it was")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hf, no temporary folder, no lock


# --- generation within the context; dynamic RoPE beyond it ------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--max-new-tokens", "100000"], "and --max-new-tokens 100000 exceed the model's context of 256"),
    (["--prompt", "word " * 300, "--no-chat-template"], "the model's context (max_position_embeddings) is 256"),
])
def test_generate_beyond_the_context_is_refused(tiny, args, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    result = CliRunner().invoke(app, ["generate", str(tiny), *args])
    assert result.exit_code == 2, result.stderr[-2000:]
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert result.stdout == ""


def test_dynamic_rope_runs_beyond_max_position_embeddings(tiny, tmp_path):
    import shutil

    from hfpipe.config.run import FinetuneConfig
    from hfpipe.data.config import context_limit
    from hfpipe.source.folder import ModelSource
    from hfpipe.train.preflight import preflight

    dynamic = shutil.copytree(tiny, tmp_path / "dynamic")
    edit_json(dynamic / "config.json", lambda c: {**c, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    assert context_limit(ModelSource.open(dynamic).config) is None
    assert context_limit(ModelSource.open(tiny).config) == 256
    preflight(FinetuneConfig(model=str(dynamic), pp=2, seq_len=512, batch_size=2,
                             output_dir=str(tmp_path / "out")), check_data=False)  # was refused: > 256


@pytest.mark.slow
def test_verify_follows_a_small_models_context(tiny, tmp_path):
    import shutil

    small = shutil.copytree(tiny, tmp_path / "small")
    edit_json(small / "config.json", lambda c: {**c, "max_position_embeddings": 16})
    result = CliRunner().invoke(app, ["verify", str(small), "--pp", "2"])
    assert result.exit_code == 0, result.stderr[-2000:]
    tokens = int(re.search(r"(\d+) tokens", result.stdout).group(1))
    assert result.stdout.startswith("PASS") and tokens <= 2 * 16, result.stdout  # 2 rows of 16, not of 32


@pytest.mark.slow
def test_verify_of_a_dynamic_rope_model_beyond_its_positions_passes(tiny, tmp_path):
    import shutil

    dynamic = shutil.copytree(tiny, tmp_path / "dynamic")
    edit_json(dynamic / "config.json", lambda c: {**c, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    result = CliRunner().invoke(app, ["verify", str(dynamic), "--pp", "2", "--seq-len", "300"])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert "PASS" in result.stdout, result.stdout


@pytest.mark.parametrize("kind, logits, on", [("qwen3_moe", True, True), ("qwen3_moe", False, False),
                                              ("llama", True, False)])
def test_the_resume_checks_know_from_the_config_which_models_take_a_loss_per_microbatch(kind, logits, on):
    """The config says it as the model does: router logits asked for, and a coefficient to weigh them."""
    from transformers import AutoModelForCausalLM

    from hfpipe.models.router_loss import router_loss_on, router_loss_spec
    from hfpipe.tiny import tiny_config

    config = tiny_config(kind)
    config.output_router_logits = logits
    assert router_loss_on(config) is on
    with torch.device("meta"):
        assert (router_loss_spec(AutoModelForCausalLM.from_config(config)) is not None) is on


def test_chat_without_a_chat_template_is_the_refusal_alone(tiny, tmp_path):
    """No "chatting with ..." banner above the one line saying why it cannot chat."""
    import json
    import shutil

    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    model = Path(shutil.copytree(tiny, tmp_path / "plain"))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["chat", str(model)])
    lines = [line for line in result.stderr.splitlines() if line.strip() and "hfpipe.progress.ticker" not in line]
    assert result.exit_code == 2 and lines == ["error: this tokenizer has no chat template, so it cannot chat; use "
                                               "hfpipe generate --no-chat-template --prompt ..."], result.stderr
