"""Spec of ``hfpipe plan --tp`` and ``--reshard-per-microbatch`` (the planner's part):
tensor parallelism divides a rank's weights, gradients, AdamW state and activations (with and
without sequence parallelism) and costs collectives; FSDP2 resharded per microbatch divides the
step's gathered weights and whole gradients by dp and costs an all-gather and reduce-scatter per
microbatch; the fit search proposes tp and that option; and the issue's two bars hold.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from typer.testing import CliRunner

from hfpipe.cli.main import app
from hfpipe.config.run import FinetuneConfig
from hfpipe.config.run import bundled_config_dir
from hfpipe.plan.activations import layer_bytes_per_token, layer_layouts
from hfpipe.plan.cost import layer_costs
from hfpipe.plan.fit import fewest_gpus, parse_memory, report_for, suggest
from hfpipe.plan.memory import fsdp_bytes, param_bytes
from hfpipe.plan.report import load_model_config, plan_report
from hfpipe.tiny import tiny_config
from _trust import error_lines

GIB = 2**30
runner = CliRunner()


def peak(report) -> int:
    return max(r.total_bytes for r in report.ranks)


def test_the_issues_70b_plan_fits_80gb_at_tp8_with_a_bubble_under_15_percent():
    result = runner.invoke(app, ["plan", "meta-llama/Llama-3.1-70B", "--pp", "4", "--tp", "8", "--microbatches",
                                 "32", "--batch-size", "32", "--seq-len", "4096", "--dtype", "bf16-mixed",
                                 "--activation-checkpointing", "full", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 80.0 GiB (32 GPUs)" in result.stdout
    assert "bubble 8.6% of each step idle" in result.stdout
    report = plan_report(load_model_config("meta-llama/Llama-3.1-70B"), 4, tp=8, microbatches=32, batch_size=32,
                         seq_len=4096, dtype="bf16-mixed", activation_checkpointing="full")
    assert report.bubble < 0.15 and peak(report) < 0.9 * 80 * GIB and report.gpus == 32


def test_the_issues_405b_config_fits_128_gpus_of_80gb_on_a_mesh_the_fit_search_proposes():
    path = bundled_config_dir("meta-llama/Llama-3.1-405B") / "config.json"
    config = load_model_config(str(path))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (16384, 126, 128, 8, 53248, 128256)
    cfg = FinetuneConfig(model=str(path), pp=16, microbatches=128, batch_size=128, seq_len=8192,
                         dtype="bf16-mixed", activation_checkpointing="full")
    limit = parse_memory("80GB")
    assert peak(report_for(config, cfg)) > limit
    proposed = [s for s in suggest(config, cfg, limit) if s.changes.get("tp") and s.gpus <= 128]
    assert proposed and {"tp": 8} in [s.changes for s in proposed]
    for s in proposed:  # each fits when planned as proposed
        report = report_for(config, dataclasses.replace(cfg, **s.changes))
        assert peak(report) == s.peak <= 0.9 * limit and report.gpus == s.gpus and report.bubble == s.bubble
    result = runner.invoke(app, ["plan", str(path), "--pp", "16", "--tp", "8", "--microbatches", "128",
                                 "--batch-size", "128", "--seq-len", "8192", "--dtype", "bf16-mixed",
                                 "--activation-checkpointing", "full", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    assert "fits: every rank within 80.0 GiB (128 GPUs)" in result.stdout


def test_the_fit_search_proposes_tp_for_405b_from_a_single_gpu():
    config = load_model_config("meta-llama/Llama-3.1-405B")
    cfg = FinetuneConfig(model="meta-llama/Llama-3.1-405B", microbatches=64, batch_size=64, seq_len=8192,
                         dtype="bf16-mixed", activation_checkpointing="full")
    found = fewest_gpus(config, cfg, parse_memory("80GB"))
    assert found and all(s.search and s.changes["tp"] == 8 and s.gpus <= 128 for s in found)
    assert found == sorted(found, key=lambda s: (s.gpus, s.bubble, s.peak))
    eight = fewest_gpus(config, cfg, parse_memory("80GB"), gpus_per_node=4)
    assert all(s.changes["tp"] <= 4 for s in eight)  # tp stays inside a node


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed", "bf16"])
def test_tp2_halves_weights_grads_and_adamw_but_keeps_the_norms_whole(dtype):
    config = tiny_config("llama", num_hidden_layers=4)
    costs = layer_costs(config, 16)
    one, two = (plan_report(config, 2, seq_len=16, dtype=dtype, tp=t) for t in (1, 2))
    for a, b in zip(one.ranks, two.ranks):
        whole = sum(costs.layer_replicated_params[i] for s in one.plan.stages_of_rank(a.rank) for i in s.layers)
        whole += costs.head_replicated_params * any(s.head for s in one.plan.stages_of_rank(a.rank))
        layers = sum(len(s.layers) for s in one.plan.stages_of_rank(a.rank))
        head = any(s.head for s in one.plan.stages_of_rank(a.rank))
        assert whole == (2 * layers + head) * config.hidden_size  # two RMSNorms a layer, the final norm
        assert b.params == (a.params - whole) // 2 + whole
        share = b.params / a.params
        for field in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            assert getattr(b, field) == int(getattr(a, field) * share)
    big = [plan_report(load_model_config("meta-llama/Llama-3.1-8B"), 2, seq_len=4096, tp=t) for t in (1, 2)]
    for a, b in zip(big[0].ranks, big[1].ranks):  # the norms are a rounding error on a real model
        assert b.weight_bytes == pytest.approx(a.weight_bytes / 2, rel=1e-4)
        assert b.optimizer_bytes == pytest.approx(a.optimizer_bytes / 2, rel=1e-4)


def test_activations_split_as_the_tp_plan_leaves_each_saved_tensor_on_a_rank():
    """Each saved tensor is tagged by how the runtime's tp plan holds it (hfpipe.plan.layouts): the inputs
    a block gathers for its column-split projections (attention's and the MLP's, h each) and the rotary
    tables (head_dim each of cos and sin) are whole on every rank; the norms' and the residual stream's split
    over the sequence only with sequence parallelism; the rest (heads, the MLP's intermediate) over tp."""
    config = tiny_config("llama", num_hidden_layers=6)  # hidden 64, head_dim 16
    kw = dict(seq_len=16, batch_size=4, microbatches=4, dtype="fp32")
    measured = layer_bytes_per_token(config, "fp32")
    layouts = layer_layouts(config, "fp32")
    whole, seq, split = layouts[0]
    assert whole == (2 * 64 + 2 * 16) * 4 and seq > 0 and split > 0
    assert [sum(held) for held in layouts] == list(measured)  # tags split the bytes, they add none
    one, sp, no_sp = (plan_report(config, 3, tp=t, sequence_parallel=s, **kw)
                      for t, s in ((1, True), (2, True), (2, False)))
    middle = 1  # layers only: no embedding, no head
    layers = one.plan.stages[middle].layers
    assert one.stages[middle].activation_bytes_per_microbatch == sum(measured[i] for i in layers) * 16
    assert sp.stages[middle].activation_bytes_per_microbatch == len(layers) * int(whole + (seq + split) / 2) * 16
    assert no_sp.stages[middle].activation_bytes_per_microbatch == len(layers) * int(whole + seq + split / 2) * 16
    assert sp.sequence_parallel and not no_sp.sequence_parallel and not one.sequence_parallel
    # under full recompute a layer keeps its input: a residual, split only over the sequence
    full = [plan_report(config, 3, tp=t, sequence_parallel=s, activation_checkpointing="full", **kw)
            for t, s in ((1, True), (2, True), (2, False))]
    kept = [r.stages[middle].activation_bytes_per_microbatch for r in full]
    positions = 8 * 16 + 64  # the int64 positions checkpointing keeps (whole on every tp rank), and scalars
    assert kept == [len(layers) * 16 * 64 * 4 + positions, len(layers) * 16 * 64 * 4 // 2 + positions,
                    len(layers) * 16 * 64 * 4 + positions]


def test_a_lora_adapter_keeps_its_fp32_copy_of_the_gathered_input_whole_on_every_tp_rank():
    # measured 0.86x of a tp2 LoRA run when the adapters' bytes were divided by tp like the rest
    config = tiny_config("llama", num_hidden_layers=2)  # hidden 64, head_dim 16
    copies, rotary = 5 * 64 * 4, 2 * 16 * 2  # q, k, v, gate, up each cast the block's gathered bf16 input
    lora_b_inputs = 7 * 4  # every adapter's lora_A output (r 4); the frozen bases keep no input
    assert layer_layouts(config, "bf16", (4, "all-linear"))[0][0] == copies + rotary + lora_b_inputs * 4
    # FSDP2 (dp x cp > 1) runs the adapters in bf16: they save the gathered input itself, once per block
    gathered = 2 * 64 * 2
    assert layer_layouts(config, "bf16", (4, "all-linear"), fsdp=True)[0][0] == gathered + rotary + lora_b_inputs * 2


@pytest.mark.parametrize("ac, recomputed", [("none", lambda n: 0), ("full", lambda n: n),
                                            ("selective", lambda n: (n + 1) // 2)])
def test_tp_collectives_are_priced_as_the_runtime_issues_them(ac, recomputed):
    """Per layer and microbatch, in all-reduces of the hidden states, Megatron's count: 2 forward, 2 backward
    (one input-gradient sum per block, shared by q, k, v and by gate, up; under sequence parallelism
    all-gathers and reduce-scatters of the same bytes); a recomputed layer's forward again; the embedding, each stage's boundary gathers, the head and the loss's 3 fp32 per token;
    once per step the two norms' partial gradients of each layer and clipping's fp32 norm (the count
    bench/tp.py and tests/plan/test_plan_tensor_measured.py measure at torch's dispatcher)."""
    config = tiny_config("llama", num_hidden_layers=4)  # hidden 64
    kw = dict(seq_len=16, batch_size=8, microbatches=4, dtype="bf16", activation_checkpointing=ac)
    report = plan_report(config, 2, tp=2, **kw)
    tokens, hidden, act = 2 * 16, 64, 2  # 2 sequences of 16 tokens per microbatch, bf16
    one = 2 * (2 - 1) / 2 * tokens * hidden * act  # a ring all-reduce: bytes each rank moves
    for r in report.ranks:
        (stage,) = report.plan.stages_of_rank(r.rank)
        n = len(stage.layers)
        edges = stage.embed + stage.head + 0.5 + 0.5 * (not stage.embed)
        loss = 3 * 2 * (2 - 1) / 2 * tokens * 4 * stage.head
        norms = 2 * (2 - 1) / 2 * (n * 2 * hidden * 2 + 4)  # once per step, bf16 gradients; the fp32 grad norm
        assert r.tp_bytes == int(((4 * n + 2 * recomputed(n) + edges) * one + loss) * 4 + norms)
    assert [r.tp_bytes for r in plan_report(config, 2, **kw).ranks] == [0, 0]


def test_resharding_per_microbatch_divides_weights_and_grads_by_dp_and_prices_its_traffic():
    config = tiny_config("llama", num_hidden_layers=4)
    kw = dict(seq_len=16, batch_size=4, microbatches=4, dtype="bf16-mixed")
    step, micro = (plan_report(config, 2, dp=4, reshard_per_microbatch=r, **kw) for r in (False, True))
    costs = layer_costs(config, 16)
    master, compute, grad, adamw = fsdp_bytes("bf16-mixed")
    assert param_bytes("bf16-mixed", 4, reshard=True) == (master / 4 + compute / 4, grad / 4, adamw / 4)
    for r, s in zip(micro.ranks, step.ranks):
        stage = micro.plan.stages_of_rank(r.rank)[0]
        unit = (costs.embed_params * stage.embed + costs.head_params * stage.head
                + max(costs.layer_params[i] for i in stage.layers))  # the one unit FSDP2 holds gathered
        assert r.weight_bytes == int(int(r.params * (master / 4 + compute / 4)) + unit * compute)
        assert r.grad_bytes == int(int(r.params * grad / 4) + unit * grad)
        assert r.optimizer_bytes == s.optimizer_bytes and r.weight_bytes < s.weight_bytes
        moved = r.params * 3 / 4  # (dp - 1) / dp of the rank's parameters, each way
        # the last stage's root (norm, head) stays gathered from forward to backward: one all-gather
        kept = (costs.head_params + costs.embed_params * stage.embed) * stage.head * 3 / 4
        # per microbatch: 2 all-gathers + 1 RS
        assert r.fsdp_bytes == int(4 * (moved * (2 * compute + grad) - kept * compute))
        assert s.fsdp_bytes == int(moved * (compute + grad))  # per step: 1 all-gather + 1 reduce-scatter
    text = "\n".join(micro.notes)
    assert "FSDP2 resharded per microbatch" in text and "once per step" in text


def test_the_fit_search_proposes_resharding_when_dp_alone_cannot_fit():
    config, cfg = load_model_config("meta-llama/Llama-3.1-70B"), FinetuneConfig(
        model="meta-llama/Llama-3.1-70B", pp=4, microbatches=32, batch_size=32, seq_len=4096,
        dtype="bf16-mixed", activation_checkpointing="full")
    limit = parse_memory("80GB")
    found = [s.changes for s in suggest(config, cfg, limit, gpus_per_node=1) if not s.search]
    reshard = [c for c in found if c.get("reshard_per_microbatch")]
    assert reshard and not [c for c in found if "tp" in c]  # no tp over a 1-GPU node
    dp = reshard[0]["dp"]
    assert peak(report_for(config, dataclasses.replace(cfg, dp=dp))) > 0.9 * limit  # dp alone does not


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3), "--tp 3: llama has num_attention_heads=4, which 3 tp ranks cannot split evenly; "
                 "the --tp this model takes: 1, 2"),
    (dict(tp=4), "--tp 4: llama has num_key_value_heads=2, which 4 tp ranks cannot split evenly; "
                 "the --tp this model takes: 1, 2"),
    (dict(reshard_per_microbatch=True), "--reshard-per-microbatch shards over the data-parallel ranks"),
    (dict(dp=2, reshard_per_microbatch=True, lora_rank=8), "--reshard-per-microbatch prices full fine-tuning"),
    (dict(tp=0), "--tp must be >= 1"),
])
def test_a_tp_the_heads_cannot_split_is_refused_in_one_line(kwargs, match):
    with pytest.raises(Exception, match=match) as e:
        plan_report(tiny_config("llama"), 2, seq_len=16, **kwargs)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_bad_tp_gets_one_line_and_exit_2_from_the_cli(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    result = runner.invoke(app, ["plan", str(tmp_path), "--pp", "2", "--seq-len", "16", "--tp", "4"])
    assert result.exit_code == 2, result.output
    assert "num_key_value_heads=2, which 4 tp ranks" in result.output and "Traceback" not in result.output
    assert len(error_lines(result.output)) == 1


def test_plan_and_finetune_refuse_heads_with_one_rule():
    """The heads rule is the runtime's (hfpipe.parallel.tensor_plan via check_layout): plan gives its message."""
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    with pytest.raises(ParallelError) as run:
        check_layout(ParallelDims(pp=2, tp=3), model_config=tiny_config("llama"))
    with pytest.raises(ParallelError) as plan:
        plan_report(tiny_config("llama"), 2, seq_len=16, tp=3)
    assert str(run.value) == str(plan.value)


def test_the_plan_prices_tp_traffic_for_the_sequence_parallel_setting_it_runs():
    """Sequence parallelism moves a layer's bytes as all-gathers and reduce-scatters, and more at a stage's
    ends (the gather after its last layer) and once a step (the norms' partial gradients)."""
    from hfpipe.plan.tensor import tp_traffic

    config = tiny_config("llama", num_hidden_layers=4)
    kw = dict(tp=2, seq_len=16, batch_size=4, microbatches=2, dtype="fp32")
    with_sp, without = (plan_report(config, 2, sequence_parallel=sp, **kw) for sp in (True, False))
    assert all(a.tp_bytes > b.tp_bytes > 0 for a, b in zip(with_sp.ranks, without.ranks))
    costs = layer_costs(config, 16)
    for report, sp in ((with_sp, True), (without, False)):
        assert [r.tp_bytes for r in report.ranks] == list(tp_traffic(
            report.plan, costs, config, 2, 2, 2 * 16, "fp32", "none", sequence_parallel=sp))


def _one_rank_traffic(config, sp: bool, dtype: str = "bf16", **kw) -> tuple[int, float, float]:
    """(planned tp bytes of a pp 1 x tp 2 run, a ring all-reduce's factor x tokens x microbatches, the
    same per step) for 2 microbatches of 2 x 16 tokens."""
    report = plan_report(config, 1, tp=2, seq_len=16, batch_size=4, microbatches=2, dtype=dtype,
                         sequence_parallel=sp, **kw)
    return report.ranks[0].tp_bytes, 2 * (2 - 1) / 2 * 32 * 2, 2 * (2 - 1) / 2


@pytest.mark.parametrize("sp", [True, False])
def test_a_qwen3_moe_layer_is_priced_by_its_experts_sum_and_head_norms(sp):
    """Hand count per layer and token, bf16 (2 bytes), h = 64: attention as Llama's (o_proj sums h
    forward; q, k, v share one input sum, h, backward); the experts, split along their intermediate size,
    sum their partial outputs (h) forward, and backward the block's input gradient (h, which the router
    and the experts share) and the top-k weights' (2 in bf16: Qwen3-MoE's router casts them back); under
    SP the MoE block gathers its input (h / 2) and cuts its whole output to this rank's tokens; backward
    the input's reduce-scatter and the cut's gather are h together. Per step: the partial gradients of q_norm and k_norm (head_dim 16
    each) and, under SP, of the two layer norms (2 h); and clipping's fp32 gradient norm."""
    config = tiny_config("qwen3_moe", num_hidden_layers=2)
    h = 64
    per_layer = (2 * h + (h / 2 if sp else 0)) + (2 * h + 2)
    edges = 2 * h + 12 / 2 + (h / 2 if sp else 0)  # embedding + head (bf16), the loss's 3 fp32, the gather
    partial = 2 * (2 * 16 + (2 * h if sp else 0)) * 2 + 4  # 2 layers, bf16 gradients; the fp32 grad norm
    got, mb, step = _one_rank_traffic(config, sp)
    assert got == int(mb * 2 * (2 * per_layer + edges) + step * partial)


@pytest.mark.parametrize("sp", [True, False])
def test_deepseek_v3_layers_are_priced_by_mla_latents_shared_experts_and_dense_first_layers(sp):
    """Hand count per token, bf16, h = 64. MLA's column-split projections read latents, not the hidden
    states: q_b_proj (q_lora_rank 32), kv_b_proj (kv_lora_rank 16) and the rope key's gradient summed by
    _MlaKvA (qk_rope_head_dim 8): 56 backward (under SP + h / 2, o_proj's scatter gathered back); o_proj
    sums h forward. The first_k_dense_replace = 2 dense layers: an MLP as Llama's (h forward, one input
    sum h backward). A MoE layer: routed experts (h forward) and shared experts (down_proj h forward);
    backward the block's one input sum h (router, routed and shared experts share it; under SP a
    reduce-scatter and the cut's gather) and 2 fp32 top-k weights = 4 bf16 elements (DeepSeek-V3's router
    runs in fp32); under SP the block gathers its input (h / 2) forward."""
    config = tiny_config("deepseek_v3", num_hidden_layers=4)
    assert config.first_k_dense_replace == 2
    h, mla = 64, 32 + 16 + 8
    dense = 2 * h + mla + h + (h / 2 if sp else 0)
    moe = 3 * h + (h / 2 if sp else 0) + mla + h + 4 + (h / 2 if sp else 0)
    edges = 2 * h + 12 / 2 + (h / 2 if sp else 0)
    partial = 4 * (2 * h if sp else 0) * 2 + 4  # the layer norms' partial gradients under SP, bf16; the norm
    got, mb, step = _one_rank_traffic(config, sp)
    assert got == int(mb * 2 * (2 * dense + 2 * moe + edges) + step * partial)


def test_with_ep_the_experts_stay_whole_over_tp_and_gather_their_outputs():
    """tp x ep (experts not split over tp, tokens sliced over tp and the
    experts' outputs all-gathered back): per MoE layer an all-gather of h / 2 forward, and backward the
    gathers of the token slice's gradients (h / 2 and the top-k weights' top_k / 2), instead of the
    experts' two all-reduces and the top-k weights'; a rank's routed experts are its 1 / ep, whole over tp
    (the counts are measured in tests/plan/test_plan_tensor_measured.py)."""
    import hfpipe.plan.tensor as tensor

    config = tiny_config("qwen3_moe", num_hidden_layers=2)
    costs = layer_costs(config, 16)
    plan = plan_report(config, 1, seq_len=16).plan
    kw = dict(sequence_parallel=False)
    split, whole = (tensor.tp_traffic(plan, costs, config, 2, 1, 32, "bf16", "none", ep=e, **kw)[0] for e in (1, 2))
    h = 64  # a ring all-reduce over 2 ranks moves its size once; 32 tokens, bf16, 2 layers
    assert split - whole == 32 * 2 * 2 * ((h + h + 2) - (h / 2 + h / 2 + 2 / 2))
    (rank,) = plan_report(config, 1, seq_len=16, dp=2).ranks
    routed, whole = sum(costs.layer_routed_params), sum(costs.layer_replicated_params) + costs.head_replicated_params
    (cut,) = plan_report(config, 1, seq_len=16, dp=2, ep=2, tp=2).ranks
    assert cut.params == (rank.params - routed - whole) // 2 + whole + routed // 2


def test_the_fit_search_proposes_tp_for_a_deepseek_v3_moe_priced_by_its_own_collectives():
    """DeepSeek-V3's layers (MLA, 1 shared + routed experts, 3 dense first layers) cut to 32 layers of 16
    experts (~37B): at pp 4 it does not fit 80 GB; the search proposes tp, and the plan it prices counts
    MLA's and the experts' collectives, not a dense layer's. (The whole 671B model needs ep, and under ep
    tp leaves the experts whole, so there the search proposes dp x ep, and the runtime refuses tp x ep today.)"""
    from hfpipe.plan.tensor import tp_traffic

    config = copy.deepcopy(load_model_config("deepseek-ai/DeepSeek-V3"))
    config.n_routed_experts, config.num_hidden_layers = 16, 32
    cfg = FinetuneConfig(model="deepseek-ai/DeepSeek-V3", pp=4, microbatches=16, batch_size=16, seq_len=4096,
                         dtype="bf16-mixed", activation_checkpointing="full")
    limit = parse_memory("80GB")
    assert peak(report_for(config, cfg)) > limit
    proposed = [s for s in suggest(config, cfg, limit) if s.changes.get("tp", 1) > 1]
    assert {"tp": 4} in [s.changes for s in proposed]
    report = report_for(config, dataclasses.replace(cfg, tp=4))
    assert peak(report) <= 0.9 * limit and report.tp == 4 and report.sequence_parallel
    costs, tokens = layer_costs(config, 4096), 4096
    planned = tp_traffic(report.plan, costs, config, 4, 16, tokens, "bf16-mixed", "full")
    assert [r.tp_bytes for r in report.ranks] == list(planned)
    # per MoE layer and token (bf16, h = 7168; SP): forward o_proj h, experts h, shared experts h, the MoE
    # input's gather h / 2, once more recomputed; backward MLA's latents (1536 + 512 + 64) and o_proj's
    # gathered gradient h / 2, the block's one input sum h (a reduce-scatter and the cut's gather), 8 fp32
    # top-k weights
    h = 7168
    moe = 2 * 3.5 * h + (1536 + 512 + 64) + h / 2 + h + 16
    mid = report.plan.stages_of_rank(1)[0]
    assert not mid.embed and not mid.head and all(costs.is_moe[i] for i in mid.layers)
    per_step = len(mid.layers) * 2 * h * 4 + 4  # the layer norms' partial fp32 gradients under SP, the norm
    edges = h / 2 + h / 2  # the scatter before its first layer, the gather after its last
    assert planned[1] == int(2 * 3 / 4 * (tokens * 16 * 2 * (len(mid.layers) * moe + edges) + per_step))
