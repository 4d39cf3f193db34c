"""Spec of hfpipe.plan.split: how a model is split into pipeline stages, and why.

Everything here is pure: transformers configs in, plans out. Big models (Llama-3.1-70B,
DeepSeek-V3 671B) are planned from their configs alone; the cost model builds them on the meta
device, so no weights are made.
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
from transformers import DeepseekV3Config, LlamaConfig

from hfpipe.errors import ParallelError
from hfpipe.plan.split import (
    SCHEDULES,
    PlanError,
    balanced_partition,
    bubble_fraction,
    layer_costs,
    parse_layout,
    plan_pipeline,
)
from hfpipe.tiny import TINY_KINDS, tiny_config

MEGATRON_V3_LAYOUT = "Et*3|(tt|)*29,m|L"  # Megatron's DeepSeek-V3 example: 32 stages


def llama_70b():
    return LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)


@pytest.fixture(scope="module")
def v3():
    return DeepseekV3Config()  # the defaults are the released 671B model


@pytest.fixture(scope="module")
def v3_costs(v3):
    return layer_costs(v3)


def counts(plan):
    return [len(s.layers) for s in plan.stages]


def llama(layers):
    return tiny_config("llama", num_hidden_layers=layers)


# --- every plan holds the whole model, once, in order ---------------------------------------------

@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("method", ["even", "weighted", "balanced"])
@pytest.mark.parametrize(("pp", "vpp"), [(1, 1), (2, 1), (3, 2)])
def test_every_tiny_model_is_covered_in_order(kind, method, pp, vpp):
    plan = plan_pipeline(tiny_config(kind), pp, vpp=vpp, method=method)
    assert len(plan.stages) == pp * vpp
    assert [i for s in plan.stages for i in s.layers] == list(range(6))
    assert all(len(s.layers) >= 1 for s in plan.stages)
    assert [s.embed for s in plan.stages] == [True] + [False] * (pp * vpp - 1)
    assert [s.head for s in plan.stages] == [False] * (pp * vpp - 1) + [True]
    assert [s.index for s in plan.stages] == list(range(pp * vpp))
    assert all(s.cost > 0 for s in plan.stages) and plan.balance >= 1.0


# --- even and weighted ----------------------------------------------------------------------------

def test_even_gives_the_extra_layers_to_earlier_stages():
    plan = plan_pipeline(llama(10), 4, method="even")
    assert [s.layers for s in plan.stages] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]


def test_weighted_counts_embedding_and_head_as_layers():
    # 8 layers + E + L = 10 units -> even [3, 3, 2, 2] -> minus E on the first, L on the last.
    assert counts(plan_pipeline(llama(8), 4, method="weighted")) == [2, 3, 2, 1]
    # Each worth 2 layers: 12 units, 3 per stage.
    heavy = plan_pipeline(llama(8), 4, method="weighted", embed_weight=2, head_weight=2)
    assert counts(heavy) == [1, 3, 3, 1]


def test_weighted_with_zero_weights_is_even():
    weightless = plan_pipeline(llama(11), 4, method="weighted", embed_weight=0, head_weight=0)
    assert counts(weightless) == counts(plan_pipeline(llama(11), 4, method="even")) == [3, 3, 3, 2]


# --- balanced: exact min-max over contiguous splits -----------------------------------------------

def _stage_costs(costs, split, first, last):
    bounds = [0, *itertools.accumulate(split)]
    out = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    out[0] += first
    out[-1] += last
    return out


def _all_splits(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, n))]


def test_balanced_partition_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, rng.uniform(0, 10)]) for _ in range(n)]
        first, last = rng.choice([0.0, rng.uniform(0, 5)]), rng.choice([0.0, rng.uniform(0, 5)])
        split = balanced_partition(costs, k, first=first, last=last)
        assert len(split) == k and sum(split) == n and min(split) >= 1
        optimum = min(max(_stage_costs(costs, s, first, last)) for s in _all_splits(n, k))
        assert max(_stage_costs(costs, split, first, last)) == pytest.approx(optimum, rel=1e-12)


def test_balanced_partition_of_uniform_costs_is_the_even_split():
    assert balanced_partition([1.0] * 10, 4) == (3, 3, 2, 2)
    assert balanced_partition([1.0] * 8, 8) == (1,) * 8


def test_balanced_moves_layers_off_the_head_stage_of_llama_70b():
    cfg = llama_70b()
    costs = layer_costs(cfg)
    plan = plan_pipeline(cfg, 8)
    # A 128k-vocab head costs ~1.18 decoder layers (2*h*V vs 2*params + attention).
    assert costs.head / costs.layers[0] == pytest.approx(1.18, abs=0.01)
    assert counts(plan) == [10, 11, 11, 10, 10, 10, 10, 8]
    assert plan.balance < plan_pipeline(cfg, 8, method="even").balance  # even: 1.10
    # The optimum: 80 layers + head do not fit 8 stages of <= 10 layers, so the costliest stage
    # holds 11 and balance = 11 / (81.19 / 8) = 1.084; no contiguous split does better.
    assert max(s.cost for s in plan.stages) == pytest.approx(11 * costs.layers[0])
    assert plan.balance == pytest.approx(1.084, abs=1e-3)


def test_balanced_deepseek_v3_on_16_ranks(v3):
    plan = plan_pipeline(v3, 16)
    assert counts(plan) == [4] * 15 + [1]  # the last stage also holds the 1.4-layer head
    assert plan.balance == pytest.approx(1.026, abs=1e-3)


def test_head_and_embed_weights_override_the_cost_model_in_balanced():
    # Head worth 2 layers: the last stage takes 1 layer + head = 3, like the others.
    plan = plan_pipeline(llama(8), 4, embed_weight=0, head_weight=2)
    assert counts(plan) == [3, 3, 1, 1]


# --- the cost model -------------------------------------------------------------------------------

def test_deepseek_v3_parameter_counts_match_the_release(v3_costs):
    c = v3_costs
    assert c.embed_params + c.head_params + sum(c.layer_params) == 671_026_404_352
    active = c.embed_params + c.head_params + sum(c.layer_active_params)
    assert 37.0e9 < active < 38.0e9  # "37B activated" per token
    assert c.num_mtp == 1 and c.mtp > c.layers[-1]


def test_deepseek_v3_moe_layers_hold_far_more_params_at_the_same_flops(v3_costs):
    c = v3_costs
    assert c.is_moe == (False,) * 3 + (True,) * 58  # first_k_dense_replace = 3
    assert c.layer_params[3] > 19 * c.layer_params[0]  # 256 experts live in memory...
    # ...but a token runs 8 routed + 1 shared expert of width 2048 = the dense MLP's 18432,
    # so FLOPs differ only by the router (hidden x 256 experts).
    assert c.layers[3] - c.layers[0] == pytest.approx(2 * 7168 * 256)


def test_qwen3_moe_dense_layers_follow_mlp_only_layers():
    c = layer_costs(tiny_config("qwen3_moe", mlp_only_layers=[0, 3]))
    assert c.is_moe == (False, True, True, False, True, True)
    assert c.layer_active_params[0] == c.layer_params[0]
    assert c.layer_active_params[1] < c.layer_params[1]
    assert c.layers[0] != c.layers[1]


def test_tied_head_still_costs_its_flops():
    tied, untied = layer_costs(tiny_config("llama_tied")), layer_costs(tiny_config("llama"))
    assert tied.head == untied.head == pytest.approx(2 * (64 * 384 + 64))  # lm_head + norm
    assert tied.head_params == untied.head_params  # the head stage holds its own copy


def test_embedding_is_cheap_but_not_free(v3_costs):
    assert 0 < v3_costs.embed < 0.01 * v3_costs.layers[0]


def test_attention_cost_grows_with_sequence_length_and_shrinks_with_a_window():
    cfg = tiny_config("mistral")
    short, long = layer_costs(cfg, seq_len=32), layer_costs(cfg, seq_len=4096)
    assert long.layers[0] > short.layers[0] and long.head == short.head
    # A 64-token window attends to ~64 keys per query, against ~16 at 32 and ~2048 at 4096.
    windowed = layer_costs(tiny_config("mistral", sliding_window=64), seq_len=4096)
    assert short.layers[0] < windowed.layers[0] < long.layers[0]


# --- layouts --------------------------------------------------------------------------------------

def test_megatron_deepseek_v3_layout(v3):
    plan = plan_pipeline(v3, 16, vpp=2, layout=MEGATRON_V3_LAYOUT)
    assert plan.stages[0].layers == (0, 1, 2) and plan.stages[0].embed
    assert [len(s.layers) for s in plan.stages[1:30]] == [2] * 29
    assert plan.stages[29].layers == (59, 60)
    assert plan.stages[30].layers == () and plan.stages[30].mtp == (61,)
    assert plan.stages[31].layers == () and plan.stages[31].head
    assert [s.index for s in plan.stages_of_rank(15)] == [15, 31]


def test_layout_syntax():
    assert parse_layout("Et*2|(t|)*2 t L", 5) == [["E", "t", "t"], ["t"], ["t"], ["t", "L"]]
    assert parse_layout("E|((tt),t)*2|L", 6) == [["E"], ["t"] * 6, ["L"]]  # nested groups
    assert parse_layout("Ett|tmL", 3, num_mtp=1) == [["E", "t", "t"], ["t", "m", "L"]]
    assert parse_layout("E|tt||L", 2) == [["E"], ["t", "t"], [], ["L"]]  # empty stages


def test_layout_overrides_method_and_places_mtp_after_the_layers():
    plan = plan_pipeline(tiny_config("deepseek_v3"), 2, layout="Et*4|t*2mL", method="even")
    assert [(s.layers, s.mtp, s.embed, s.head) for s in plan.stages] == [
        ((0, 1, 2, 3), (), True, False), ((4, 5), (6,), False, True)]


LAYOUT_ERRORS = [  # (layout, decoder layers, MTP layers, the message)
    ("Et*59|tL", 61, 0,
     "--layout has 60 't' layers but the model has 61 decoder layers; add one 't'"),
    ("Et*4|tL", 4, 0,
     "--layout has 5 't' layers but the model has 4 decoder layers; remove one 't'"),
    ("t|tL", 2, 0, "--layout needs exactly one 'E' (the embedding), found 0; put one in the first"),
    ("EEt|tL", 2, 0, "--layout needs exactly one 'E' (the embedding), found 2"),
    ("tE|tL", 2, 0, "--layout must put 'E' in the first stage, before any 't'"),
    ("t|EtL", 2, 0, "--layout must put 'E' in the first stage, before any 't'"),
    ("Et|t", 2, 0, "--layout needs exactly one 'L' (the head), found 0; put one in the last stage"),
    ("EtL|t", 2, 0, "--layout must put 'L' in the last stage, after every 't'"),
    ("Et|Lt", 2, 0, "--layout must put 'L' in the last stage, after every 't'"),
    ("Et|tmL", 2, 0, "--layout has 'm' but the model has no MTP layers (num_nextn_predict_layers"),
    ("Et|tmmL", 2, 1, "--layout has 2 'm' layers but the model has 1 MTP layer(s); remove one 'm'"),
    ("Em|ttL", 2, 1, "--layout must put every 'm' after the last 't'"),
    ("Et)|tL", 2, 0, "--layout has an unmatched ')' at position 2"),
    ("(Et|tL", 2, 0, "--layout has 1 unclosed '('; add ')'"),
    ("Et*|tL", 2, 0, "--layout '*' at position 2 must follow a token or group and precede a count"),
    ("*2Et|tL", 2, 0, "--layout '*' at position 0 must follow a token or group"),
    ("Ex|tL", 2, 0, "--layout has unknown character 'x' at position 1; use E, t, m, L"),
]


@pytest.mark.parametrize(("layout", "layers", "mtp", "message"), LAYOUT_ERRORS)
def test_layout_errors_say_how_to_fix_the_layout(layout, layers, mtp, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        parse_layout(layout, layers, mtp)


def test_layout_stage_count_must_match_pp_times_vpp(v3):
    message = "--layout makes 32 stages but --pp 16 x --vpp 1 = 16; change --layout or --pp/--vpp"
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_pipeline(v3, 16, layout=MEGATRON_V3_LAYOUT)


def test_mtp_in_a_layout_needs_a_model_with_mtp():
    with pytest.raises(PlanError, match="no MTP layers"):
        plan_pipeline(tiny_config("llama"), 2, layout="Et*3|t*3mL")


# --- stage -> rank maps ---------------------------------------------------------------------------

def test_loop_style_deals_stages_round_robin():
    plan = plan_pipeline(llama(8), 4, vpp=2, method="even")
    assert [[s.index for s in plan.stages_of_rank(r)] for r in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert [plan.rank_of_stage(i) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_v_style_folds_the_second_half_back():
    loop = plan_pipeline(llama(8), 4, vpp=2, method="even")
    v = plan_pipeline(llama(8), 4, vpp=2, method="even", style="v")
    assert v.stages == loop.stages  # same partition, different ranks
    assert [[s.index for s in v.stages_of_rank(r)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    assert [v.rank_of_stage(i) for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of_rank(0)[0].embed and v.stages_of_rank(0)[1].head  # rank 0 holds both ends


# --- errors on the pipeline shape -----------------------------------------------------------------

PLAN_ERRORS = [  # (layers, pp, keyword arguments, the message)
    (6, 0, {}, "--pp must be >= 1, got 0"),
    (6, 2, {"vpp": 0}, "--vpp must be >= 1, got 0"),
    (12, 8, {"vpp": 2}, "--pp 8 x --vpp 2 = 16 stages but the model has 12 decoder layers; "
                        "reduce --pp or --vpp"),
    (6, 2, {"method": "greedy"}, "unknown --plan-method 'greedy'; choose one of balanced, even, "
                                 "weighted, layout"),
    (6, 2, {"style": "zigzag"}, "unknown pipeline style 'zigzag'; choose one of loop, v"),
    (6, 2, {"style": "v", "vpp": 3}, "the V style (--schedule zbv or dualpipev) puts two stages "
                                     "on each rank; use --vpp 2 (got --vpp 3)"),
    (6, 2, {"method": "layout"}, "--plan-method layout needs a --layout string"),
    (6, 2, {"embed_weight": -1}, "--embed-weight must be >= 0, got -1"),
    (6, 2, {"head_weight": -0.5}, "--head-weight must be >= 0, got -0.5"),
    (6, 2, {"seq_len": 0}, "--seq-len must be >= 1, got 0"),
]


@pytest.mark.parametrize(("layers", "pp", "kwargs", "message"), PLAN_ERRORS)
def test_plan_errors_say_which_option_to_change(layers, pp, kwargs, message):
    with pytest.raises((PlanError, ParallelError), match=re.escape(message)):  # a degree: ParallelError
        plan_pipeline(llama(layers), pp, **kwargs)


def test_rank_and_stage_lookups_check_their_range():
    plan = plan_pipeline(llama(6), 2)
    with pytest.raises(PlanError, match=re.escape("rank 2 is outside 0..1 (--pp 2)")):
        plan.stages_of_rank(2)
    with pytest.raises(PlanError, match=re.escape("stage 2 is outside 0..1")):
        plan.rank_of_stage(2)


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


# --- bubbles --------------------------------------------------------------------------------------

def test_bubble_fractions_follow_the_analytic_formulas():
    p, m = 4, 8
    assert bubble_fraction("gpipe", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction("1f1b", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))
    for name in ("interleaved-1f1b", "looped-bfs"):
        assert bubble_fraction(name, p, 2, m) == pytest.approx((p - 1) / (2 * m + p - 1))
    assert bubble_fraction("interleaved-zb", p, 2, m) == pytest.approx((p - 1) / (6 * m + p - 1))
    assert bubble_fraction("dualpipev", p, 2, m) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble_fraction("zbv", p, 2, m) == 0.0


def test_zero_bubble_schedules_idle_less_than_1f1b():
    base = bubble_fraction("1f1b", 8, 1, 16)
    for name in ("interleaved-zb", "zbv", "dualpipev"):
        assert bubble_fraction(name, 8, 2, 16) < base
    assert bubble_fraction("1f1b", 1, 1, 4) == 0.0  # one stage never waits


BUBBLE_ERRORS = [
    (("pipedream", 4, 1, 8),
     "unknown --schedule 'pipedream'; choose one of " + ", ".join(SCHEDULES)),
    (("1f1b", 4, 2, 8), "--schedule 1f1b runs one stage per rank; use --vpp 1 or --schedule "
                        "interleaved-1f1b"),
    (("zbv", 4, 1, 8), "--schedule zbv runs two stages per rank in a V; use --vpp 2"),
    (("dualpipev", 4, 3, 8), "--schedule dualpipev runs two stages per rank in a V; use --vpp 2"),
    (("1f1b", 4, 1, 0), "--microbatches must be >= 1, got 0"),
    (("1f1b", 0, 1, 8), "--pp must be >= 1, got 0"),
]


@pytest.mark.parametrize(("args", "message"), BUBBLE_ERRORS)
def test_bubble_errors_say_how_to_fix_the_schedule(args, message):
    with pytest.raises((PlanError, ParallelError), match=re.escape(message)):
        bubble_fraction(*args)
