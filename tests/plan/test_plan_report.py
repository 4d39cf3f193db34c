"""Spec of hfpipe.plan.report: what a plan costs each stage and rank, from config.json alone.

Parameters are checked against the transformers model itself, bytes against the per-dtype table,
and microbatches in flight against the schedules' textbook counts (1F1B keeps ``p - rank``, GPipe
all ``m``). Every bundled real config plans.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hfpipe.config.run import bundled_config_dir
from hfpipe.models.adapter import UnsupportedModelError
from hfpipe.errors import ParallelError
from hfpipe.plan.split import PlanError
from hfpipe.plan.actions import schedule_actions, timeline
from hfpipe.plan.report import BYTES_PER_PARAM, format_report, load_model_config, plan_report
from hfpipe.source.folder import SourceError
from hfpipe.tiny import tiny_config
from _trust import error_lines

BUNDLED = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
           "deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3")
MULTI = ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")


def hf_params(config) -> int:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def llama(layers=8, tied=False):
    return tiny_config("llama_tied" if tied else "llama", num_hidden_layers=layers)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3"])
def test_stage_params_add_up_to_the_transformers_model(kind):
    config = tiny_config(kind, num_hidden_layers=8)
    report = plan_report(config, 4, seq_len=16)
    assert sum(s.params for s in report.stages) == report.total_params == hf_params(config)
    assert [r.params for r in report.ranks] == [s.params for s in report.stages]


def test_a_tied_head_is_a_second_copy_unless_the_rank_holds_both():
    config = llama(tied=True)
    embed = config.vocab_size * config.hidden_size
    total = hf_params(config)
    split = plan_report(config, 2, seq_len=16)
    assert split.total_params == total
    assert sum(s.params for s in split.stages) == total + embed  # the head stage's own copy
    together = plan_report(config, 2, schedule="zbv", seq_len=16)  # V: rank 0 holds first and last
    assert sum(r.params for r in together.ranks) == total
    assert plan_report(config, 1, seq_len=16).ranks[0].params == total


@pytest.mark.parametrize("dtype", sorted(BYTES_PER_PARAM))
def test_weights_grads_and_optimizer_bytes_follow_the_dtype(dtype):
    w, g, o = {"fp32": (4, 4, 8), "bf16-mixed": (6, 4, 8), "bf16": (2, 2, 4), "fp64": (8, 8, 16)}[dtype]
    for rank in plan_report(llama(), 2, seq_len=16, dtype=dtype).ranks:
        assert (rank.weight_bytes, rank.grad_bytes, rank.optimizer_bytes) == (
            w * rank.params, g * rank.params, o * rank.params)
        assert rank.total_bytes == (w + g + o) * rank.params + rank.activation_bytes - rank.apart_bytes
        assert 0 <= rank.apart_bytes < min(rank.grad_bytes, rank.activation_bytes)
    # rank 0's first backward frees a microbatch's layers as it makes their gradients: never all at once
    assert plan_report(llama(), 2, seq_len=16, dtype=dtype).ranks[0].apart_bytes > 0


def test_activations_are_each_layers_measured_bytes_plus_the_heads_on_the_last_stage():
    from hfpipe.plan.activations import head_bytes_per_token, layer_bytes_per_token

    config = llama(layers=4)
    h, vocab, seq, mb_size = config.hidden_size, config.vocab_size, 16, 3
    report = plan_report(config, 2, seq_len=seq, batch_size=2 * mb_size, dtype="bf16-mixed")
    per_layer = layer_bytes_per_token(config, "bf16-mixed")
    tokens = mb_size * seq
    first, last = report.stages
    ids = 8 * tokens  # the embedding keeps the int64 token ids
    assert first.activation_bytes_per_microbatch == sum(per_layer[:2]) * tokens + ids  # two layers
    head = head_bytes_per_token(config, "bf16-mixed")
    assert vocab * 4 < head < vocab * 4 + 16 * h  # fp32 log-probs; the norm's and head's inputs; no logits
    assert last.activation_bytes_per_microbatch == (sum(per_layer[2:]) + head) * tokens
    fp32 = plan_report(config, 2, seq_len=seq, batch_size=2 * mb_size, dtype="fp32").stages[0]
    assert fp32.activation_bytes_per_microbatch > first.activation_bytes_per_microbatch
    full = plan_report(config, 2, seq_len=seq, batch_size=2 * mb_size, activation_checkpointing="full")
    positions = 8 * tokens + 64  # checkpointing keeps the int64 positions (and a few scalars)
    assert full.stages[0].activation_bytes_per_microbatch == 2 * h * 2 * tokens + ids + positions  # layer inputs
    assert full.ranks[0].activation_bytes < report.ranks[0].activation_bytes
    selective = plan_report(config, 2, seq_len=seq, batch_size=2 * mb_size, activation_checkpointing="selective")
    assert selective.stages[0].activation_bytes_per_microbatch == (h * 2 + per_layer[1]) * tokens + ids + positions


def in_flight(schedule, pp, m):
    report = plan_report(llama(layers=8), pp, schedule=schedule, microbatches=m, seq_len=16)
    return [s.in_flight for s in report.stages]


def test_1f1b_keeps_p_minus_rank_microbatches_in_flight():
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 4) == [4, 3, 2, 1]


def test_gpipe_keeps_every_microbatch_in_flight():
    assert in_flight("gpipe", 4, 8) == [8, 8, 8, 8]


def test_interleaved_1f1b_keeps_more_on_early_ranks():
    """Megatron's warmup: (v-1)*p + 2*(p-1-rank) forwards before the first backward."""
    report = plan_report(llama(layers=8), 4, schedule="interleaved-1f1b", microbatches=8, seq_len=16)
    per_chunk = report.stages[1].activation_bytes_per_microbatch  # stages 1..6 hold one layer each
    alive = [(r.activation_bytes - r.backward_bytes) / per_chunk for r in report.ranks]  # held, not passing
    assert alive[0] > alive[1] > alive[2] > alive[3] >= 1
    assert max(alive) <= 8 * 2 + 1  # never more than every chunk of every microbatch


def test_every_microbatch_runs_forward_and_backward_once_per_stage():
    for schedule in ("gpipe", "1f1b") + MULTI:
        vpp = 2 if schedule in MULTI else 1
        actions = schedule_actions(schedule, 2, vpp, 4)
        steps = [step for rank in actions for step in rank]
        for stage in range(2 * vpp):
            for mb in range(4):
                kinds = sorted(k for k, s, m in steps if (s, m) == (stage, mb))
                assert kinds in (["B", "F"], ["F", "I", "W"]), (schedule, stage, mb, kinds)


def test_timeline_replays_1f1b_with_the_textbook_bubble():
    rows = timeline(schedule_actions("1f1b", 4, 1, 8))
    span = max(end for row in rows for _, end, *_ in row)
    assert span == 3 * (8 + 4 - 1)  # (m + p - 1) slots of F + B = 3 units


def test_balance_and_bubble_are_reported():
    report = plan_report(llama(layers=8), 4, microbatches=8, seq_len=16)
    assert report.balance == report.plan.balance >= 1.0
    assert report.bubble == pytest.approx(3 / (8 + 3))  # (p-1) / (m+p-1)
    text = format_report(report)
    for needle in ("embed, layer", "norm, head", "balance", "bubble 27.3%", "optimizer"):
        assert needle in text


def test_multi_stage_schedules_get_two_stages_per_rank():
    for schedule in MULTI:
        report = plan_report(llama(layers=8), 2, schedule=schedule, seq_len=16)
        assert report.plan.vpp == 2 and report.microbatches == 4
        assert all(len(r.stages) == 2 for r in report.ranks)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"pp": 9}, PlanError, "reduce --pp"),
    ({"pp": 2, "schedule": "nope"}, ParallelError, "unknown"),
    ({"pp": 4, "microbatches": 2}, ParallelError, "at least as many microbatches"),
    ({"pp": 2, "batch_size": 3}, ParallelError, r"--batch-size \(3\) must be a multiple of --microbatches"),
    ({"pp": 2, "dtype": "fp8"}, PlanError, "--dtype"),
    ({"pp": 2, "layout": "Et|tL"}, PlanError, "add 6 't'"),
])
def test_bad_options_name_the_flag(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_report(llama(layers=8), seq_len=16, **kwargs)


def test_unknown_architectures_are_refused():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        plan_report(GPT2Config(n_layer=4), 2, seq_len=16)


@pytest.mark.parametrize("model_id", BUNDLED)
def test_every_bundled_config_plans(model_id):
    config = load_model_config(model_id)
    report = plan_report(config, 4, seq_len=4096, name=model_id)
    assert len(report.stages) == 4 and report.total_params > 1e9
    assert format_report(report).startswith(model_id)


def test_llama_70b_pp8_balance():
    report = plan_report(load_model_config("meta-llama/Llama-3.1-70B"), 8)
    assert 70e9 < report.total_params < 71e9
    assert report.balance == pytest.approx(1.084, abs=0.01)  # 80 layers + embed + 128k head over 8


def test_config_from_folder_file_and_bundled_id(tmp_path):
    bundled = bundled_config_dir("meta-llama/Llama-3.2-1B")
    raw = json.loads((bundled / "config.json").read_text())
    other = tmp_path / "llama-1b.json"
    other.write_text(json.dumps(raw))
    for name in (str(bundled), str(bundled / "config.json"), str(other), "meta-llama/Llama-3.2-1B"):
        config = load_model_config(name)
        assert isinstance(config, LlamaConfig) and config.num_hidden_layers == 16
    with pytest.raises(SourceError, match="no such folder"):
        load_model_config(str(tmp_path / "missing"))
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps({**raw, "auto_map": {"AutoConfig": "x.Y"}}))
    with pytest.raises(SourceError, match="--trust-remote-code"):
        load_model_config(str(remote))


def test_a_miscased_bundled_id_names_the_one_meant_and_every_bundled_id():
    # Refused before any hub request: the hub is no help offline, and the user meant the bundled one.
    with pytest.raises(SourceError, match=r"did you mean meta-llama/Llama-3\.1-8B\? bundled ids: "
                                          r"deepseek-ai/DeepSeek-V2-Lite, .*meta-llama/Llama-3\.2-1B"):
        load_model_config("meta-llama/Llama-3.1-8b")


@pytest.mark.parametrize("seq_len", [131073, 10**12])
def test_plan_refuses_a_seq_len_past_the_models_context_as_finetune_does(seq_len):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    result = CliRunner().invoke(app, ["plan", "meta-llama/Llama-3.1-8B", "--seq-len", str(seq_len)])
    assert result.exit_code == 2
    assert error_lines(result.output) == [
        f"error: --seq-len {seq_len} exceeds the model's max_position_embeddings 131072; lower --seq-len"]
