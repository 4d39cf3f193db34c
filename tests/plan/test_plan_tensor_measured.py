"""``hfpipe plan``'s tensor-parallel traffic is what a real tp run moves.

Each case trains a tiny model for two steps on real gloo processes and counts, at torch's dispatcher,
every collective over the tp group (``bench/_comm_bytes.py``: DTensor's redistributions, transformers'
expert sums, MLA's rope-gradient sum, the vocab-parallel loss, forward and backward), each priced as a
ring moves it. Per pipeline rank, the bytes of one step must equal the plan's ``tp_bytes`` exactly:
the plan counts every collective a family's layers run, not a dense layer's approximation.
``bench/tp.py --family`` prints the same ratio for larger models.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint

pytestmark = pytest.mark.slow

_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
_MLA = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"


def _moved(path: str, pp: int, sp: bool, lora: str | None, ep: int = 1) -> tuple[int, float]:
    """(this rank's pipeline rank, the bytes it moved over the tp group in one step)."""
    import torch.distributed as dist

    sys.path.insert(0, _BENCH)
    from _comm_bytes import CommBytes

    from hfpipe.api import load_pipeline
    from hfpipe.lora.adapters import lora_config
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    info = init_distributed(ParallelDims(pp=pp, dp=ep, tp=2, ep=ep))
    pm = load_pipeline(path, pp=pp, dp=ep, ep=ep, tp=2, schedule="gpipe", microbatches=2, dist=info, sequence_parallel=sp,
                       lora=lora_config(4, targets=lora) if lora else None)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    ids = torch.randint(3, pm.source.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    trainer.step(data)  # the first step builds the schedule: not counted
    groups = [info.mesh["tp"]] + ([info.expert_mesh()["tp"]] if ep > 1 else [])
    counter = CommBytes({m.get_group().group_name: "tp" for m in groups})
    dist.barrier()
    with counter:
        trainer.step(data)
    return info.pp_rank, counter.total("tp")


def _planned(path: str, pp: int, sp: bool, lora: str | None, ep: int = 1) -> list[int]:
    from hfpipe.plan.report import plan_report
    from hfpipe.source.config import load_config

    report = plan_report(load_config(Path(path)), pp, schedule="gpipe", microbatches=2, seq_len=16, batch_size=4,
                         dtype="fp32", dp=ep, ep=ep, tp=2, sequence_parallel=sp, lora_rank=4 if lora else None,
                         lora_targets=lora or "all-linear")
    return [r.tp_bytes for r in report.ranks]


@pytest.mark.parametrize("kind, pp, sp, lora, ep", [
    ("qwen3_moe", 1, True, None, 1),  # routed experts' sums, the top-k weights, Qwen3's head norms
    ("deepseek_v3", 2, True, None, 1),  # MLA's latents, shared experts, dense first layers, stage boundaries
    ("deepseek_v3", 1, False, None, 1),  # the same without sequence parallelism
    ("llama", 2, False, "all-linear", 1),  # LoRA's r-wide sums; the frozen embedding spares layer 0's
    ("deepseek_v3", 2, True, _MLA, 1),  # LoRA on MLA: whole down-projections, rowwise o_proj under SP
    ("qwen3_moe", 1, True, None, 2),  # dp 2 x ep 2 x tp 2: experts whole over tp, their outputs gathered
    ("deepseek_v3", 1, False, None, 2),  # the same with fp32 top-k weights and shared experts, no SP
])
def test_planned_tp_bytes_are_the_bytes_a_tp2_run_moves(kind, pp, sp, lora, ep):
    path = str(tiny_checkpoint(kind, num_hidden_layers=4))
    moved = run_ranks(_moved, 2 * pp * ep, path, pp, sp, lora, ep)
    per_pp = {}
    for pp_rank, got in moved.values():
        assert per_pp.setdefault(pp_rank, got) == got  # both ranks of a tp group move the same
    assert [per_pp[r] for r in range(pp)] == _planned(path, pp, sp, lora, ep)
