"""A run moves between pipeline sizes with the default settings: started at ``--pp 1`` (one microbatch a step by
default), resumed at ``--pp 2`` (two), ``--pp 4`` (four) and back at ``--pp 1``, it continues the uninterrupted
run step for step (each step's same rows, split another way: the losses summed in another order only).

The oracle is the same run done at ``--pp 1`` without stopping; loss and gradient norm per step within 1e-4.
The learning rate is constant so that the step budget each leg gives (``--max-steps``) changes nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist import tiny_checkpoint
from hfpipe.config.run import FinetuneConfig
from hfpipe.train.runner import run_finetune

RUN = dict(batch_size=4, seq_len=32, save_every=1, keep=4, lr=1e-3, warmup_steps=0, lr_schedule="constant",
           threads_per_rank=1)
TOL = 1e-4


def _run(model: Path, out: Path, pp: int, steps: int, resume: bool = False) -> dict[int, tuple[float, float]]:
    cfg = FinetuneConfig(model=str(model), output_dir=str(out), pp=pp, max_steps=steps,
                         resume="auto" if resume else None, **RUN)
    return {row["step"]: (row["loss"], row["grad_norm"]) for row in run_finetune(cfg)["history"]}


def _check(got: dict, want: dict) -> None:
    for step, (loss, norm) in got.items():
        assert abs(loss - want[step][0]) <= TOL and abs(norm - want[step][1]) <= TOL, (step, got[step], want[step])


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=4)


def test_a_pp1_run_with_defaults_resumes_at_pp2_and_continues_the_uninterrupted_run(model, tmp_path):
    want = _run(model, tmp_path / "whole", pp=1, steps=2)
    first = _run(model, tmp_path / "moved", pp=1, steps=1)
    then = _run(model, tmp_path / "moved", pp=2, steps=2, resume=True)
    assert sorted(first) == [1] and sorted(then) == [2]
    _check({**first, **then}, want)


@pytest.mark.slow
def test_pp1_to_pp2_to_pp4_and_back_continues_the_uninterrupted_run(model, tmp_path):
    want = _run(model, tmp_path / "whole", pp=1, steps=4)
    got = {}
    for leg, pp in enumerate((1, 2, 4, 1), start=1):
        got.update(_run(model, tmp_path / "moved", pp=pp, steps=leg, resume=leg > 1))
    assert sorted(got) == [1, 2, 3, 4]
    _check(got, want)
