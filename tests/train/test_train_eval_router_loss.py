"""An evaluation loss of a MoE model with ``output_router_logits`` is what transformers' model returns as ``loss``.

transformers' ``Qwen3MoeForCausalLM`` (Mixtral's, ...) adds ``router_aux_loss_coef * aux`` of its whole batch to the
language-model loss, and ``Trainer.evaluate`` averages that per-batch loss over the rows. Evaluation runs no
backward, so the pipeline takes the aux loss exactly over the whole batch (the router sums of every microbatch,
batch and dp rank added, then finished once: hfpipe.models.router_loss), however the rows are split:

- the Python API's ``trainer.eval_loss(batches)``: transformers' ``loss`` of the rows of ``batches`` as one batch;
- the CLI's ``--eval-*``: the same over the whole evaluation set (rows added to fill its last batch count nothing);
- ``PipelineTrainer.evaluate()``: the plain ``Trainer.evaluate()``'s number (tests/hf/test_hf_trainer_axes.py).

The oracle is transformers' model itself, fp32, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from test_pipeline_router_loss import _batches, _checkpoint

TOL = 1e-5


def _cases(vocab: int) -> dict[str, list[dict]]:
    """Padded rows: a batch of 4, one of 3 (not a multiple of the 2 microbatches: a row is added to fill it), and
    two batches of 4 handed at once."""
    a, b = _batches(vocab, 4, steps=1)[0], _batches(vocab, 8, steps=1)[0]
    return {"one": [a], "odd": [{k: v[:3] for k, v in a.items()}],
            "two": [{k: v[:4] for k, v in b.items()}, {k: v[4:] for k, v in b.items()}]}


def _plain(path: str) -> dict[str, float]:
    """transformers' ``loss`` of each case's rows as one batch (the two batches of "two" concatenated)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, batches in _cases(model.config.vocab_size).items():
            rows = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            out[name] = float(model(**rows, use_cache=False).loss)
    return out


def _eval_worker(path: str, schedules: tuple[str, ...]) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(2, 1)
    got = {}
    for schedule in schedules:
        pm = load_pipeline(path, pp=2, schedule=schedule, microbatches=2, dist=dist)
        trainer = pm.trainer(torch.optim.SGD(pm.parameters(), lr=0.0))
        got[schedule] = {name: trainer.eval_loss(b) for name, b in _cases(pm.source.config.vocab_size).items()}
    return got


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow)])
def test_the_api_eval_loss_is_transformers_loss_with_the_router_aux_loss_at_pp2(schedule):
    """1F1B (torch's schedule, 2 microbatches) and ZBV (both stages on each rank: the stages run in order),
    on every rank; the aux loss is a sizeable part of it (coef 0.5)."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint("qwen3_moe", num_hidden_layers=4)
    ranks = run_ranks(_eval_worker, 2, path, (schedule,))
    want = _plain(path)
    lm_only = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_router_logits=False).eval()
    batch = _cases(lm_only.config.vocab_size)["one"][0]
    with torch.no_grad():
        assert want["one"] - float(lm_only(**batch, use_cache=False).loss) > 0.1  # the aux term counts
    for rank, got in ranks.items():
        for name_of_schedule, losses in got.items():
            for name, value in losses.items():
                assert abs(value - want[name]) <= TOL, (rank, name_of_schedule, name, value, want[name])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(dp=2, microbatches=2)])
def test_the_cli_eval_loss_is_transformers_loss_of_the_whole_set_with_the_router_aux_loss(tmp_path, layout):
    """``hfpipe finetune`` at lr 0 (the loaded weights evaluated): the eval set, dealt in batches whose last one
    is filled with rows that carry nothing, gives transformers' ``loss`` of all its rows as one batch; the
    perplexity is the token loss's."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfpipe.config.run import FinetuneConfig
    from hfpipe.data.config import DataConfig
    from hfpipe.data.load import load_splits
    from hfpipe.train.runner import run_finetune
    from test_train_evaluate import transformers_eval

    path = _checkpoint("qwen3_moe", num_hidden_layers=4)
    cfg = FinetuneConfig(model=path, output_dir=str(tmp_path / "out"), max_steps=1, seq_len=32, batch_size=6,
                         dataset="builtin:tiny-text", packing=False, eval_fraction=0.2, lr=0.0, min_lr=0.0,
                         threads_per_rank=1, **layout)
    got = run_finetune(cfg)["evals"][-1]
    data = DataConfig(dataset=cfg.dataset, seq_len=32, packing=False)
    _, held = load_splits(data, AutoTokenizer.from_pretrained(path), eval_fraction=0.2)
    assert len(held) % (cfg.batch_size * cfg.dp), "the last eval batch is filled"
    want, tokens = transformers_eval(path, path, data, rows=held)
    assert got["eval_tokens"] == tokens and abs(got["eval_loss"] - want) <= TOL, (got, want)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_router_logits=False)
    assert got["eval_ppl"] == pytest.approx(math.exp(_lm_loss(lm, held)), rel=1e-5)


def _lm_loss(model, rows) -> float:
    from hfpipe.data.config import COLUMNS

    batch = {k: torch.tensor(rows[k]) for k in COLUMNS if k != "position_ids"}
    with torch.no_grad():
        return float(model.eval()(**batch, use_cache=False).loss)
