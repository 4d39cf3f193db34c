"""Spec of ``hfpipe plan --ep`` and ``--quantize-base``: what each rank holds and sends.

Expert parallelism: a rank keeps ``1/ep`` of its layers' routed experts, FSDP2-sharded over the
``dp/ep`` ranks holding the same experts; everything else as without ep. All-to-all bytes per step
are the analytic count. A quantized LoRA base: NF4 at 0.5 B + double-quantized absmaxes, FP8 at
1 B + a scale per 128x128 tile; the embedding, head, norms and routers stay in the run's dtype.
The oracle for every count is the transformers model's own parameters, counted here by name.
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from hfpipe.cli.main import app
from hfpipe.plan.report import load_model_config, param_bytes, plan_report
from hfpipe.errors import ParallelError
from hfpipe.plan.split import plan_pipeline
from hfpipe.tiny import tiny_config
from _trust import error_lines

GIB = 2**30
runner = CliRunner()


def meta_params(config) -> dict[str, torch.Size]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: p.shape for n, p in model.named_parameters()}


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def on_rank(plan, rank: int) -> set[int]:
    return {i for s in plan.stages_of_rank(rank) for i in s.layers}


def test_ep_cuts_each_ranks_routed_experts_and_shards_them_over_dp_over_ep():
    config = tiny_config("deepseek_v3")  # 6 layers, 1 dense, 8 routed experts of which 2 per token
    plan_kw = dict(pp=2, dp=4, seq_len=32, batch_size=4, microbatches=4, dtype="bf16-mixed")
    base, ep = plan_report(config, **plan_kw), plan_report(config, ep=2, **plan_kw)
    shapes = meta_params(config)
    for b, e in zip(base.ranks, ep.ranks):
        layers = on_rank(ep.plan, e.rank)
        routed = sum(math.prod(s) for n, s in shapes.items()
                     if layer_of(n) in layers and ".mlp.experts." in n)
        assert routed > 0
        assert e.params == b.params - routed + routed // 2
        w_dp, w_edp = param_bytes("bf16-mixed", 4), param_bytes("bf16-mixed", 2)  # dp 4, dp/ep 2
        other = b.params - routed
        assert e.weight_bytes == int(other * w_dp[0] + routed // 2 * w_edp[0])
        assert e.grad_bytes == int(other * w_dp[1] + routed // 2 * w_edp[1])
        assert e.optimizer_bytes == int(other * w_dp[2] + routed // 2 * w_edp[2])
        # as many token copies reach a rank's experts, through transformers' all-to-all dispatch (measured
        # through it: hfpipe.plan.dispatch), which keeps about what the one-process experts keep
        assert e.activation_bytes == pytest.approx(b.activation_bytes, rel=0.05)
    assert "ep 2, 4 of 8 routed experts per rank" in "\n".join(ep.notes)


@pytest.mark.parametrize("ac, again", [("none", 0), ("full", 2)])
def test_all_to_all_bytes_are_four_per_moe_layer_and_microbatch_plus_recompute(ac, again):
    config = tiny_config("deepseek_v3")
    r = plan_report(config, pp=2, dp=4, ep=4, seq_len=32, batch_size=8, microbatches=4,
                    dtype="bf16-mixed", activation_checkpointing=ac)
    one = 2 * 32 * 2 * config.hidden_size * 2 * 3 / 4  # tokens x top_k x hidden x bf16 x (ep-1)/ep
    for rank in r.ranks:
        moe = [i for i in on_rank(r.plan, rank.rank) if i >= config.first_k_dense_replace]
        assert rank.all_to_all_bytes == int((4 + again) * len(moe) * one * 4)


def test_a_dense_model_or_an_ep_not_dividing_the_experts_is_refused():
    with pytest.raises(ParallelError, match=r"--ep 2: llama is a dense model .*leave out --ep"):
        plan_report(tiny_config("llama"), pp=2, dp=2, ep=2, seq_len=16)
    with pytest.raises(ParallelError, match=r"--ep 3 must divide the 8 routed experts .*use one of 2, 4, 8"):
        plan_report(tiny_config("deepseek_v3"), pp=2, dp=3, ep=3, seq_len=16)
    with pytest.raises(ParallelError, match=r"--ep \(4\) must divide --dp \(2\)"):
        plan_report(tiny_config("deepseek_v3"), pp=2, dp=2, ep=4, seq_len=16)


@pytest.mark.parametrize("kind, args, message", [
    ("llama", ["--ep", "2", "--dp", "2"], "is a dense model"),
    ("deepseek_v3", ["--ep", "3", "--dp", "3"], "must divide the 8 routed experts"),
    ("llama", ["--quantize-base", "nf4"], "add --lora-rank"),
])
def test_bad_ep_and_quantize_base_get_one_line_and_exit_2(tmp_path, kind, args, message):
    tiny_config(kind).save_pretrained(tmp_path)
    result = runner.invoke(app, ["plan", str(tmp_path), "--pp", "2", "--seq-len", "16", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(error_lines(result.output)) == 1


def quantized_params(config) -> tuple[int, int, int]:
    """(linear weights in decoder layers bar routers, their 128x128 tiles, largest), by name."""
    n = tiles = largest = 0
    for name, shape in meta_params(config).items():
        if layer_of(name) is None or not name.endswith("weight") or len(shape) != 2:
            continue
        if "norm" in name or name.endswith("mlp.gate.weight"):
            continue
        n += math.prod(shape)
        tiles += math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
        largest = max(largest, math.prod(shape))
    return n, tiles, largest


@pytest.mark.parametrize("kind, per_param", [("nf4", 0.5 + 1 / 64 + 4 / (64 * 256)), ("fp8", 1.0)])
def test_a_quantized_base_prices_its_linears_by_kind_and_the_rest_in_the_run_dtype(kind, per_param):
    config = tiny_config("llama", num_hidden_layers=2)  # one layer per rank at pp 2
    kw = dict(pp=2, seq_len=16, dtype="bf16", lora_rank=8)
    plain, quant = plan_report(config, **kw), plan_report(config, quantize_base=kind, **kw)
    n, tiles, largest = quantized_params(tiny_config("llama", num_hidden_layers=1))  # per layer
    for p, q in zip(plain.ranks, quant.ranks):
        want = p.weight_bytes - 2 * n + n * per_param + (4 * tiles if kind == "fp8" else 0)
        assert q.weight_bytes == pytest.approx(want, abs=2)
        assert q.transient_bytes == 2 * largest * 2  # the largest linear in bf16, twice
        assert (q.grad_bytes, q.optimizer_bytes) == (p.grad_bytes, p.optimizer_bytes)
        assert q.total_bytes == q.weight_bytes + q.grad_bytes + q.optimizer_bytes + q.activation_bytes - q.apart_bytes \
            + q.transient_bytes


def test_a_layout_stage_of_only_mtp_costs_nothing_and_is_named_idle():
    config = tiny_config("deepseek_v3")
    apart = plan_pipeline(config, 3, layout="Et*3|t*3|mL")
    folded = plan_pipeline(config, 3, layout="Et*3|t*2|t,mL")
    alone = plan_pipeline(config, 4, layout="Et*3|t*3|m|L")
    assert apart.stages[2].cost == plan_pipeline(config, 3, layout="Et*3|t*3|L").stages[2].cost
    assert alone.stages[2].cost == 0.0 and folded.stages[2].mtp == (6,)
    report = plan_report(config, 4, layout="Et*3|t*3|m|L", seq_len=16)
    assert any("rank 2 runs nothing" in line for line in report.notes)
    assert "mtp 6 (skipped)" in report.stages[2].holds


ISSUE_17 = ("deepseek-ai/DeepSeek-V3 --pp 8 --dp 32 --ep 32 --microbatches 64 --batch-size 64 --seq-len 4096 "
            "--dtype bf16-mixed --activation-checkpointing full --gpu-memory 80GB")
ISSUE_18 = ("deepseek-ai/DeepSeek-V3 --lora-rank 16 --quantize-base fp8 --pp 2 --dp 4 --ep 4 --microbatches 8 "
            "--batch-size 8 --seq-len 4096 --dtype bf16 --activation-checkpointing full --gpu-memory 141GB")


def test_the_issues_deepseek_v3_ep_plan_fits_80gb_at_256_gpus_with_a_small_bubble():
    result = runner.invoke(app, ["plan", *ISSUE_17.split()])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 80.0 GiB (256 GPUs)" in result.output
    config = load_model_config("deepseek-ai/DeepSeek-V3")
    r = plan_report(config, 8, dp=32, ep=32, microbatches=64, batch_size=64, seq_len=4096,
                    dtype="bf16-mixed", activation_checkpointing="full")
    assert max(k.total_bytes for k in r.ranks) <= 0.9 * 80 * GIB  # not even tight
    assert r.bubble <= 0.15 and r.plan.pp * r.dp == 256


def test_the_issues_deepseek_v3_fp8_lora_plan_fits_one_node_of_141gb():
    result = runner.invoke(app, ["plan", *ISSUE_18.split()])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 141.0 GiB (8 GPUs)" in result.output
    config = load_model_config("deepseek-ai/DeepSeek-V3")
    r = plan_report(config, 2, dp=4, ep=4, microbatches=8, batch_size=8, seq_len=4096, dtype="bf16",
                    activation_checkpointing="full", lora_rank=16, quantize_base="fp8")
    # the experts dominate: ~30 MoE layers x 256 experts x 44M parameters / ep 4, at ~1 byte each
    assert all(70 * GIB < k.weight_bytes < 100 * GIB for k in r.ranks)


def test_a_moe_plan_that_does_not_fit_is_told_to_shard_its_experts():
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.plan.fit import report_for, suggest

    config = load_model_config("deepseek-ai/DeepSeek-V3")
    cfg = FinetuneConfig(model="deepseek-ai/DeepSeek-V3", pp=8, dp=32, microbatches=64, batch_size=64,
                         seq_len=4096, dtype="bf16-mixed", activation_checkpointing="full")
    assert max(r.total_bytes for r in report_for(config, cfg).ranks) > 80 * GIB
    found = suggest(config, cfg, 80 * GIB)
    assert found[0].changes == {"ep": 32} and found[0].gpus == 256
    assert all(s.peak <= 0.9 * 80 * GIB for s in found)
    dense = suggest(tiny_config("llama"), FinetuneConfig(model="x", pp=2, seq_len=64), 2**20)
    assert not [s for s in dense if "ep" in s.changes]  # never for a dense model


def test_a_lora_run_with_ep_holds_its_share_of_the_frozen_experts():
    config = tiny_config("deepseek_v3")
    kw = dict(pp=2, dp=4, seq_len=32, batch_size=4, microbatches=4, dtype="bf16", lora_rank=8)
    plain, ep = plan_report(config, **kw), plan_report(config, ep=2, **kw)
    shapes = meta_params(config)
    w_dp, w_edp = param_bytes("bf16", 4)[0], param_bytes("bf16", 2)[0]
    for p, e in zip(plain.ranks, ep.ranks):
        routed = sum(math.prod(s) for n, s in shapes.items()
                     if layer_of(n) in on_rank(ep.plan, e.rank) and ".mlp.experts." in n)
        adapters = p.weight_bytes - int(p.params * w_dp)
        assert e.weight_bytes == pytest.approx((p.params - routed) * w_dp + routed // 2 * w_edp + adapters, abs=2)
        assert (e.grad_bytes, e.optimizer_bytes) == (p.grad_bytes, p.optimizer_bytes)  # adapters only
        assert e.transient_bytes == 0


def test_under_tp_the_experts_stay_whole_on_each_tp_rank_and_shard_over_dp_over_ep_times_tp():
    """tp 2 x ep 4 at dp 4: each tp rank holds its E / ep experts whole (the runtime's AllToAllEP gives each tp
    rank a slice of the tokens instead), FSDP2 shards them over dp / ep x tp = 2; the rest is cut by tp and
    sharded over dp 4 as without ep; each tp rank dispatches half of its replica's tokens."""
    from hfpipe.plan.cost import layer_costs

    config = tiny_config("deepseek_v3")
    kw = dict(pp=2, dp=4, ep=4, seq_len=32, batch_size=4, microbatches=4, dtype="bf16-mixed")
    base, one, two = plan_report(config, **{**kw, "ep": 1}), plan_report(config, **kw), plan_report(config, tp=2, **kw)
    costs, shapes = layer_costs(config, 32), meta_params(config)
    for b, e1, e2 in zip(base.ranks, one.ranks, two.ranks):
        layers = on_rank(two.plan, e2.rank)
        routed = sum(math.prod(s) for n, s in shapes.items() if layer_of(n) in layers and ".mlp.experts." in n)
        held, other = routed // 4, b.params - routed
        whole = sum(costs.layer_replicated_params[i] for i in layers)
        whole += costs.head_replicated_params * any(s.head for s in two.plan.stages_of_rank(e2.rank))
        cut = (other - whole) // 2 + whole
        assert e2.params == cut + held
        dense, experts = param_bytes("bf16-mixed", 4), param_bytes("bf16-mixed", 2)  # dp 4; dp / ep x tp = 2
        for i, field in enumerate(("weight_bytes", "grad_bytes", "optimizer_bytes")):
            want = other * dense[i] * cut / other + held * experts[i]
            assert getattr(e2, field) == pytest.approx(want, abs=2), field
        assert e2.all_to_all_bytes == pytest.approx(e1.all_to_all_bytes / 2, abs=1)
    assert "2 of 8 routed experts per rank per MoE layer (whole on each of the 2 tp ranks" in "\n".join(two.notes)
    assert "FSDP2 over the 2 ranks holding the same experts" in "\n".join(two.notes)
    assert "tp 2, every matrix but the routed experts', the embedding" in "\n".join(two.notes)
