"""A step that goes non-finite on one rank stops every rank at that step, with one message, under tp and cp.

The run's check (:func:`hfpipe.train.finite.check_finite`) reads the loss and the gradient norm each rank holds
after the step, and takes no collective of its own: it stops every rank alike only if every rank holds the same
non-finite values. So the fault is planted on one rank alone, where only that rank's own part of the work sees it
(its tokens under cp, its share of the sums under tp): the loss reduced over the batch domain and the norm over
every gradient carry it to the others, or a rank would train on while another stopped. The CLI's own run
(``hfpipe finetune --tp 2 / --cp 2`` diverging, exit 2, one line, the last good checkpoint kept) is in
tests/train/test_train_faults.py (slow).
"""

from __future__ import annotations

import math

import pytest
import torch

from _dist import caught, run_ranks, tiny_checkpoint

ROWS, SEQ = 2, 16


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (ROWS, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def diverging_worker(path: str, axis: str) -> dict:
    """Two steps at ``axis`` = 2; before the second, rank 1's final hidden states (its tokens under cp, its copy
    of them under tp) become infinite."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.finite import check_finite

    dist = init_distributed(ParallelDims(**{axis: 2}))
    pm = load_pipeline(path, dist=dist, sequence_parallel=False, **{axis: 2})
    trainer = pm.trainer(torch.optim.SGD(pm.parameters(), lr=1e-3), max_grad_norm=1.0)
    batch = _batch(pm.source.config.vocab_size)
    good = trainer.step(batch)
    if dist.rank == 1:
        (last,) = [m for m in pm.modules if m.is_last]
        last.model.norm.register_forward_pre_hook(lambda module, args: (args[0] * float("inf"), *args[1:]))
    bad = trainer.step(batch)
    return {"good": (good.loss, good.grad_norm), "bad": (bad.loss, bad.grad_norm),
            "stop": caught(lambda: check_finite(2, bad.loss, bad.grad_norm, None))}


@pytest.mark.parametrize("axis", ["cp", "tp"])
def test_a_step_non_finite_on_one_rank_stops_every_rank_with_one_message(axis):
    results = run_ranks(diverging_worker, 2, str(tiny_checkpoint("llama", num_hidden_layers=2)), axis)
    assert all(math.isfinite(v) for r in results.values() for v in r["good"])
    assert all(not math.isfinite(r["bad"][0]) and not math.isfinite(r["bad"][1]) for r in results.values())
    stops = {r["stop"] for r in results.values()}
    assert len(stops) == 1, stops  # the same error, word for word, on both ranks
    (name, message), = stops
    assert name == "NonFiniteStep" and message.startswith("step 2: loss ") and "is not finite" in message
