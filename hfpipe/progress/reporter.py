"""Progress and metrics on the one rank that reports the loss.

Every ``log_every`` steps (and at the last step) one row goes to the ``--report-to`` sinks
(:mod:`hfpipe.progress.logs`): its loss is the token-weighted mean over the steps since the previous
row, i.e. the exact loss of those tokens. On a terminal a progress bar shows the latest row; when
stderr is not a terminal (a log file, a Slurm job) each row is one plain timestamped line instead,
as a bar's ``\\r`` updates would make one unreadable line of a file.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from hfpipe.progress.logs import LINES, format_line, log_line, open_sinks

__all__ = ["Reporter"]

log = logging.getLogger(__name__)


class Reporter:
    """Shows and records metrics rows; a no-op on ranks other than the reporter.

    Args:
        out: Output folder (``metrics.jsonl``, ``tb/``, ``wandb/`` go there).
        total: Steps in the run, for the bar and the ETA.
        enabled: Whether this rank reports.
        start: Steps already done (resumed runs append to the metrics file).
        log_every: Steps per row.
        report_to: ``--report-to``.
        config: The run's config as a dict (for wandb).
        tty: Whether to draw a bar (default: whether stderr is a terminal).
    """

    def __init__(self, out: Path, total: int, *, enabled: bool, start: int = 0, log_every: int = 1,
                 report_to: str = "jsonl,tensorboard", config: dict | None = None,
                 tty: bool | None = None) -> None:
        self.enabled, self.total, self.start, self.log_every = enabled, total, start, log_every
        self.t0 = time.perf_counter()
        self.tokens = self.seen = 0  # trained (loss) tokens and input positions read, since the start
        self.window: list = []  # step results since the last row
        self.bar, self.sinks, self.postfix = None, [], {}
        if not enabled:
            return
        self.sinks = open_sinks(out, report_to, config, start)
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="finetune", unit="step", dynamic_ncols=True)
        else:
            LINES.setLevel(logging.INFO)  # this rank's other loggers may be at WARNING

    def log(self, step: int, result, extra: dict | None = None) -> dict:
        """Take one step's :class:`hfpipe.train.step.StepResult` (and ``extra`` metrics of it, such as DPO's
        ``rewards/margins``); return its own metrics row.

        A row goes to the sinks when ``step`` is a multiple of ``log_every`` or the last step; its extra
        metrics are then the mean over the steps since the previous row, weighted as the loss is.
        """
        self.tokens += result.tokens
        self.seen += getattr(result, "seen", 0)
        self.window.append((result, extra or {}))
        elapsed = time.perf_counter() - self.t0
        row = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
               "tokens": result.tokens, "tokens_per_s": self.tokens / max(elapsed, 1e-9),
               "tokens_seen_per_s": self.seen / max(elapsed, 1e-9), "elapsed_s": elapsed, **(extra or {})}
        if self.bar is not None:
            self.bar.update(1)
        if step % self.log_every == 0 or step == self.total:
            self._emit(self._window_row(row), elapsed)
        return row

    def _window_row(self, row: dict) -> dict:
        tokens = sum(r.tokens for r, _ in self.window)
        loss = sum(r.loss * r.tokens for r, _ in self.window) / max(tokens, 1)
        extra = {k: sum(r.tokens * e[k] for r, e in self.window if k in e) /
                 max(1, sum(r.tokens for r, e in self.window if k in e)) for k in self.window[-1][1]}
        self.window = []
        return {**row, **extra, "loss": loss, "tokens": tokens}

    def _emit(self, row: dict, elapsed: float) -> None:
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.write(row)
        done = row["step"] - self.start
        eta = elapsed / done * (self.total - row["step"]) if done > 0 else None
        if self.bar is not None:
            self.postfix.update(loss=f"{row['loss']:.4f}", gnorm=f"{row['grad_norm']:.3f}",
                                lr=f"{row['lr']:.2e}", seen_tok_s=f"{row['tokens_seen_per_s']:.0f}",
                                trained_tok_s=f"{row['tokens_per_s']:.0f}")
            self.bar.set_postfix(self.postfix)
        else:
            LINES.info("%s", format_line(row, self.total, eta))

    def log_eval(self, row: dict) -> None:
        """Record an evaluation row (:meth:`hfpipe.train.evaluate.Evaluator.run`)."""
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.write(row)
        if self.bar is not None:
            self.postfix.update(eval_loss=f"{row['eval_loss']:.4f}")
            self.bar.set_postfix(self.postfix)
            self.bar.write(log_line(format_line(row, self.total)), file=sys.stderr)  # stays above the bar
        else:
            LINES.info("%s", format_line(row, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()
