"""The objective is an object the pipeline is handed: SFT's token mean is one, and another plugs in unchanged.

The seam is shown with a second objective written here and nowhere else, the mean over sequences of each
sequence's token mean: handed to ``Pipeline(..., objective=...)``, it trains exactly as transformers does with
that loss, under a schedule that evaluates through torch's schedule (1F1B) and one that evaluates stage by
stage (ZBV), and it keeps records of its own microbatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _dist import run_ranks, tiny_checkpoint
from hfpipe.loss.objective import Objective, TokenMean
from hfpipe.loss.tokens import IGNORE_INDEX, batch_targets
from test_train_equivalence import (BATCH, HP, LAYERS, STEPS, TOL, _full, _loss_per_row, _optimizer, check_equal,
                                    first_gradients, make_batches, reference_run, train_reference)

MICRO = 4  # two rows per microbatch: a per-sequence mean is not a per-microbatch one


class SequenceMean(Objective):
    """The toy objective: each sequence's mean token loss, averaged over the step's sequences.

    A sequence without loss tokens adds 0 (as ``_loss_per_row``); under cp a sequence's tokens would sit on
    several ranks, so this toy does not run there.
    """

    def __init__(self) -> None:
        self.rows = 0  # what an objective may record of its microbatches for its caller

    def targets(self, batch: dict) -> torch.Tensor:
        return batch_targets(batch)

    def count(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def loss(self, out, targets, head, denominator):
        logits = out if head is None else head.logits(out)
        per_token = F.cross_entropy(logits.float().transpose(1, 2), targets.to(logits.device),
                                    ignore_index=IGNORE_INDEX, reduction="none")  # (B, T)
        tokens = (targets != IGNORE_INDEX).sum(1).clamp(min=1).to(per_token.device)
        self.rows += targets.shape[0]
        return (per_token.sum(1) / tokens).sum() / denominator


def test_the_token_mean_hands_on_shifted_labels_and_counts_their_tokens():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7], [IGNORE_INDEX, 8, 9, IGNORE_INDEX]])
    mean = TokenMean()
    shifted = torch.tensor([[6, IGNORE_INDEX, 7, IGNORE_INDEX], [8, 9, IGNORE_INDEX, IGNORE_INDEX]])
    assert torch.equal(mean.targets({"labels": labels}), shifted)
    assert mean.count({"labels": labels}) == 4
    cp_rank = {"shift_labels": shifted[:, :2]}  # a cp rank's tokens, shifted before the split
    assert torch.equal(mean.targets(cp_rank), shifted[:, :2]) and mean.count(cp_rank) == 3


def test_the_token_mean_is_transformers_causal_lm_loss_chunked_or_not():
    from hfpipe.loss.objective import Head

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 12, 8)
    labels = torch.randint(0, 50, (2, 12))
    labels[0, :4] = IGNORE_INDEX
    mean = TokenMean()
    targets, count = mean.targets({"labels": labels}), mean.count({"labels": labels})
    logits = head(hidden)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())  # transformers' shift and mean
    torch.testing.assert_close(mean.loss(logits, targets, None, count), want)
    torch.testing.assert_close(mean.loss(hidden, targets, Head(head, 5), count), want)


def _sequence_mean_worker(path: str, schedules: tuple[str, ...]) -> dict:
    """Train ``STEPS`` steps at pp=2 with :class:`SequenceMean` handed to the Pipeline; evaluate first."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.schedule import Pipeline

    dist = init_distributed(2, 1)
    results = {}
    for schedule in schedules:
        pm = load_pipeline(path, pp=2, schedule=schedule, microbatches=MICRO, dist=dist)
        objective = SequenceMean()
        pm.pipe = Pipeline(pm.modules, pm.plan.owners, schedule, MICRO, dist.pp_group, dist.device,
                           objective=objective)
        opt, sched = _optimizer(pm.named_parameters())
        grads = first_gradients(opt, pm.named_parameters())
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        batches = [b for (b,) in make_batches(pm.source.config.vocab_size)]
        first = trainer.eval_loss(batches[0])
        steps = [trainer.step(b) for b in batches]
        results[schedule] = {"loss": [s.loss for s in steps], "norm": [s.grad_norm for s in steps], "grads": grads,
                             "weights": {k: _full(v) for k, v in pm.model_state_dict().items()},
                             "eval": first, "rows": objective.rows, "counts": [s.tokens for s in steps]}
    return results


def _sequence_mean_reference(path: str) -> tuple[dict, float]:
    """transformers trained on the per-sequence mean loss, and that loss of the first batch before training."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.register_forward_hook(_loss_per_row, with_kwargs=True)
    batches = [b for (b,) in make_batches(model.config.vocab_size)]
    with torch.no_grad():
        first = float(model(**batches[0], use_cache=False).loss)
    return train_reference(model, batches, *_optimizer(list(model.named_parameters()))), first


def test_a_second_objective_plugs_in_without_touching_the_schedule():
    path = str(tiny_checkpoint("llama_tied", num_hidden_layers=LAYERS))
    ref, first = _sequence_mean_reference(path)
    token_mean = reference_run(path)["loss"]
    assert max(abs(a - b) for a, b in zip(ref["loss"], token_mean)) > 100 * TOL  # not the token mean in disguise
    schedules = ("1f1b", "zbv")
    results = run_ranks(_sequence_mean_worker, 2, path, schedules)
    check_equal(ref, results, schedules)
    for schedule in schedules:
        runs = [r[schedule] for r in results.values()]
        assert all(abs(r["eval"] - first) <= TOL for r in runs), f"{schedule}: eval {[r['eval'] for r in runs]}"
        assert all(r["counts"] == [BATCH] * STEPS for r in runs)  # the step divided by its sequences
        # The loss rank's objective saw every row once per step and once in the evaluation, and one microbatch
        # more: torch calls the loss once when it builds the training schedule (PipelineStage infers the
        # gradients' shapes by running it). The other rank's saw none.
        assert sorted(r["rows"] for r in runs) == [0, BATCH * (STEPS + 1) + BATCH // MICRO], schedule
