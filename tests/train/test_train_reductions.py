"""Every quantity reduced over ranks is reduced over exactly the domain ``ParallelDims`` names for it.

The spec, one row per quantity (where it is reduced; over what):

============================  ==========================================  ===========================================
quantity                      where                                       over
============================  ==========================================  ===========================================
training loss                 ``StepEngine.shared_loss``                  ``batch_dims`` (dp, cp) on the loss rank,
                                                                          then broadcast along pp
token count (the divisor)     ``StepEngine.step_count``                   ``batch_dims``
input positions read          ``StepEngine.step`` (``seen``)              x dp (each replica reads its own rows)
grad norm                     ``parallel.grads.squared_norm``             each gradient's sharded mesh dims, then pp
router aux loss (training)    ``StepEngine.backward``, FSDP's average     a mean over every microbatch of dp
router aux loss (evaluation)  ``StepEngine.eval_sum``                     its sums over ``batch_dims`` (cp refused)
eval loss and tokens          ``StepEngine.eval_sum``, ``Evaluator``      ``batch_dims``
logged metrics                ``progress.Reporter`` of ``StepResult``     none: the same on every rank
============================  ==========================================  ===========================================

tp ranks hold the same tokens (a reduction over tp would count them tp times) and ep is carved out of dp. So each
layout's run of ``hfpipe finetune`` (the CLI runner, whose steps are the Python API's ``StepEngine``) logs, step
by step, the same loss, grad norm, token count, input positions, learning rate, eval loss, eval tokens and eval
perplexity as one process on the same global batches, within 1e-5: a Llama at dp 2, tp 2 and cp 2, a Qwen3-MoE
with a router aux loss (coef 0.5) at dp 2 x ep 2 and tp 2. Gradients are clipped (max norm 0.5), so the second
step's loss also checks the norm the first step clipped with. The one process splits its batch into as many
microbatches as the layout has in all (the router aux loss is a mean over microbatches).
``PipelineTrainer`` runs the same ``StepEngine`` pieces: tests/hf/test_hf_trainer_axes.py holds its layouts
against the plain Trainer (loss, grad norm, eval loss, flos, input tokens seen).

Default: the Qwen3-MoE at dp 2 x ep 2 (every quantity but cp's). ``-m slow``: the whole matrix.
"""

from __future__ import annotations

import functools
import math
import tempfile

import pytest

from _dist import tiny_checkpoint

TOL = 1e-5
#: Per step: exact integers, and floats within TOL.
EXACT = ("step", "tokens", "seen")
CLOSE = ("loss", "grad_norm", "lr")
EVAL_EXACT = ("step", "eval_tokens")
EVAL_CLOSE = ("eval_loss", "eval_ppl")


def _model(kind: str) -> str:
    if kind == "moe":
        return str(tiny_checkpoint("qwen3_moe", num_hidden_layers=2, output_router_logits=True,
                                   router_aux_loss_coef=0.5))
    return str(tiny_checkpoint("llama", num_hidden_layers=2))


def _run(kind: str, batch_size: int, microbatches: int, **layout) -> tuple[list[dict], list[dict]]:
    """``hfpipe finetune``'s step rows and eval rows: 2 steps of ``batch_size`` rows a replica, evaluated at the end."""
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.runner import run_finetune

    out = tempfile.mkdtemp(prefix="hfpipe-reductions-")
    cfg = FinetuneConfig(model=_model(kind), output_dir=out, dataset="builtin:tiny-text", packing=False, seq_len=32,
                         max_steps=2, batch_size=batch_size, microbatches=microbatches, lr=1e-3,
                         lr_schedule="constant", max_grad_norm=0.5, eval_fraction=0.2, threads_per_rank=1,
                         **layout)
    summary = run_finetune(cfg)
    steps = [{**r, "seen": round(r["tokens_seen_per_s"] * r["elapsed_s"])} for r in summary["history"]]
    return steps, summary["evals"]


@functools.lru_cache(maxsize=None)
def _one_process(kind: str, batch_size: int, microbatches: int) -> tuple[list[dict], list[dict]]:
    return _run(kind, batch_size, microbatches)


def _compare(got: tuple, want: tuple, layout: str) -> None:
    worst: dict[str, float] = {}
    for rows, exact, close, what in ((0, EXACT, CLOSE, "step"), (1, EVAL_EXACT, EVAL_CLOSE, "eval")):
        g, w = got[rows], want[rows]
        assert len(g) == len(w) > 0, f"{layout}: {len(g)} {what} rows, one process {len(w)}"
        for a, b in zip(g, w):
            for key in exact:
                assert a[key] == b[key], f"{layout}: {what} {key} {a[key]}, one process {b[key]}"
            for key in close:
                x, y = (math.log(a[key]), math.log(b[key])) if key == "eval_ppl" else (a[key], b[key])  # exp(loss)
                assert math.isfinite(x) and abs(x - y) <= TOL, \
                    f"{layout}: {what} {b['step']} {key} {a[key]}, one process {b[key]}"
                worst[key] = max(worst.get(key, 0.0), abs(x - y))
    print(f"measured {layout} vs one process: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))


#: (model, layout, rows a replica, microbatches a replica): the one process takes dp x the rows and microbatches.
LAYOUTS = {
    "llama dp2": ("llama", dict(dp=2), 2, 1),
    "llama tp2": ("llama", dict(tp=2), 4, 2),
    "llama cp2": ("llama", dict(cp=2), 4, 2),
    "moe dp2 x ep2": ("moe", dict(dp=2, ep=2), 2, 1),
    "moe tp2": ("moe", dict(tp=2), 4, 2),
}
DEFAULT = ("moe dp2 x ep2",)


def _check(name: str) -> None:
    kind, layout, rows, micro = LAYOUTS[name]
    dp = layout.get("dp", 1)
    _compare(_run(kind, rows, micro, **layout), _one_process(kind, rows * dp, micro * dp), name)


@pytest.mark.parametrize("name", DEFAULT)
def test_each_reduced_quantity_equals_one_process(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in DEFAULT])
def test_each_reduced_quantity_equals_one_process_on_every_axis(name):
    _check(name)
