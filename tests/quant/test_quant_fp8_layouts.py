"""``fp8=`` on every axis: pp (each schedule), dp (FSDP2), tp (torchao's float8 styles under tensorwise),
ep and LoRA. Each layout trains the same batches in bf16-mixed and with each float8 recipe; the float8
losses stay within 2% of bf16-mixed's, differ from them (the matmuls ran in float8), and every rank
holds its decoder layers' linears as torchao's ``Float8Linear``.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_quant_fp8_training import LR, batches

pytest.importorskip("torchao", reason="--fp8 needs torchao (pip install 'hfpipe[qlora]')")

RECIPES = ("rowwise", "tensorwise")


def layout_worker(path: str, degrees: dict, options: dict) -> dict:
    """Train bf16-mixed, then each recipe, on one layout; return losses and float8 linears per run (and per
    schedule, ``options["schedules"]``)."""
    from torchao.float8.float8_linear import Float8Linear

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dims = {k: v for k, v in degrees.items() if k in ("pp", "dp", "tp", "ep")}
    dist = init_distributed(ParallelDims(**dims))
    options = dict(options)
    schedules, lora = options.pop("schedules", ("1f1b",)), options.pop("lora_rank", None)
    if lora:
        from peft import LoraConfig

        options["lora"] = LoraConfig(r=lora, target_modules="all-linear")
    dp, out = degrees.get("dp", 1), {}
    for schedule in schedules:
        for fp8 in (None, *RECIPES):
            pm = load_pipeline(path, dtype="bf16-mixed", fp8=fp8, schedule=schedule, microbatches=2, dist=dist,
                               **degrees, **options)
            opt = torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=LR)
            trainer = pm.trainer(opt)
            rows = [{k: v.chunk(dp)[dist.dp_rank] for k, v in b.items()} for b in batches(pm.vocab_size)]
            losses = [trainer.step(b).loss for b in rows]
            linears = sum(isinstance(m, Float8Linear) for stage in pm.modules for m in stage.modules())
            out[schedule, fp8] = {"loss": losses, "float8": linears}
    return out


def run_layout(kind: str, layers: int, world: int, **degrees_and_options) -> dict:
    path = str(tiny_checkpoint(kind, num_hidden_layers=layers))
    options = {k: degrees_and_options.pop(k) for k in list(degrees_and_options) if k not in ("pp", "dp", "tp", "ep")}
    results = run_ranks(layout_worker, world, path, degrees_and_options, options)
    for rank, r in results.items():
        for schedule in options.get("schedules", ("1f1b",)):
            want = torch.tensor(r[schedule, None]["loss"])
            assert r[schedule, None]["float8"] == 0
            for recipe in RECIPES:
                what = f"{schedule}, {recipe}, rank {rank}"
                assert r[schedule, recipe]["float8"] > 0, f"{what}: its decoder layers run in float8"
                got = torch.tensor(r[schedule, recipe]["loss"])
                assert not torch.equal(got, want), f"{what}: the matmuls ran in float8"
                torch.testing.assert_close(got, want, rtol=0.02, atol=0, msg=lambda m: f"{what}: {m}")
    return results


@pytest.mark.slow
def test_fp8_at_pp2_under_every_schedule_kind():
    """One schedule of each kind: single-stage, looped (2 stages a rank), and V (split backward)."""
    run_layout("llama", 4, 2, pp=2, schedules=("1f1b", "gpipe", "interleaved-1f1b", "zbv"))


@pytest.mark.slow
def test_fp8_at_dp2_fsdp2_shards():
    run_layout("llama", 2, 2, pp=1, dp=2)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_fp8_at_tp2(sequence_parallel):
    run_layout("llama", 2, 2, pp=1, tp=2, sequence_parallel=sequence_parallel)


@pytest.mark.slow
def test_fp8_under_lora_at_pp2_and_at_tp2():
    run_layout("llama", 2, 2, pp=2, lora_rank=8)
    run_layout("llama", 2, 2, pp=1, tp=2, lora_rank=8)


@pytest.mark.slow
def test_fp8_with_moe_experts_over_ep2():
    """Qwen3-MoE: attention in float8; fused routed experts (3-D, not linears) and the router in bf16."""
    run_layout("qwen3_moe", 2, 2, pp=1, dp=2, ep=2)
