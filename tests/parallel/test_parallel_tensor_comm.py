"""Tensor parallelism moves Megatron's count: one input-gradient sum per attention and per MLP block.

Each case trains a tiny model at pp 1 x tp 2 on real gloo processes and counts, at torch's dispatcher,
every collective of one step over the tp group (``bench/_comm_bytes.py``: DTensor's redistributions,
transformers' expert sums, the vocab-parallel loss, forward and backward), each priced as a ring moves it.
The same model is built with one layer more, so the difference of the two steps is what one decoder
layer moves, measured. It must be within 1.05 of Megatron's analytic count
(:func:`hfpipe.plan.tensor_comm.megatron_layer_bytes`: 2 h forward and 2 h backward per token, in
all-reduces, with or without sequence parallelism), and each step must move exactly what ``hfpipe plan``
prices (``tp_bytes``). Before the blocks took their input as one replicated DTensor, a Llama layer moved
1.75x Megatron's count (2.0x under sequence parallelism): q, k, v, gate and up each summed their own.

The default suite runs a Llama with and without sequence parallelism; ``-m slow`` runs the other
families: dense ones to the same 1.05; MoE and MLA layers to their planned bytes (MLA's up-projections
keep their own, narrower sums; a MoE block with shared experts sums its output twice, the routed
experts' and the shared down_proj's: :mod:`hfpipe.parallel.tensor_plan`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint

_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
BATCH, SEQ, MICROBATCHES = 4, 16, 2
TOKENS = BATCH * SEQ  # per step, over its microbatches
RING = 2 * (2 - 1) / 2  # what a ring all-reduce moves per rank at tp 2, per byte reduced


def _moved(paths: list[str], sps: tuple[bool, ...]) -> dict[bool, list[int]]:
    """Bytes this rank moved over the tp group in one training step of each checkpoint in ``paths``, with
    and without sequence parallelism (``sps``): one process group for all of them, to spawn once."""
    import torch.distributed as dist

    sys.path.insert(0, _BENCH)
    from _comm_bytes import CommBytes

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    info = init_distributed(ParallelDims(pp=1, tp=2))
    out = {}
    for sp in sps:
        for path in paths:
            pm = load_pipeline(path, pp=1, tp=2, schedule="gpipe", microbatches=MICROBATCHES, dist=info,
                               sequence_parallel=sp)
            trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
            vocab = pm.source.config.vocab_size
            ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
            data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            trainer.step(data)  # the first step builds the schedule: not counted
            counter = CommBytes({info.mesh["tp"].get_group().group_name: "tp"})
            dist.barrier()
            with counter:
                trainer.step(data)
            assert not counter.unpriced, counter.unpriced
            out.setdefault(sp, []).append(counter.total("tp"))
    return out


def _planned(path: str, sp: bool) -> int:
    from hfpipe.plan.report import plan_report
    from hfpipe.source.config import load_config

    report = plan_report(load_config(Path(path)), 1, schedule="gpipe", microbatches=MICROBATCHES, seq_len=SEQ,
                         batch_size=BATCH, dtype="fp32", tp=2, sequence_parallel=sp)
    (rank,) = report.ranks
    return rank.tp_bytes


def _megatron(path: str) -> float:
    """Megatron's bytes for one decoder layer of one step at tp 2 (fp32)."""
    from hfpipe.plan.tensor_comm import megatron_layer_bytes
    from hfpipe.source.config import load_config

    f, b = megatron_layer_bytes(load_config(Path(path)), 4)
    return RING * (f + b) * TOKENS


def _measure(kind: str, sps: tuple[bool, ...], **overrides) -> dict:
    """Per SP setting: (one layer's measured bytes, Megatron's for it, each model's measured bytes, each one's
    planned), from a one-layer and a two-layer model."""
    paths = [str(tiny_checkpoint(kind, num_hidden_layers=n, **overrides)) for n in (1, 2)]
    moved = run_ranks(_moved, 2, paths, sps)
    assert moved[0] == moved[1]  # both tp ranks move the same
    return {sp: (got[1] - got[0], _megatron(paths[0]), got, [_planned(p, sp) for p in paths])
            for sp, got in moved[0].items()}


def test_a_llama_layer_moves_megatrons_count_and_the_plan_prices_every_byte():
    for sp, (layer, megatron, got, planned) in _measure("llama", (True, False)).items():
        print(f"sp={sp}: a layer moves {layer / megatron:.4f} x Megatron's count ({layer:.0f} / {megatron:.0f} bytes)")
        assert megatron <= layer <= 1.05 * megatron, f"sp={sp}: {layer / megatron:.3f} x Megatron's count"
        assert got == planned, f"sp={sp}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_every_dense_family_moves_megatrons_count(kind):
    for sp, (layer, megatron, got, planned) in _measure(kind, (True, False)).items():
        assert megatron <= layer <= 1.05 * megatron, f"{kind} sp={sp}: {layer / megatron:.3f} x Megatron's count"
        assert got == planned, f"{kind} sp={sp}"


@pytest.mark.slow
@pytest.mark.parametrize("kind, overrides", [
    ("qwen3_moe", {}),  # one input sum per MoE block (router and experts share it), the top-k weights'
    ("deepseek_v3", {"first_k_dense_replace": 1}),  # MLA's latents; routed and shared experts, one input sum
])
def test_moe_and_mla_layers_move_what_the_plan_prices(kind, overrides):
    for sp, (layer, megatron, got, planned) in _measure(kind, (True, False), **overrides).items():
        print(f"{kind} sp={sp}: a MoE layer moves {layer / megatron:.4f} x Megatron's dense count")
        assert got == planned, f"{kind} sp={sp}"
