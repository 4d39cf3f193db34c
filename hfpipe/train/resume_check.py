"""What a resumed run must share with the run that saved the checkpoint, and what it may change.

A checkpoint records the run's settings (``hfpipe.json``'s ``config``). Resuming with another
model, tied-ness, sequence length, batch or microbatch shape, seed or dataset would continue a
different run from the middle of this one's data order: refused, naming every difference. The
pipeline layout (pp, schedule, vpp, layout) may change: DCP reshards by name. The learning-rate
settings and the step budget may change too, and apply from the resumed step on (said in one line).
"""

from __future__ import annotations

import logging

__all__ = ["ResumeMismatch", "check_resume", "apply_schedule_changes", "MUST_MATCH", "MAY_CHANGE"]

log = logging.getLogger(__name__)

#: Settings that define the data stream and the model: a resumed run must keep them.
MUST_MATCH = ("model", "seq_len", "batch_size", "microbatches", "grad_accum", "dp", "seed", "dataset",
              "dataset_config", "split", "format", "packing")
#: Settings whose change applies from the resumed step on.
MAY_CHANGE = ("lr", "min_lr", "lr_schedule", "warmup_steps", "max_steps", "epochs")


class ResumeMismatch(ValueError):
    """The checkpoint was written by a run with other settings (one line: every difference)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_resume(path, saved: dict, cfg, tied: bool) -> list[str]:
    """Refuse a resume that changes the run's meaning; return the names of changed MAY_CHANGE fields.

    Args:
        path: The checkpoint (for the message).
        saved: Its ``hfpipe.json``.
        cfg: This run's FinetuneConfig.
        tied: Whether this run's model ties its head to the embedding.
    """
    old = saved.get("config") or {}
    if "seq_len" not in old:  # written by a pipeline API save, not a run: nothing recorded to compare
        return []
    now = cfg.to_dict()
    if "microbatches" in MUST_MATCH:
        old = {**old, "microbatches": old.get("microbatches") or old.get("pp", 1) * old.get("vpp", 1)}
        now = {**now, "microbatches": cfg.num_microbatches}
    diffs = [f"{_flag(k)} {old.get(k)!r} -> {now.get(k)!r}" for k in MUST_MATCH
             if k in old and old.get(k) != now.get(k)]
    if "tied" in saved and bool(saved["tied"]) != tied:
        diffs.append(f"tie_word_embeddings {bool(saved['tied'])} -> {tied}")
    if diffs:
        raise ResumeMismatch(f"--resume {path}: the checkpoint's run differs: {'; '.join(diffs)}; resume with "
                             "the same settings, or start a new run in another --output-dir")
    return [k for k in MAY_CHANGE if k in old and old.get(k) != now.get(k)]


def apply_schedule_changes(changed: list[str], saved: dict, cfg, optimizer, scheduler, step: int) -> str | None:
    """Make changed LR settings take effect from ``step`` on; return the one-line note, if any.

    The scheduler's state dict restores its old ``base_lrs`` (so a new ``--lr`` would be ignored) and
    its lambda is rebuilt from this run's settings (so the schedule follows the new ``--max-steps``).
    Setting ``base_lrs`` and each group's lr to the new schedule's value at ``step`` makes the next
    step use it: no step at a stale lr, and none at lr 0 when the budget grew.
    """
    if not changed:
        return None
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * fn(step)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    old = saved["config"]
    parts = ", ".join(f"{_flag(k)} {old.get(k)} -> {getattr(cfg, k)}" for k in changed)
    return f"resumed at step {step} with {parts}: applied from step {step + 1} on"
