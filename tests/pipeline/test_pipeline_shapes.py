"""New sequence lengths reuse the pipeline's stages (no rebuild) and stay exact.

``make_batches`` changes the sequence length every step (16, 12, 16, ...); here also the rows per
batch. The run must equal transformers' and build torch stages once per schedule.
"""

from __future__ import annotations

import pytest

from _dist import run_ranks, tiny_checkpoint
from test_train_equivalence import check_equal, pipeline_worker, reference_run


def counting_worker(*args) -> dict:
    """:func:`pipeline_worker`, also counting the torch stages built on this rank."""
    import hfpipe.pipeline.schedule as pipeline

    built = []
    base = pipeline.AccumulatingStage  # the stage class a Pipeline builds (without --reshard-per-microbatch)

    def counted(*a, **k):
        built.append(a[1])  # the stage index
        return base(*a, **k)

    pipeline.AccumulatingStage = counted
    out = pipeline_worker(*args)
    out["built"] = built
    return out


@pytest.mark.parametrize("schedules", [("1f1b",), pytest.param(("1f1b", "zbv"), marks=pytest.mark.slow)])
def test_varying_lengths_reuse_the_stages_and_stay_exact(schedules):
    path = str(tiny_checkpoint("llama_tied", num_hidden_layers=8))
    ref = reference_run(path)
    results = run_ranks(counting_worker, 2, path, 2, 1, schedules, 1, {})
    for rank, r in results.items():
        built = r.pop("built")
        # 1f1b: one stage per rank; zbv: two. Built once, whatever the shapes.
        want = [rank] + ([rank, 3 - rank] if "zbv" in schedules else [])
        assert sorted(built) == sorted(want), f"rank {rank} built {built}"
    check_equal(ref, results, schedules)
