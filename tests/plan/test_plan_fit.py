"""Spec of "does it fit?": ``hfpipe plan`` prices what ``hfpipe finetune`` would run (same defaults,
same recipes), counts FSDP2's dp sharding, says per rank whether it fits a GPU, and suggests the
nearest changes that do. Also the PNG's legend (only what is drawn, one colour per stage).
"""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from hfpipe.cli.main import app
from hfpipe.config.run import FinetuneConfig
from hfpipe.plan.split import PlanError
from hfpipe.plan.fit import fit_report, parse_memory, plan_kwargs, report_for, suggest
from hfpipe.plan.report import BYTES_PER_PARAM, load_model_config, param_bytes, plan_report
from hfpipe.recipes import find_recipe
from hfpipe.tiny import tiny_config

GIB = 2**30
runner = CliRunner()


def recipe(name: str, **changes) -> tuple[object, FinetuneConfig]:
    cfg = dataclasses.replace(FinetuneConfig.from_yaml(find_recipe(name)), **changes)
    return load_model_config(cfg.model), cfg


def peak(report) -> int:
    return max(r.total_bytes for r in report.ranks)


@pytest.mark.parametrize("text, size", [("80GB", 80 * GIB), ("141GB", 141 * GIB), ("80GiB", 80 * GIB),
                                        ("512MB", 512 * 2**20), ("24g", 24 * GIB), ("1000", 1000)])
def test_gpu_memory_sizes_count_gb_as_gpu_makers_do(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["lots", "0GB", "-1GB", ""])
def test_a_bad_gpu_memory_names_the_flag(bad):
    with pytest.raises(PlanError, match="--gpu-memory"):
        parse_memory(bad)


def test_the_plan_of_a_config_uses_finetunes_defaults():
    cfg = FinetuneConfig(model="meta-llama/Llama-3.2-1B", pp=2)
    report = report_for(load_model_config(cfg.model), cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}
    assert report.seq_len == defaults["seq_len"] and report.dtype == defaults["dtype"]
    assert report.schedule == defaults["schedule"] and report.dp == defaults["dp"]
    assert report.activation_checkpointing == defaults["activation_checkpointing"]
    assert report.microbatches == cfg.num_microbatches
    assert report.microbatch_size * report.microbatches == defaults["batch_size"]
    assert set(plan_kwargs(cfg)) <= set(plan_report.__code__.co_varnames)


@pytest.mark.parametrize("dtype", sorted(BYTES_PER_PARAM))
def test_dp_shards_masters_grads_and_adamw_but_not_the_step_buffers(dtype):
    """FSDP2 under pipelining: the compute-dtype weights and reduce-dtype gradients are whole
    for the whole step (no reshard after forward, no gradient sync before the last backward); their
    shards replace them one unit at a time after it, so the two are never held whole together. The reduce dtype is
    fp32 under bf16 too (hfpipe.parallel.fsdp), and FSDP2 accumulates the whole gradients in it."""
    compute, reduce = {"fp32": (4, 4), "bf16-mixed": (2, 4), "bf16": (2, 4), "fp64": (8, 8)}[dtype]
    master = {"bf16": 2, "fp64": 8}.get(dtype, 4)
    adamw = 2 * master
    assert param_bytes(dtype, 1) == BYTES_PER_PARAM[dtype]
    for dp in (2, 4, 8):
        assert param_bytes(dtype, dp) == (master / dp + compute, reduce, adamw / dp)
    one, four = (plan_report(tiny_config("llama"), 2, seq_len=16, dtype=dtype, dp=dp) for dp in (1, 4))
    for a, b in zip(one.ranks, four.ranks):
        assert b.params == a.params and b.activation_bytes == a.activation_bytes
        assert b.optimizer_bytes == a.optimizer_bytes // 4


def test_after_the_last_backward_fsdp2_copies_the_stage_unit_beside_every_whole_gradient():
    # torch's foreach_reduce copies a unit's whole gradients into one reduce-scatter input before it frees them; the
    # stage's own unit (embedding, head) goes first, while every layer's are whole: with the activations gone, that
    # is the peak of a full fine-tune under full checkpointing (a cp2 run's real peak, measured)
    config = tiny_config("llama")
    kw = dict(seq_len=16, dtype="bf16", activation_checkpointing="full")
    for r in plan_report(config, 1, dp=2, **kw).ranks:
        unit = (config.vocab_size * config.hidden_size * 2) * 4  # embedding and head, untied, fp32 gradients
        assert r.reduce_bytes == pytest.approx(unit, rel=0.01)
        assert r.total_bytes >= r.weight_bytes + r.grad_bytes + r.optimizer_bytes + r.reduce_bytes
    assert plan_report(config, 1, **kw).ranks[0].reduce_bytes == 0  # one bf16 replica: no FSDP2
    one_mixed = dict(kw, dtype="bf16-mixed")  # one bf16-mixed replica: no reduce input (hfpipe.parallel.one_replica)
    assert plan_report(config, 1, **one_mixed).ranks[0].reduce_bytes == 0
    assert plan_report(config, 1, dp=2, lora_rank=4, **kw).ranks[0].reduce_bytes == 0  # LoRA: adapters' only


def test_a_recipe_that_fits_says_so_per_rank():
    config, cfg = recipe("llama3_2_1b_sft_pp2")
    fits = fit_report(report_for(config, cfg), parse_memory("24GB"))
    assert [f.rank for f in fits] == [0, 1] and all(f.fits for f in fits)


def test_suggestions_are_the_nearest_rung_of_each_lever_that_fits():
    config, cfg = recipe("llama3_1_70b_sft_pp16_dp2", dp=1)
    limit = parse_memory("80GB")
    assert peak(report_for(config, cfg)) > limit
    every = suggest(config, cfg, limit)
    found = {tuple(s.changes): s for s in every if not s.search}
    # already full activation checkpointing; then pp, dp, tp, and dp with FSDP2 resharded per microbatch
    assert set(found) == {("pp",), ("dp",), ("tp",), ("dp", "reshard_per_microbatch")}
    for s in every:  # each suggestion, re-planned, fits with room to spare
        trial = dataclasses.replace(cfg, **s.changes)
        report = report_for(config, trial)
        assert peak(report) == s.peak <= 0.9 * limit
        assert s.gpus == trial.pp * trial.dp * trial.tp and s.bubble == report.bubble
    dp = found[("dp",)].changes["dp"]
    assert peak(report_for(config, dataclasses.replace(cfg, dp=dp // 2))) > 0.9 * limit


def test_activation_checkpointing_is_suggested_first_when_it_is_enough():
    config, cfg = recipe("llama3_1_8b_sft_pp4", activation_checkpointing="none")
    report = report_for(config, cfg)
    limit = int(peak(report) * 0.8)
    first = suggest(config, cfg, limit)[0]
    assert first.changes in ({"activation_checkpointing": "selective"}, {"activation_checkpointing": "full"})


def test_cli_plan_takes_a_recipe_by_name_and_answers_whether_it_fits():
    ok = runner.invoke(app, ["plan", "--recipe", "llama3_2_1b_sft_pp2", "--gpu-memory", "24GB"])
    assert ok.exit_code == 0, ok.stderr
    assert "fits: every rank within 24.0 GiB (2 GPUs)" in ok.stdout
    bad = runner.invoke(app, ["plan", "--recipe", "llama3_1_70b_sft_pp16_dp2", "--dp", "1",
                              "--gpu-memory", "80GB"])
    assert bad.exit_code == 0, bad.stderr
    assert "rank   0:" in bad.stdout and "does NOT fit, by" in bad.stdout
    assert "does NOT fit: 3 of 16 ranks over 80.0 GiB" in bad.stdout
    assert "--dp 2" in bad.stdout and "--pp 24" in bad.stdout


def test_cli_plan_defaults_are_finetunes(tmp_path):
    result = runner.invoke(app, ["plan", "meta-llama/Llama-3.2-1B"])
    assert result.exit_code == 0, result.stderr
    cfg = FinetuneConfig(model="meta-llama/Llama-3.2-1B")
    assert (f"pp {cfg.pp} x vpp {cfg.vpp} (loop style), schedule {cfg.schedule}, "
            f"{cfg.num_microbatches} microbatches of {cfg.batch_size // cfg.num_microbatches} x "
            f"{cfg.seq_len} tokens, {cfg.dtype}") in result.stdout


def test_png_legend_lists_only_drawn_stages_and_kinds(tmp_path):
    pytest.importorskip("matplotlib")
    from hfpipe.cli.plot import save_png, stage_colors

    report = plan_report(tiny_config("llama"), 2, schedule="interleaved-1f1b", seq_len=16)
    captured = {}
    from matplotlib.figure import Figure

    real = Figure.legend

    def spy(self, *args, **kwargs):
        handles = kwargs.get("handles") or args[0]
        captured.setdefault("labels", []).append([h.get_label() for h in handles])
        return real(self, *args, **kwargs)

    Figure.legend = spy
    try:
        save_png(report, tmp_path / "p.png", gpu_memory=parse_memory("1GB"))
    finally:
        Figure.legend = real
    timeline_labels = captured["labels"][0]
    assert timeline_labels == ["stage 0", "stage 1", "stage 2", "stage 3", "forward", "backward"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    for n in (4, 20, 32):
        assert len(set(stage_colors(n))) == n


def test_the_fit_search_measures_and_plans_each_thing_once(monkeypatch):
    """Suggestions re-price one model dozens of times: its meta model is counted once, its layers
    measured once, and no plan is priced twice (DeepSeek-V3 at pp8 dp32 took minutes before)."""
    from hfpipe.plan import activations, cost
    from hfpipe.plan import report as plan_report_module

    config = tiny_config("llama", num_hidden_layers=8)
    cfg = FinetuneConfig(model="tiny", pp=2, seq_len=512, batch_size=8, microbatches=8)
    calls = {"counts": 0, "measure": 0, "plans": []}
    counts, measure, price = cost._param_counts, activations._measure_layer, plan_report_module.plan_report

    def count(*a, **k):
        calls["counts"] += 1
        return counts(*a, **k)

    def measured(*a, **k):
        calls["measure"] += 1
        return measure(*a, **k)

    def priced(model_config, **kwargs):
        calls["plans"].append(tuple(sorted(kwargs.items())))
        return price(model_config, **kwargs)

    monkeypatch.setattr(cost, "_param_counts", count)
    monkeypatch.setattr(activations, "_measure_layer", measured)
    monkeypatch.setattr(plan_report_module, "plan_report", priced)
    cost._COSTS.clear(), cost._COUNTS.clear(), activations._measure_all.cache_clear()
    report_for(config, cfg)
    found = suggest(config, cfg, 2**20)  # 1 MiB: nothing fits, every rung is priced
    report_for(config, cfg)
    assert found == [] and len(calls["plans"]) > 10
    assert len(set(calls["plans"])) == len(calls["plans"])  # no plan priced twice
    assert calls["counts"] == 1 and calls["measure"] == 1  # one meta model, one layer kind
