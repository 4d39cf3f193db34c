"""Tensor parallelism (``--tp``) under the pipeline trains exactly as transformers does in one process.

Each stage's matrices, embedding and head are split over tp ranks (transformers' own plans through
torch's ``parallelize_module``, :mod:`hfpipe.parallel.tensor_plan`); the loader reads a rank's slice;
the loss is taken on vocabulary-split logits. The oracle and the batches are
``tests/train/test_train_equivalence.py``'s: full-batch AdamW with clipping, padded and prompt-masked rows,
a sequence length that changes between steps. Loss and grad norm per step agree within 1e-5, step-1
gradients within reordering noise, and every weight after the last step within 1e-5 plus AdamW's
derived drift (``tests/_dist.py``).
"""

from __future__ import annotations

import pytest

from _dist import run_ranks, tiny_checkpoint
from test_train_equivalence import (HP, LAYERS, MICRO, _full, _optimizer, check_equal, first_gradients, make_batches,
                                    reference_run)


def tp_worker(path: str, pp: int, dp: int, tp: int, schedules: tuple[str, ...], options: dict) -> dict:
    """Train with each schedule on a pp x dp x tp mesh; return losses, norms and whole weights."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(ParallelDims(pp=pp, dp=dp, tp=tp))
    results = {}
    for schedule in schedules:
        pm = load_pipeline(path, pp=pp, dp=dp, tp=tp, schedule=schedule, microbatches=MICRO, dist=dist, **options)
        opt, sched = _optimizer(pm.named_parameters())
        grads = first_gradients(opt, pm.named_parameters())  # whole, gathered over tp (and dp)
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        losses, norms = [], []
        for shards in make_batches(pm.source.config.vocab_size, dp=dp):
            out = trainer.step(shards[dist.dp_rank])  # the tp ranks of a replica see the same rows
            losses.append(out.loss)
            norms.append(out.grad_norm)
        weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
        results[schedule] = {"loss": losses, "norm": norms, "grads": grads, "weights": weights}
    return results


def _run(kind: str, pp: int, tp: int, schedules, dp: int = 1, **options) -> None:
    path = str(tiny_checkpoint(kind, num_hidden_layers=LAYERS))
    ref = reference_run(path, dp=dp)
    results = run_ranks(tp_worker, pp * dp * tp, path, pp, dp, tp, tuple(schedules), options)
    check_equal(ref, results, schedules)


def test_pp2_x_tp2_llama_matches_transformers():
    _run("llama", 2, 2, ("1f1b",))


@pytest.mark.slow
def test_every_schedule_tp_runs_at_pp2_x_tp2():
    _run("llama", 2, 2, ("gpipe", "interleaved-1f1b", "looped-bfs"))


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_the_zero_bubble_schedules_are_refused_with_tp_in_one_line(schedule):
    """Their split backward fails inside torch on a tp-split stage: refused before anything starts."""
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    with pytest.raises(ParallelError, match=f"--tp 2 with --schedule {schedule}: the zero-bubble") as e:
        check_layout(ParallelDims(pp=2, tp=2), schedule)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_without_sequence_parallelism():
    _run("llama", 2, 2, ("1f1b",), sequence_parallel=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_tied", "qwen3", "mistral", "qwen3_moe", "deepseek_v3"])
def test_every_accepted_family_at_pp2_x_tp2(kind):
    """Tied embeddings across stages, q/k norms, MoE experts split over tp (read whole from per-expert
    keys, then sliced), DeepSeek-V3's MLA heads split by hand."""
    _run(kind, 2, 2, ("1f1b",))


def test_dp2_x_pp2_x_tp2_with_fsdp_resharding_every_microbatch_matches_transformers():
    """FSDP that shards under the pipeline too (``--reshard-per-microbatch``) on a tp-split stage."""
    _run("llama", 2, 2, ("1f1b",), dp=2, reshard_per_microbatch=True)
