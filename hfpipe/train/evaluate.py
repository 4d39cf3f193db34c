"""Evaluation while training: the exact loss transformers' model reports on the whole evaluation set.

The loss is (sum of every token's loss) / (number of tokens) over *all* evaluation batches and
dp ranks, not a mean of batch means, so it equals a single-process evaluation of the same rows. A MoE
model whose config asks for router logits adds ``router_aux_loss_coef * aux`` as its forward does, the aux
loss taken over every row of the set at once (its sums are added over batches and ranks, then finished:
hfpipe.models.router_loss): ``eval_loss`` is then transformers' ``loss`` of the set run as one batch, and
``eval_ppl`` stays the exp of the language-model part.
Every row is used once: rows are dealt in order, global batch after global batch, and the last
global batch is filled with copies of a row whose labels are all ignored (they add no loss and
no token; a real input rather than padding keeps attention free of fully masked rows; their
``router_mask`` of zeros keeps them out of a router aux loss).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from hfpipe.data.config import COLUMNS
from hfpipe.loss.tokens import IGNORE_INDEX, count_tokens

__all__ = ["Evaluator", "eval_batches"]

log = logging.getLogger(__name__)

_CHUNK = 16  # batches held in memory per trainer.eval_loss call


def eval_batches(rows, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 limit: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This dp rank's evaluation batches: every row once, in order (see the module docstring).

    Args:
        rows: Rows from :func:`hfpipe.data.load.load_splits`.
        batch_size: Rows per rank per batch.
        dp_rank, dp_size: This rank's place among the data-parallel replicas.
        limit: At most this many global batches.
    """
    view = rows.with_format("numpy", columns=list(COLUMNS))
    g = batch_size * dp_size
    count = math.ceil(len(rows) / g) if limit is None else min(limit, math.ceil(len(rows) / g))
    for b in range(count):
        first = b * g + dp_rank * batch_size
        take = list(range(first, min(first + batch_size, len(rows))))
        batch = {c: torch.from_numpy(view[take][c]).long() if take else None for c in COLUMNS}
        yield _fill(batch, view, batch_size)


def _fill(batch: dict, view, batch_size: int) -> dict[str, torch.Tensor]:
    """Complete a short batch with rows that carry no loss (copies of row 0, labels ignored)."""
    have = 0 if batch["input_ids"] is None else len(batch["input_ids"])
    if have == batch_size:
        return batch
    filler = {c: torch.from_numpy(view[[0] * (batch_size - have)][c]).long() for c in COLUMNS}
    filler["labels"].fill_(IGNORE_INDEX)
    filler["router_mask"] = torch.zeros_like(filler["input_ids"])
    if have == 0:
        return filler
    batch = {**batch, "router_mask": torch.ones_like(batch["input_ids"])}
    return {c: torch.cat([batch[c], filler[c]]) for c in filler}


def eval_tokens(rows, *, batch_size: int, dp_size: int, limit: int | None) -> int:
    """Tokens the evaluation covers (after the causal shift), the same number on every rank."""
    g = batch_size * dp_size
    n = len(rows) if limit is None else min(len(rows), limit * g)
    view, tokens = rows.with_format("numpy", columns=["labels"]), 0
    for a in range(0, n, 1024):  # a slice at a time: the eval set may be large
        tokens += count_tokens(view[a : min(a + 1024, n)]["labels"])
    return tokens


class Evaluator:
    """Runs the evaluation when it is due and remembers the best loss.

    Args:
        cfg: The run's :class:`hfpipe.config.run.FinetuneConfig`.
        trainer: The :class:`hfpipe.train.step.StepEngine` (its ``eval_loss``).
        rows: The evaluation rows, or None (then nothing is ever due).
        dist_info: This rank's :class:`hfpipe.parallel.mesh.Dist`.
        out: The output folder (the best checkpoint's record is read from ``out/best``).
    """

    def __init__(self, cfg, trainer, rows, dist_info, out: Path) -> None:
        self.cfg, self.trainer, self.rows, self.dist = cfg, trainer, rows, dist_info
        self.last_step: int | None = None
        self.best = _best_so_far(out / "best")
        self.improved = False

    @property
    def enabled(self) -> bool:
        return self.rows is not None

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether to evaluate after ``step`` (every ``eval_every`` steps, and once at the end)."""
        if not self.enabled or self.last_step == step:
            return False
        return final or bool(self.cfg.eval_every and step % self.cfg.eval_every == 0)

    def run(self, step: int) -> dict:
        """Evaluate now; return the metrics row (the same on every rank)."""
        from hfpipe.data.batches import model_inputs

        kw = dict(batch_size=self.cfg.batch_size, dp_size=self.dist.dp, limit=self.cfg.eval_batches)
        tokens = eval_tokens(self.rows, **kw)
        total, chunk = None, []
        batches = eval_batches(self.rows, dp_rank=self.dist.dp_rank, **kw)
        for batch in batches:
            chunk.append(model_inputs(batch, packed=self.cfg.packing))
            if len(chunk) == _CHUNK:
                total = self._add(total, chunk)
                chunk = []
        if chunk:
            total = self._add(total, chunk)
        # whole rows counted here and summed over the cp ranks too would count each token cp times: the sums
        # come from the step engine, over every dp and cp shard once
        loss = 0.0 if total is None else total.value(self.trainer.pipe.router_loss, tokens)
        lm_loss = 0.0 if total is None else total.loss / max(tokens, 1)
        self.last_step = step
        self.improved = self.best is None or loss < self.best
        self.best = loss if self.improved else self.best
        return {"step": step, "eval_loss": loss, "eval_ppl": _ppl(lm_loss), "eval_tokens": tokens}

    def _add(self, total, chunk: list[dict]):
        """``total`` plus a chunk's :class:`hfpipe.train.step.EvalSum` over every dp and cp shard."""
        part = self.trainer.eval_sum(chunk)
        return part if total is None else total + part


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _best_so_far(root: Path) -> float | None:
    """The evaluation loss recorded with the best checkpoint of an earlier run (resume)."""
    from hfpipe.files import read_side_json

    records = sorted(root.glob("step-*/hfpipe.json"))
    if not records:
        return None
    return (read_side_json(records[-1]).get("eval") or {}).get("eval_loss")
