"""Spec of evaluation while training: the exact token-mean loss equals transformers' on the same set.

The end-to-end test runs the real ``hfpipe finetune`` in a subprocess whose stderr is a pipe (not
a terminal), with two pipeline ranks, and checks the run's eval rows, log lines and best
checkpoint against a single-process transformers evaluation of the exported model.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from _dist import tiny_checkpoint
from hfpipe.config.run import ConfigError, FinetuneConfig
from hfpipe.data.config import COLUMNS, DataConfig
from hfpipe.loss.tokens import IGNORE_INDEX
from hfpipe.data.load import load_examples, load_splits
from hfpipe.train.evaluate import eval_batches, eval_tokens

QUESTIONS = ["What is 2+2?", "Capital of France?", "Name a colour.", "Say hello.", "Count to three."]
ANSWERS = ["4.", "Paris.", "Blue.", "Hello!", "One, two, three."]
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|eos|>\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def fake_rows(n, seq_len=4):
    """Row i is all i (labels too), so a batch shows which rows it holds."""
    return datasets.Dataset.from_dict({c: [[i + 1] * seq_len for i in range(n)] for c in COLUMNS})


def test_eval_batches_deal_every_row_once_and_fill_the_last_batch():
    rows, bs, dp = fake_rows(5), 2, 2
    ranks = [list(eval_batches(rows, batch_size=bs, dp_rank=r, dp_size=dp)) for r in range(dp)]
    assert [len(r) for r in ranks] == [2, 2]  # ceil(5 / 4) global batches
    seen = [int(b["input_ids"][i, 0]) for r in ranks for b in r for i in range(bs)
            if (b["labels"][i] != IGNORE_INDEX).any()]
    assert sorted(seen) == [1, 2, 3, 4, 5]
    filler = ranks[1][1]  # rank 1's share of the last global batch holds nothing real
    assert (filler["labels"] == IGNORE_INDEX).all() and (filler["input_ids"] == 1).all()
    assert eval_tokens(rows, batch_size=bs, dp_size=dp, limit=None) == 5 * 3
    assert eval_tokens(rows, batch_size=bs, dp_size=dp, limit=1) == 4 * 3
    assert len(list(eval_batches(rows, batch_size=bs, dp_size=dp, limit=1))) == 1


def test_eval_options_are_checked():
    with pytest.raises(ConfigError, match="--eval-every needs an evaluation set: pass --eval-dataset"):
        FinetuneConfig(model="m", eval_every=10)
    with pytest.raises(ConfigError, match="--keep-best needs an evaluation set"):
        FinetuneConfig(model="m", keep_best=True)
    with pytest.raises(ConfigError, match="--eval-fraction must be between 0 and 1, got 1.0"):
        FinetuneConfig(model="m", eval_fraction=1.0)
    with pytest.raises(ConfigError, match="leave out --eval-dataset and --eval-split, or --eval-f"):
        FinetuneConfig(model="m", eval_fraction=0.1, eval_dataset="x.jsonl")
    assert FinetuneConfig(model="m", eval_split="test").evaluates


def transformers_eval(hf_dir, tokenizer_dir, data: DataConfig, rows=None) -> tuple[float, int]:
    """Sum of token losses / tokens over the eval rows, by transformers' own causal-LM loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = load_examples(data, tok) if rows is None else rows
    batch = {k: torch.tensor(rows[k]) for k in COLUMNS}
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    inputs = dict(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    if data.packing:  # as the run feeds packed rows: positions, no mask
        inputs["position_ids"] = batch["position_ids"]
    else:
        inputs["attention_mask"] = batch["attention_mask"]
    with torch.no_grad():
        return float(model(**inputs, num_items_in_batch=n).loss), n


def finetune_cli(tmp, *args) -> subprocess.CompletedProcess:
    """``hfpipe finetune ARGS`` with stderr a pipe, tokenising afresh (a new datasets cache)."""
    hfpipe = Path(sys.executable).parent / "hfpipe"
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp / "hf_cache")}
    return subprocess.run([str(hfpipe), "finetune", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real run: pp=2, eval every 2 of 4 steps, rows every 2 steps, best kept, HF export."""
    tmp = tmp_path_factory.mktemp("eval")
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for q, a in zip(QUESTIONS, ANSWERS)]
    eval_file = tmp / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp / "chat.jinja").write_text(TEMPLATE)
    tiny, out = tiny_checkpoint("llama", num_hidden_layers=2), tmp / "out"
    proc = finetune_cli(tmp, tiny, "--pp", 2, "--max-steps", 4, "--seq-len", 32, "--batch-size", 2,
                        "--no-packing", "--lr", 1e-3, "--eval-dataset", eval_file, "--eval-every", 2,
                        "--log-every", 2, "--keep-best", "--save-hf-at-end", "--output-dir", out,
                        "--chat-template", tmp / "chat.jinja",
                        "--threads-per-rank", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return dict(tiny=tiny, out=out, eval_file=eval_file, proc=proc, rows=rows)


def test_eval_loss_equals_a_transformers_evaluation_of_the_exported_model(run):
    evals = [r for r in run["rows"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    data = DataConfig(dataset=str(run["eval_file"]), seq_len=32, packing=False,
                      chat_template=str(run["eval_file"].parent / "chat.jinja"))
    want, tokens = transformers_eval(run["out"] / "hf", run["tiny"], data)
    assert evals[-1]["eval_tokens"] == tokens
    assert abs(evals[-1]["eval_loss"] - want) <= 1e-5, (evals[-1]["eval_loss"], want)
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(evals[-1]["eval_loss"]), rel=1e-12)
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]  # it trained in between


def test_the_export_carries_the_chat_template_it_was_trained_with(run):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run["out"] / "hf").chat_template == TEMPLATE


def test_log_rows_and_plain_lines_follow_log_every(run):
    assert [r["step"] for r in run["rows"] if "loss" in r] == [2, 4]
    err = run["proc"].stderr
    assert "\r" not in err  # stderr is a pipe: no progress bars, neither ours nor datasets'
    assert any(run["out"].parent.joinpath("hf_cache").rglob("cache-*.arrow"))  # tokenised afresh
    lines = [x for x in err.splitlines() if re.search(r"\d\d:\d\d:\d\d INFO .*: (eval )?step \d+/4 ", x)]
    assert [re.search(r"(eval )?step \d", x).group() for x in lines] == [
        "step 2", "eval step 2", "step 4", "eval step 4"]


def test_keep_best_saves_the_lowest_eval_loss_and_the_run_names_next_commands(run):
    evals = [r for r in run["rows"] if "eval_loss" in r]
    best = min(evals, key=lambda r: r["eval_loss"])
    (kept,) = (run["out"] / "best").glob("step-*")
    assert kept.name == f"step-{best['step']:08d}"
    assert json.loads((kept / "hfpipe.json").read_text())["eval"]["eval_loss"] == best["eval_loss"]
    assert f"hfpipe generate {run['out'] / 'hf'}" in run["proc"].stderr
    assert "--resume auto" in run["proc"].stderr
    assert re.search(r"finished: step 4, loss [\d.]+, eval_loss [\d.]+, checkpoint", run["proc"].stdout)


@pytest.mark.slow
def test_eval_fraction_with_dp_and_packing_equals_transformers(tmp_path):
    """dp=2 x pp=2: each dp rank evaluates its shard; the loss is still the whole set's."""
    tiny, out = tiny_checkpoint("llama", num_hidden_layers=2), tmp_path / "out"
    proc = finetune_cli(tmp_path, tiny, "--pp", 2, "--dp", 2, "--max-steps", 2, "--seq-len", 32,
                        "--batch-size", 2, "--eval-fraction", 0.2, "--dataset", "builtin:tiny-text",
                        "--save-hf-at-end", "--output-dir", out, "--threads-per-rank", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (last,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
               if "eval_loss" in x]
    from transformers import AutoTokenizer

    data = DataConfig(dataset="builtin:tiny-text", seq_len=32)
    _, held = load_splits(data, AutoTokenizer.from_pretrained(tiny), eval_fraction=0.2)
    want, tokens = transformers_eval(out / "hf", tiny, data, rows=held)
    assert last["eval_tokens"] == tokens and abs(last["eval_loss"] - want) <= 1e-5


def test_the_eval_set_is_the_eval_dataset_or_another_split_with_the_training_options():
    from hfpipe.train.preflight import data_config

    base = dict(model="m", dataset="org/data", dataset_config="en", columns="q=prompt,a=response")
    split = data_config(FinetuneConfig(**base, eval_split="test"), held_out=True)
    assert (split.dataset, split.dataset_config, split.split) == ("org/data", "en", "test")
    other = data_config(FinetuneConfig(**base, eval_dataset="valid.jsonl"), held_out=True)
    assert (other.dataset, other.dataset_config, other.split) == ("valid.jsonl", None, "train")
    assert other.columns == split.columns == {"q": "prompt", "a": "response"}
    assert data_config(FinetuneConfig(**base), held_out=True) is None


@pytest.mark.slow
@pytest.mark.parametrize("axis", [("--cp", 2), ("--dp", 2)])
def test_the_eval_loss_is_the_same_with_the_sequence_or_the_batch_split_over_ranks(tmp_path, axis):
    """Under --cp each rank holds part of every row: the loss sum and the token count are both taken over the
    dp x cp ranks, once (the count of whole rows summed over cp once made the eval loss cp times too large).
    The learning rate is 0, so both evaluate the same weights whatever rows each layout trained on."""
    from hfpipe.train.runner import run_finetune

    tiny = tiny_checkpoint("llama", num_hidden_layers=2)
    common = dict(model=str(tiny), max_steps=1, seq_len=32, batch_size=4, eval_fraction=0.2, eval_every=1,
                  lr=0.0, min_lr=0.0, threads_per_rank=1)
    one = run_finetune(FinetuneConfig(output_dir=str(tmp_path / "one"), pp=1, **common))["evals"][-1]
    split = run_finetune(FinetuneConfig(output_dir=str(tmp_path / "split"), pp=1, **{axis[0][2:]: axis[1]},
                                        **common))["evals"][-1]
    assert split["eval_tokens"] == one["eval_tokens"]
    assert abs(split["eval_loss"] - one["eval_loss"]) <= 1e-5, (split, one)
