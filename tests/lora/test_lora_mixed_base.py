"""Under bf16-mixed a LoRA run holds its frozen base in bf16, and trains exactly as with an fp32 base.

bf16-mixed keeps fp32 masters of what trains and computes in bf16. Nothing trains a LoRA base, so its fp32
master (and FSDP2's bf16 copy of it) was memory spent on the very bf16 values the forward reads: the base is
now held in bf16 (``StageOptions.base_dtype``), the adapters stay fp32 masters initialised as over an fp32 base,
and at one replica FSDP2 leaves the bf16 base alone instead of copying it every step. The oracle is the same run
with the base held as before (fp32, patched back in each rank): every loss, grad norm and adapter after the
steps must be equal bit for bit, while the base takes half the bytes.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_lora_equivalence import LORA, lora_config, start_adapters
from test_train_equivalence import HP, LAYERS, MICRO, _optimizer, make_batches

QWEN3_MOE_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def worker(path: str, pp: int, dp: int, kw: dict, fp32_base: bool) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.pipeline.options import StageOptions

    if fp32_base:  # the oracle: the base held as bf16-mixed held it before, an fp32 master cast by FSDP2
        StageOptions.base_dtype = property(lambda self: self.param_dtype)
    pm = load_pipeline(path, pp=pp, dp=dp, schedule="1f1b", microbatches=MICRO, lora=lora_config(kw),
                       dtype="bf16-mixed")
    frozen = [p for m in pm.modules for p in m.parameters() if not p.requires_grad]
    named = pm.named_parameters()
    start = start_adapters(pm)
    opt, sched = _optimizer(named)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for shards in make_batches(pm.source.config.vocab_size, dp=dp):
        out = trainer.step(shards[pm.dist.dp_rank])
        losses.append(out.loss)
        norms.append(out.grad_norm)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in named}
    return {"loss": losses, "norm": norms, "start": start, "final": full,
            "base_dtypes": {p.dtype for p in frozen}, "adapter_dtypes": {p.dtype for _, p in named},
            "base_bytes": sum(p.numel() * p.element_size() for p in frozen)}


def check_same(kind: str, pp: int, dp: int, kw: dict = LORA) -> None:
    path = str(tiny_checkpoint(kind, num_hidden_layers=LAYERS))
    new = run_ranks(worker, pp * dp, path, pp, dp, kw, False)
    old = run_ranks(worker, pp * dp, path, pp, dp, kw, True)
    moved = 0.0
    for rank in new:
        a, b = new[rank], old[rank]
        assert a["base_dtypes"] == {torch.bfloat16} and b["base_dtypes"] == {torch.float32}
        assert a["adapter_dtypes"] == b["adapter_dtypes"] == {torch.float32}, "fp32 adapter masters either way"
        assert a["base_bytes"] * 2 == b["base_bytes"], "the base takes half the bytes"
        assert a["loss"] == b["loss"] and a["norm"] == b["norm"], f"rank {rank}: {a['loss']} vs {b['loss']}"
        assert sorted(a["final"]) == sorted(b["final"]) and a["final"], "the same adapters"
        for name, t in a["final"].items():
            assert torch.equal(a["start"][name], b["start"][name]), f"{name}: another start"
            assert torch.equal(t, b["final"][name]), f"{name}: trained to another value"
            moved = max(moved, (t - a["start"][name]).abs().max().item())
    assert moved > 1e-4, "the adapters really moved: equality is not trivial"


def test_bf16_mixed_lora_holds_its_base_in_bf16_and_trains_bit_for_bit_as_before_pp2():
    check_same("llama", pp=2, dp=1)


@pytest.mark.slow
def test_bf16_mixed_lora_base_in_bf16_dp2_sharded():
    check_same("llama_tied", pp=1, dp=2)


@pytest.mark.slow
def test_bf16_mixed_lora_base_in_bf16_moe_experts_pp2():
    check_same("qwen3_moe", pp=2, dp=1, kw=QWEN3_MOE_LORA)
