"""Spec of ``hfpipe plan --cp`` (the planner's part): context parallelism counts every
activation on ``seq_len / cp`` tokens, adds the whole sequence's K and V that attention gathers,
shards weights, gradients and AdamW state over dp x cp, and prices the K/V gathers and FSDP2's
traffic; the fit search proposes cp where the sequence is what does not fit; and the issue's two
long-context plans fit (8B at 128k on one node, 70B at 32k on at most 64 GPUs).
"""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from hfpipe.cli.main import app
from hfpipe.config.run import FinetuneConfig
from hfpipe.errors import ParallelError
from hfpipe.plan.activations import layer_bytes_per_token
from hfpipe.plan.context import kv_gather_bytes, kv_shape
from hfpipe.plan.fit import fewest_gpus, parse_memory, report_for, suggest
from hfpipe.plan.memory import fsdp_bytes, param_bytes
from hfpipe.plan.report import load_model_config, plan_report
from hfpipe.recipes import find_recipe
from hfpipe.tiny import tiny_config
from _trust import error_lines

GIB = 2**30
LIMIT = parse_memory("80GB")
runner = CliRunner()
LONG_8B = dict(seq_len=131072, batch_size=1, microbatches=1, dtype="bf16-mixed", activation_checkpointing="full")


def peak(report) -> int:
    return max(r.total_bytes for r in report.ranks)


@pytest.fixture(scope="module")
def llama8b():
    return load_model_config("meta-llama/Llama-3.1-8B")


# -- the issue's bars ------------------------------------------------------------------------------

def test_the_issues_8b_at_128k_fits_one_node_of_80gb_at_cp8_where_dp8_does_not(llama8b):
    result = runner.invoke(app, ["plan", "meta-llama/Llama-3.1-8B", "--cp", "8", "--seq-len", "131072",
                                 "--batch-size", "1", "--microbatches", "1", "--dtype", "bf16-mixed",
                                 "--activation-checkpointing", "full", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 80.0 GiB (8 GPUs)" in result.stdout
    assert "on 8 GPUs (pp 1 x dp 1 x cp 8)" in result.stdout and "cp comm/step" in result.stdout
    after = plan_report(llama8b, 1, cp=8, **LONG_8B)
    # the issue's "before" was 118 GiB a rank; 87 since the plan counts gradients and activations as they
    # coexist (hfpipe.plan.peak) and the head as what it keeps (tests/plan/test_plan_memory_measured.py); 98.7
    # with the recomputed layer's backward working set (hfpipe.plan.transient: its MLP's gradients at 128k tokens)
    before = plan_report(llama8b, 1, dp=8, **LONG_8B)
    assert after.gpus == before.gpus == 8
    assert 95 * GIB < peak(before) < 102 * GIB and 50 * GIB < peak(after) < 0.9 * LIMIT
    # the same FSDP2 shards over 8 ranks; only the activations differ
    assert [after.ranks[0].weight_bytes, after.ranks[0].grad_bytes] == [before.ranks[0].weight_bytes,
                                                                       before.ranks[0].grad_bytes]
    # (not / 8: the recomputed layer's K/V gathered whole, and the mask SDPA saves as an additive bf16 one of
    # 16k local queries x 128k keys, 4 GiB; hfpipe.plan.context)
    assert after.ranks[0].activation_bytes < before.ranks[0].activation_bytes / 4


def test_the_issues_70b_at_32k_fits_80gb_on_a_64_gpu_recipe_where_pp8_dp8_needed_124_gib():
    config = load_model_config("meta-llama/Llama-3.1-70B")
    before = plan_report(config, 8, dp=8, seq_len=32768, dtype="bf16-mixed", activation_checkpointing="full")
    # the issue's 124 before gradients and activations were apart, and the whole gradients and their shards
    assert 110 * GIB < peak(before) < 122 * GIB
    result = runner.invoke(app, ["plan", "--recipe", "llama3_1_70b_sft_32k_pp16_cp4", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 80.0 GiB (64 GPUs)" in result.stdout
    cfg = FinetuneConfig.from_yaml(find_recipe("llama3_1_70b_sft_32k_pp16_cp4"))
    after = report_for(config, cfg)
    assert (cfg.model, cfg.seq_len, cfg.cp, after.gpus) == ("meta-llama/Llama-3.1-70B", 32768, 4, 64)
    assert peak(after) < 0.9 * LIMIT and after.bubble <= 0.20


def test_the_8b_long_context_recipe_is_the_issues_plan_on_one_node():
    cfg = FinetuneConfig.from_yaml(find_recipe("llama3_1_8b_sft_128k_cp8"))
    assert (cfg.pp, cfg.dp, cfg.cp, cfg.tp, cfg.seq_len) == (1, 1, 8, 1, 131072)
    assert {k: getattr(cfg, k) for k in ("batch_size", "dtype", "activation_checkpointing")} == {
        k: LONG_8B[k] for k in ("batch_size", "dtype", "activation_checkpointing")}


# -- the arithmetic, on a tiny Llama (hidden 64, 4 heads of 16, 2 kv heads) ------------------------

def test_cp2_halves_every_activation_but_the_gathered_kv_and_the_mask_which_are_counted_by_hand():
    config = tiny_config("llama", num_hidden_layers=6)
    kw = dict(seq_len=16, batch_size=4, microbatches=4, dtype="fp32")
    measured = layer_bytes_per_token(config, "fp32")
    one, two = plan_report(config, 3, **kw), plan_report(config, 3, cp=2, **kw)
    kv = 2 * (16 + 16) * 4  # per token: 2 kv heads x (K 16 + V 16) x fp32
    mask = 16 * 4  # per local query, SDPA's additive mask over the 16 keys, in fp32
    for a, b in zip(one.stages, two.stages):
        layers = len(one.plan.stages[a.index].layers)
        saved = layers * ((2 - 1) * kv + mask) * 8  # each layer saves the other rank's K/V of its 8 tokens
        assert b.activation_bytes_per_microbatch - saved == pytest.approx(a.activation_bytes_per_microbatch / 2,
                                                                          abs=64)  # the head's too
        # one layer's whole-sequence dK/dV waits for its reduce-scatter: 16 tokens' K/V
        assert b.activation_bytes == b.in_flight * b.activation_bytes_per_microbatch + 16 * kv
    middle = one.plan.stages[1].layers
    assert one.stages[1].activation_bytes_per_microbatch == sum(measured[i] for i in middle) * 16


def test_under_full_recompute_cp_divides_the_kept_inputs_and_the_recomputed_layer_holds_the_gathered_kv():
    config = tiny_config("llama", num_hidden_layers=6)
    kw = dict(seq_len=16, batch_size=4, microbatches=4, dtype="fp32", activation_checkpointing="full")
    biggest = max(layer_bytes_per_token(config, "fp32"))
    one, four = plan_report(config, 3, **kw), plan_report(config, 3, cp=4, **kw)
    kv, n = 2 * 32 * 4, len(four.plan.stages[1].layers)
    inputs = n * 64 * 4 * 4  # each layer's input (hidden 64, fp32) of 4 tokens a rank
    recompute = (biggest + 3 * kv + 16 * 4) * 4  # one layer again, with the 3 other ranks' K/V and its mask
    def positions(tokens):  # the int64 positions checkpointing keeps, and its scalars
        return 8 * tokens + 64

    assert four.stages[1].activation_bytes == four.stages[1].in_flight * (inputs + positions(4)) + recompute + 16 * kv
    assert one.stages[1].activation_bytes == one.stages[1].in_flight * (inputs * 4 + positions(16)) + biggest * 16


@pytest.mark.parametrize("ac, recomputed", [("none", lambda n: 0), ("full", lambda n: n),
                                            ("selective", lambda n: (n + 1) // 2)])
def test_kv_gathers_are_the_other_ranks_k_and_v_in_forward_backward_and_recompute(ac, recomputed):
    config = tiny_config("llama", num_hidden_layers=4)
    kw = dict(seq_len=16, batch_size=8, microbatches=4, dtype="bf16", activation_checkpointing=ac)
    report = plan_report(config, 2, cp=2, **kw)
    local = 2 * 2 * 8 * (16 + 16) * 2  # 2 sequences x 2 kv heads x 8 tokens a rank x (K + V) x bf16
    for r in report.ranks:
        n = sum(len(s.layers) for s in report.plan.stages_of_rank(r.rank))
        assert r.cp_bytes == 4 * (2 - 1) * local * (2 * n + recomputed(n)) > 0  # 4 microbatches
        assert r.cp_bytes == 4 * kv_gather_bytes(batch=2, seq_len=16, cp=2, kv_heads=2, k_dim=16, v_dim=16,
                                                 dtype_bytes=2, layers=n, recomputed=recomputed(n))
    assert [r.cp_bytes for r in plan_report(config, 2, **kw).ranks] == [0, 0]
    # the planner refuses what the runtime refuses: the one layout validator says so for both
    with pytest.raises(ParallelError, match="--cp 2 with --tp 2"):
        plan_report(config, 2, cp=2, tp=2, **kw)


def test_k_and_v_are_the_kv_heads_after_gqa_and_mla_expanded_per_head(llama8b):
    assert kv_shape(llama8b) == (8, 128, 128) and kv_shape(llama8b, tp=4) == (2, 128, 128)
    mla = tiny_config("deepseek_v3")
    k = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert kv_shape(mla) == (mla.num_attention_heads, k, mla.v_head_dim) == (4, 16, 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_fsdp2_shards_over_dp_times_cp_and_moves_their_shards(dtype):
    config = tiny_config("llama", num_hidden_layers=4)
    kw = dict(seq_len=16, batch_size=4, microbatches=2, dtype=dtype)
    a, b, c = plan_report(config, 2, dp=4, **kw), plan_report(config, 2, dp=2, cp=2, **kw), plan_report(
        config, 2, cp=4, **kw)
    fields = ("weight_bytes", "grad_bytes", "optimizer_bytes", "fsdp_bytes")
    for x, y, z in zip(a.ranks, b.ranks, c.ranks):
        assert [getattr(y, f) for f in fields] == [getattr(x, f) for f in fields] == [getattr(z, f) for f in fields]
        w, g, o = param_bytes(dtype, 4)
        assert (y.weight_bytes, y.grad_bytes, y.optimizer_bytes) == (int(y.params * w), int(y.params * g),
                                                                     int(y.params * o))
        _, compute, grad, _ = fsdp_bytes(dtype)  # one all-gather and one reduce-scatter of 3/4 of them a step
        assert y.fsdp_bytes == pytest.approx(y.params * 3 / 4 * (compute + grad), rel=1e-9)
    assert (a.gpus, b.gpus, c.gpus) == (8, 8, 8)
    assert "FSDP2 over dp 2 x cp 2 = 4 shards" in "\n".join(b.notes)


# -- the fit search -------------------------------------------------------------------------------

def test_the_fit_search_proposes_cp_when_the_sequence_is_what_does_not_fit(llama8b):
    cfg = FinetuneConfig(model="meta-llama/Llama-3.1-8B", dp=8, **LONG_8B)
    assert peak(report_for(llama8b, cfg)) > LIMIT
    found = suggest(llama8b, cfg, LIMIT)
    assert any(set(s.changes) == {"cp"} for s in found if not s.search)  # cp, not more dp
    assert_fits_as_proposed(llama8b, cfg, found)


@pytest.mark.slow  # 11 s on 2 shared CPU cores: without tp, the search bisects pp for every (dp, cp) mesh
def test_the_fewest_gpus_without_tp_for_8b_at_128k_take_cp(llama8b):
    cfg = FinetuneConfig(model="meta-llama/Llama-3.1-8B", **LONG_8B)
    found = fewest_gpus(llama8b, cfg, LIMIT, gpus_per_node=1)
    assert found and all(s.changes.get("cp", 1) > 1 and s.gpus <= 8 for s in found)
    assert_fits_as_proposed(llama8b, cfg, found)


def assert_fits_as_proposed(config, cfg, found):
    for s in found:  # each fits when planned as proposed, on the GPUs and with the bubble it says
        report = report_for(config, dataclasses.replace(cfg, **s.changes))
        assert peak(report) == s.peak <= 0.9 * LIMIT and report.gpus == s.gpus and report.bubble == s.bubble


@pytest.mark.parametrize("seq_len, proposes_cp", [(4096, False), (32768, True)])
def test_the_fit_search_proposes_cp_only_for_long_sequences(seq_len, proposes_cp):
    # below 2 x 8k tokens dp shards as much as cp would and runs more tokens a step (fit.CP_MIN_TOKENS); a model
    # of real width: on hidden 64 the mask attention saves per layer (seq_len per local token) outweighs the rest
    config = tiny_config("llama", num_hidden_layers=4, hidden_size=2048, intermediate_size=7168,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256)
    cfg = FinetuneConfig(model="tiny", seq_len=seq_len, batch_size=2, microbatches=2)
    found = suggest(config, cfg, peak(report_for(config, cfg)) * 2 // 3, gpus_per_node=2)
    assert found and any("cp" in s.changes for s in found) == proposes_cp


# -- bad input ------------------------------------------------------------------------------------

def test_a_sequence_cp_cannot_cut_in_2_cp_chunks_is_refused_in_one_line():
    with pytest.raises(ParallelError, match=r"--seq-len 100 does not split into 8 equal chunks .* for --cp 4; "
                                            r"use a multiple of 8, e.g. 96"):
        plan_report(tiny_config("llama"), 1, cp=4, seq_len=100)
    result = runner.invoke(app, ["plan", "meta-llama/Llama-3.1-8B", "--cp", "4", "--seq-len", "100"])
    assert result.exit_code == 2
    assert error_lines(result.output) == [
        "error: command line: --seq-len 100 does not split into 8 equal chunks (two per cp rank, head and tail) for --cp 4; "
        "use a multiple of 8, e.g. 96"]


@pytest.mark.slow  # 43 s on 2 shared CPU cores: the whole fit search over pp, dp, cp, tp and recompute for a 70B model
def test_the_bare_70b_at_32k_command_proposes_meshes_of_at_most_64_gpus_that_fit():
    result = runner.invoke(app, ["plan", "meta-llama/Llama-3.1-70B", "--seq-len", "32768", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    meshes = result.stdout.split("fewest GPUs that fit, every axis searched")[1].splitlines()[1:]
    gpus = [int(line.split(" GPUs,")[0].rsplit(" ", 1)[1]) for line in meshes if " GPUs, bubble " in line]
    assert gpus and max(gpus) <= 64
    config = load_model_config("meta-llama/Llama-3.1-70B")
    cfg = FinetuneConfig(model="meta-llama/Llama-3.1-70B", seq_len=32768)
    assert_fits_as_proposed(config, cfg, fewest_gpus(config, cfg, LIMIT))
