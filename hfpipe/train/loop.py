"""The training loop of one rank: steps, metrics, evaluation, and when to checkpoint.

:class:`TrainLoop` runs the steps from where the data stream stands (:class:`RunPosition`), logs each, stops a
diverged run, evaluates when due, saves every ``--save-every`` steps, on an agreed stop request and at the end.

It is handed its checkpoint writer (``save_checkpoint``) rather than importing
:mod:`hfpipe.checkpoint.pipeline_state`: the loop sits a floor below it, so that :mod:`hfpipe.train.runner`,
which imports both, stays within the package's floors (the CLI stands on the runner).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hfpipe.data.batches import batches_per_epoch, iterate_batches, model_inputs
from hfpipe.parallel.launch import say_phase
from hfpipe.parallel.signals import StopRequest
from hfpipe.progress.reporter import Reporter
from hfpipe.train.evaluate import Evaluator
from hfpipe.train.finite import NonFiniteStep, check_finite
from hfpipe.train.resume_check import template_digest
from hfpipe.train.step import trainer_for

__all__ = ["RunPosition", "TrainLoop"]


@dataclass
class RunPosition:
    """Where the data stream stands: exact resume needs all three."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


class TrainLoop:
    """The training loop of one rank: steps, metrics, checkpoints.

    Args:
        cfg: The run's :class:`hfpipe.config.run.FinetuneConfig`.
        pm: This rank's pipeline.
        optimizer: Its optimizer.
        scheduler: Its learning-rate schedule.
        examples: The training rows.
        total: Optimizer steps to run in all.
        save_checkpoint: :func:`hfpipe.checkpoint.pipeline_state.save_pipeline_checkpoint` bound to ``pm``.
        held: The evaluation rows, or None.
        epoch_batches: ``(epoch, start) ->`` this rank's model batches of that epoch from batch ``start``;
            default SFT's rows (:func:`hfpipe.data.batches.iterate_batches`). ``--method dpo`` passes its pairs'.
        step_metrics: ``(batches) ->`` more metrics of a step's batches for its row (the same on every rank).
        record: More fields for every checkpoint's ``hfpipe.json`` (dpo: its stored reference log-probs).
    """

    def __init__(self, cfg, pm, optimizer, scheduler, examples, total: int, *,
                 save_checkpoint: Callable, held=None, epoch_batches: Callable | None = None,
                 step_metrics: Callable | None = None, record: dict | None = None) -> None:
        self.cfg, self.pm, self.optimizer, self.scheduler = cfg, pm, optimizer, scheduler
        self.examples, self.total = examples, total
        self.save_checkpoint = save_checkpoint
        self.held = held  # the evaluation rows, or None
        self.epoch_batches = epoch_batches or self._sft_batches
        self.step_metrics, self.record = step_metrics, record or {}
        self.trainer = trainer_for(pm, optimizer, scheduler=scheduler, max_grad_norm=cfg.max_grad_norm)
        self.pos = RunPosition()
        self.out = Path(cfg.output_dir)
        coords = pm.dist.dims.coords(pm.dist.rank)  # one reporter: the loss rank of replica 0, cp and tp rank 0
        self.reporter = coords["pp"] == pm.loss_rank and coords["dp"] == coords["cp"] == coords["tp"] == 0
        self.history: list[dict] = []
        self.evals: list[dict] = []  # evaluation rows
        self.pending = None  # the async save still being written, if any
        self.start = 0  # the step this process started (or resumed) at
        self.last_saved: Path | None = None
        self.stop = StopRequest(pm.dist.device).install()

    def resume_at(self, pos: RunPosition, saved: Path) -> None:
        """Continue from ``pos``, the position checkpoint ``saved`` recorded (already loaded)."""
        self.pos = pos
        self.start, self.last_saved = pos.step, saved

    def _batches(self):
        """Yield this dp rank's batches forever, from the saved position, epoch after epoch."""
        d = self.pm.dist
        while True:
            for batch in self.epoch_batches(self.pos.epoch, self.pos.batch_in_epoch):
                self.pos.batch_in_epoch += 1
                yield batch
            if self.pos.batch_in_epoch < batches_per_epoch(self.examples, self.cfg.batch_size, d.dp):
                raise RuntimeError("data iterator stopped early")
            self.pos.epoch += 1
            self.pos.batch_in_epoch = 0

    def _sft_batches(self, epoch: int, start: int):
        d = self.pm.dist
        for batch in iterate_batches(self.examples, batch_size=self.cfg.batch_size, seed=self.cfg.seed, epoch=epoch,
                                     dp_rank=d.dp_rank, dp_size=d.dp, start=start):
            yield model_inputs(batch, packed=self.cfg.packing)

    def train(self) -> dict:
        """Run the steps left and save the last one; return the summary (``{}`` on a rank that does not report).

        A stop request ends the loop after a saved step, with ``"interrupted"`` in the summary of every rank.
        """
        stream = self._batches()
        report = Reporter(self.out, self.total, enabled=self.reporter, start=self.pos.step,
                          log_every=self.cfg.log_every, report_to=self.cfg.report_to,
                          config=self.cfg.to_dict())
        evaluator = Evaluator(self.cfg, self.trainer, self.held, self.pm.dist, self.out)
        while self.pos.step < self.total:
            batches = [next(stream) for _ in range(self.cfg.grad_accum)]
            result = self.trainer.step(batches)
            if self.pos.step == self.start:  # the first step's line follows: the launcher's ticker stops
                say_phase(None)
            self.pos.step += 1
            row = report.log(self.pos.step, result, self.step_metrics(batches) if self.step_metrics else None)
            self.history.append(row)
            self._stop_if_diverged(result, report)
            if evaluator.due(self.pos.step, final=self.pos.step == self.total):
                self._evaluate(evaluator, report)
            signum = self.stop.agreed()  # collective: every rank stops after the same step
            if signum or (self.cfg.save_every and self.pos.step % self.cfg.save_every == 0):
                self.save()
            if signum:
                return self._interrupted(signum, report)
        if evaluator.due(self.pos.step, final=True):  # a resumed run that had nothing left to do
            self._evaluate(evaluator, report)
        report.close()
        say_phase("saving the last checkpoint" + (", exporting" if self.cfg.save_hf_at_end else "") + " and stopping")
        if self.pos.step > self.start and self.last_saved != self.step_dir():
            self.save()  # never at a step already saved: a finished run resumed is not rewritten
        if self.pending is not None:
            self.pending.wait()
        return self._summary()

    def _summary(self) -> dict:
        if not self.reporter:
            return {}
        best = next(iter(sorted((self.out / "best").glob("step-*"))), None) if self.cfg.keep_best else None
        return {"history": self.history, "checkpoint": str(self.step_dir()), "evals": self.evals,
                "best": str(best) if best else None}

    def _evaluate(self, evaluator, report) -> None:
        """Evaluate, record the row, and with --keep-best save a new best model to out/best."""
        row = evaluator.run(self.pos.step)
        report.log_eval(row)
        self.evals.append(row)
        if self.cfg.keep_best and evaluator.improved:
            if self.pending is not None:  # one save in flight at a time
                self.pending.wait()
                self.pending = None
            self.save_checkpoint(self.out / "best", self.pos.step, None, keep=1,
                                 extra={"config": self.cfg.to_dict(), "eval": row})

    def step_dir(self) -> Path:
        """The checkpoint folder of the step the loop stands at."""
        return self.out / "checkpoints" / f"step-{self.pos.step:08d}"

    def _stop_if_diverged(self, result, report) -> None:
        try:
            check_finite(self.pos.step, result.loss, result.grad_norm, self.last_saved)
        except NonFiniteStep:
            report.close()
            if self.pending is not None:
                self.pending.wait()  # the save in flight is of a good step: let it finish
            raise

    def _interrupted(self, signum: int, report) -> dict:
        """After a stop request: the checkpoint is saved; finish it and say so (every rank)."""
        report.close()
        if self.pending is not None:
            self.pending.wait()
        self.stop.uninstall()
        return {"interrupted": signum, "step": self.pos.step, "checkpoint": str(self.step_dir()),
                "history": self.history}

    def save(self) -> None:
        """Save this step's checkpoint (asynchronously with --async-save), after the one in flight."""
        extra = {"config": self.cfg.to_dict(), **self.record,
                 "train": {"position": vars(self.pos).copy(), "scheduler": self.scheduler.state_dict()}}
        if self.cfg.chat_template:  # a resume must mask the data the same way: the file, not its name
            extra["data"] = {"chat_template_sha256": template_digest(self.cfg.chat_template)}
        if self.pending is not None:  # one save in flight at a time; finalise the previous first
            self.pending.wait()
        saved = self.save_checkpoint(self.out / "checkpoints", self.pos.step, self.optimizer,
                                     keep=self.cfg.keep, extra=extra, async_save=self.cfg.async_save)
        self.pending = saved if self.cfg.async_save else None
        self.last_saved = self.step_dir()
