"""``hfpipe plan --lora-rank``: a LoRA run priced per rank, and the shipped LoRA recipe fits.

The adapter counts are checked against PEFT's own injection into the whole model: a rank's
adapters are the ``PeftModel``'s trainable parameters that live in that rank's stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfpipe.config.run import FinetuneConfig, bundled_config_dir
from hfpipe.plan.report import format_report, plan_report, BYTES_PER_PARAM
from hfpipe.tiny import tiny_config

GIB = 1024**3


def peft_trainable_by_layer(config, targets) -> dict[str, int]:
    """PEFT's trainable parameters on the meta model, by ``layer.<i>`` / ``embed`` / ``head``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    out: dict[str, int] = {}
    for name, p in peft.named_parameters():
        if p.requires_grad:
            parts = name.removeprefix("base_model.model.").split(".")
            key = f"layer.{parts[2]}" if parts[:2] == ["model", "layers"] else parts[0]
            out[key] = out.get(key, 0) + p.numel()
    return out


@pytest.mark.parametrize("kind, targets", [("llama", "all-linear"), ("deepseek_v3", ["q_b_proj", "o_proj"])])
def test_lora_memory_per_rank_is_the_adapters_of_its_stages(kind, targets):
    config = tiny_config(kind, num_hidden_layers=6)
    full = plan_report(config, 3, dtype="bf16", seq_len=64)
    lora = plan_report(config, 3, dtype="bf16", seq_len=64, lora_rank=8,
                       lora_targets=targets if isinstance(targets, str) else ",".join(targets))
    per_layer = peft_trainable_by_layer(config, targets)
    assert "head" not in per_layer and "embed" not in per_layer  # all-linear leaves the head alone
    for f, r in zip(full.ranks, lora.ranks):
        layers = [i for s in full.plan.stages_of_rank(r.rank) for i in s.layers]
        n = sum(per_layer.get(f"layer.{i}", 0) for i in layers)
        assert n > 0
        assert (r.grad_bytes, r.optimizer_bytes) == (4 * n, 8 * n)  # fp32 grads and AdamW, adapters only
        assert r.weight_bytes == f.params * BYTES_PER_PARAM["bf16"][0] + 4 * n  # frozen bf16 base + fp32 adapters
        assert r.params == f.params  # (activations: a LoRA layer's own, tests/plan/test_plan_memory_measured.py)
    text = format_report(lora)
    assert f"LoRA rank 8 on {','.join(targets) if not isinstance(targets, str) else targets}: " \
           f"{sum(per_layer.values()):,} adapter parameters" in text


def test_the_70b_lora_recipe_fits_8_x_80gb():
    recipe = Path(__file__).parents[2] / "hfpipe" / "recipes" / "llama3_1_70b_lora_pp8.yaml"
    cfg = FinetuneConfig.from_yaml(recipe)
    assert (cfg.pp, cfg.dp, cfg.lora_rank, cfg.dtype) == (8, 1, 16, "bf16")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bundled_config_dir(cfg.model))
    report = plan_report(config, cfg.pp, schedule=cfg.schedule, microbatches=cfg.num_microbatches,
                         seq_len=cfg.seq_len, batch_size=cfg.batch_size, dtype=cfg.dtype,
                         activation_checkpointing=cfg.activation_checkpointing, lora_rank=cfg.lora_rank,
                         lora_targets=cfg.lora_targets)
    peak = max(r.total_bytes for r in report.ranks)
    assert peak < 80e9 * 0.95, f"peak {peak / GIB:.1f} GiB"
    full = plan_report(config, cfg.pp, schedule=cfg.schedule, microbatches=cfg.num_microbatches,
                       seq_len=cfg.seq_len, batch_size=cfg.batch_size, dtype="bf16-mixed",
                       activation_checkpointing=cfg.activation_checkpointing)
    assert max(r.total_bytes for r in full.ranks) > 80e9  # what LoRA buys: full fine-tuning does not fit


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed", "bf16"])
def test_with_dp_fsdp2_shards_the_frozen_base_and_the_adapters_as_in_a_full_run(dtype):
    config = tiny_config("llama", num_hidden_layers=4)
    lora1 = plan_report(config, 2, dtype=dtype, seq_len=64, lora_rank=8)
    # bf16-mixed holds the frozen base in bf16 (no fp32 master: nothing trains it)
    base = "bf16" if dtype == "bf16-mixed" else dtype
    full2 = plan_report(config, 2, dtype=base, seq_len=64, dp=2)
    lora2 = plan_report(config, 2, dtype=dtype, seq_len=64, lora_rank=8, dp=2)
    per_layer = peft_trainable_by_layer(config, "all-linear")
    compute = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}[dtype]
    for r1, f2, r2 in zip(lora1.ranks, full2.ranks, lora2.ranks):
        n = sum(per_layer[f"layer.{i}"] for s in full2.plan.stages_of_rank(r2.rank) for i in s.layers)
        assert r2.weight_bytes == f2.weight_bytes + int((4 / 2 + compute) * n)  # the base priced as a full run's
        assert r2.optimizer_bytes == r1.optimizer_bytes // 2 == 4 * n  # AdamW moments split over dp
        assert r2.grad_bytes == 4 * n  # the step's unsharded fp32 gradient (its shard replaces it after)
    assert "sharded over dp=2 by FSDP2" in format_report(lora2)


@pytest.mark.parametrize("kind", ["deepseek_v3", "mixtral", "llama"])
def test_adapter_count_is_what_peft_creates_on_the_model(kind):
    """PEFT's get_peft_model(all-linear) on the real model is the count's oracle: on transformers 5 it also
    adapts Mixtral's and DeepSeek-V3's fused experts (one rank-r adapter per expert, rank doubled where
    gate and up are fused) and their routers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hfpipe.plan.lora import adapter_params

    config = tiny_config(kind)
    peft = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
    want = sum(p.numel() for n, p in peft.named_parameters() if p.requires_grad)
    assert sum(adapter_params(config, 4).values()) == want


@pytest.fixture
def fake_tp2_mesh():
    """A 2-rank tp mesh in this one process (torch's fake process group: collectives do nothing), enough to
    build a rank's stages with hfpipe's own tp and LoRA code on the meta device and count what it holds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def held_adapters(config, targets: str, mesh) -> dict[str, int]:
    """Adapter parameters tp rank 0 of a pp 1 x tp 2 LoRA run holds, by ``layer.<i>``: built as
    hfpipe.pipeline.build builds a rank (meta stages, apply_tp, then apply_lora: whole adapters, split)."""
    from hfpipe.lora.adapters import lora_config
    from hfpipe.models.meta import model_config
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.stage import build_stage_modules
    from hfpipe.lora.stages import apply_lora
    from hfpipe.parallel.tensor import apply_tp
    from hfpipe.plan.split import plan_pipeline

    config = model_config(config)
    modules = build_stage_modules(config, plan_pipeline(config, 1).stages_of_rank(0), adapter=adapter_for(config))
    apply_tp(modules, mesh)
    apply_lora(modules, lora_config(8, targets=targets), seed=0, dtype=torch.float32, tp_mesh=mesh)
    out: dict[str, int] = {}
    for m in modules:
        for name, p in m.named_parameters():
            if p.requires_grad:
                key = "layer." + name.split(".")[2]
                out[key] = out.get(key, 0) + (p.to_local() if hasattr(p, "to_local") else p).numel()
    return out


@pytest.mark.parametrize("kind, targets", [("llama", "all-linear"),
                                           ("deepseek_v3", "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")])
def test_under_tp_a_rank_holds_the_adapters_the_runtime_splits_off_for_it(kind, targets, fake_tp2_mesh):
    """Colwise bases (q, k, v, gate, up; MLA's q_b, kv_b) keep lora_A whole and 1/tp of lora_B, rowwise ones
    (o, down) 1/tp of lora_A and lora_B whole, bases the plan leaves whole (q_a, kv_a) whole adapters: the
    plan's count per layer is what a real tp 2 LoRA rank holds, and its fp32 grads and AdamW are those."""
    from hfpipe.plan.lora import adapter_params

    config = tiny_config(kind, num_hidden_layers=2)
    held = held_adapters(config, targets, fake_tp2_mesh)
    planned = {k: v for k, v in adapter_params(config, 8, targets, tp=2).items() if v}
    assert planned == held and sum(held.values()) < sum(adapter_params(config, 8, targets).values())
    (rank,) = plan_report(config, 1, dtype="bf16", seq_len=16, lora_rank=8, lora_targets=targets, tp=2).ranks
    assert (rank.grad_bytes, rank.optimizer_bytes) == (4 * sum(held.values()), 8 * sum(held.values()))
    (full,) = plan_report(config, 1, dtype="bf16", seq_len=16, tp=2).ranks
    assert rank.weight_bytes == full.params * 2 + 4 * sum(held.values())  # the tp-cut bf16 base, fp32 adapters


@pytest.mark.parametrize("sp", [True, False])
def test_lora_adds_its_r_wide_collectives_under_tp(sp):
    """Hand count, Llama all-linear at rank 8, per layer and token in fp32 (the adapters' dtype): the colwise
    bases' lora_B inputs (q, k, v, gate, up: 5 x 8) sum their gradient backward; the rowwise bases' lora_A
    outputs (o, down: 2 x 8) are summed forward (under SP reduce-scattered, and gathered backward). Per
    step, under SP, the whole lora_B of o (64 x 8) and down (64 x 8) have partial gradients; the frozen
    norms none. And what the frozen embedding spares: no gradient flows into it, so the first layer's
    attention block never sums its input's gradient (one sum a block, Megatron's count: 64 in bf16)."""
    config = tiny_config("llama", num_hidden_layers=2)
    kw = dict(tp=2, seq_len=16, batch_size=4, microbatches=2, dtype="bf16", sequence_parallel=sp)
    full, lora = (plan_report(config, 1, **kw, **extra).ranks[0] for extra in ({}, dict(lora_rank=8)))
    norms = 2 * 2 * 64 * 2 if sp else 0  # the full run's partial norm gradients (bf16), absent under LoRA
    per_token = (5 * 8 + 2 * 8) * 4 * 2 - 64 * 2  # 2 layers; the spared sum
    per_step = 2 * (2 * 64 * 8) * 4 if sp else 0
    want = 32 * 2 * per_token + per_step - norms  # 32 tokens a microbatch, 2 microbatches; a ring over 2: x 1
    assert abs(lora.tp_bytes - full.tp_bytes - want) <= 1  # each total is rounded down to whole bytes


def test_plan_refuses_what_tp_lora_stages_cannot_carry_in_one_line():
    from hfpipe.lora.adapters import LoraError

    with pytest.raises(LoraError, match="--tp 2 with LoRA on the routed experts") as e:
        plan_report(tiny_config("qwen3_moe"), 1, seq_len=16, tp=2, lora_rank=8)
    assert "\n" not in str(e.value)
