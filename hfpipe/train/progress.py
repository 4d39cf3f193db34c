"""Progress bar, JSONL metrics and TensorBoard, on the one rank that reports the loss."""

from __future__ import annotations

import json
import logging
import math
import os
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
        _drop_rows_after(out / "metrics.jsonl", start)  # steps about to be redone appear once
        self.metrics = open(out / "metrics.jsonl", "a")
        self.bar = tqdm(total=total, initial=start, desc="finetune", unit="step", dynamic_ncols=True)
        self.tb = _tensorboard(out / "tb", purge_step=start + 1)

    def log(self, step: int, result) -> dict:
        """Record one step's :class:`hfpipe.train.step.StepResult`; return the metrics row."""
        self.tokens += result.tokens
        elapsed = time.perf_counter() - self.t0
        row = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
               "tokens": result.tokens, "tokens_per_s": self.tokens / max(elapsed, 1e-9),
               "elapsed_s": elapsed}
        if not self.enabled:
            return row
        self.metrics.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
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


def _tensorboard(path: Path, purge_step: int | None = None):
    """A SummaryWriter when tensorboard is installed, else ``None`` (it is optional).

    ``purge_step``: TensorBoard hides the older events at or after it (steps a resume redoes).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path), purge_step=purge_step)


def _json_safe(row: dict) -> dict:
    """nan/inf as null: strict JSON readers reject bare NaN/Infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep only rows up to ``step``: a resumed run rewrites the later ones (one row per step)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (ValueError, AttributeError):
            continue  # a line cut by a crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
