"""Progress bar, JSONL metrics and TensorBoard, on the one rank that reports the loss."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

__all__ = ["Reporter"]

log = logging.getLogger(__name__)


class Reporter:
    """Shows and records each step's metrics; a no-op on ranks other than the reporter.

    Args:
        out: Output folder (``metrics.jsonl`` and ``tb/`` go there).
        total: Steps in the run, for the bar and the ETA.
        enabled: Whether this rank reports.
        start: Steps already done (resumed runs append to the metrics file).
    """

    def __init__(self, out: Path, total: int, *, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = self.metrics = self.tb = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        out.mkdir(parents=True, exist_ok=True)
        self.metrics = open(out / "metrics.jsonl", "a")
        self.bar = tqdm(total=total, initial=start, desc="finetune", unit="step", dynamic_ncols=True)
        self.tb = _tensorboard(out / "tb")

    def log(self, step: int, result) -> dict:
        """Record one step's :class:`hfpipe.train.step.StepResult`; return the metrics row."""
        self.tokens += result.tokens
        elapsed = time.perf_counter() - self.t0
        row = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
               "tokens": result.tokens, "tokens_per_s": self.tokens / max(elapsed, 1e-9),
               "elapsed_s": elapsed}
        if not self.enabled:
            return row
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.bar.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.3f}",
                             lr=f"{result.lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
        self.bar.update(1)
        if self.tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                self.tb.add_scalar(f"train/{key}", row[key], step)
        return row

    def close(self) -> None:
        for thing in (self.bar, self.metrics, self.tb):
            if thing is not None:
                thing.close()


def _tensorboard(path: Path):
    """A SummaryWriter when tensorboard is installed, else ``None`` (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))
