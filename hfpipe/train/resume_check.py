"""What a resumed run must share with the run that saved the checkpoint, and what it may change.

A checkpoint records the run's settings (``hfpipe.json``'s ``config``). Every FinetuneConfig field
is in exactly one of four lists (a test holds them to it, so a new field cannot slip by unsorted):

- :data:`MUST_MATCH`: the model, the data stream (dataset, its rows, their loss masks, the order)
  and the adapters. Another value would continue a different run from the middle of this one:
  refused, naming every difference.
- :data:`MAY_CHANGE`: the learning-rate schedule, the step budget and AdamW's hyperparameters.
  They apply from the resumed step on, said in one line (the checkpoint's optimizer state would
  otherwise bring back the old ones while ``hfpipe.json`` recorded the new).
- :data:`SUMMATION_ORDER`: how each step's rows are split into microbatches. Another split sums the
  same tokens' losses in another order (a change within float rounding), said in one line; refused
  only where the objective itself is taken per microbatch (a MoE router aux loss). Its default
  follows the layout (pp x vpp), so a run moves to another pipeline size with default settings.
- :data:`FREE`: how the run is laid out, logged, saved and evaluated; DCP reshards by name.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from hfpipe.checkpoint.base_record import base_difference
from hfpipe.errors import HfpipeError

__all__ = ["ResumeMismatch", "check_resume", "apply_schedule_changes", "MUST_MATCH", "MAY_CHANGE",
           "SUMMATION_ORDER", "FREE", "template_digest"]

log = logging.getLogger(__name__)

#: Settings that define the model, the data stream and the adapters: a resumed run must keep them.
MUST_MATCH = ("model", "seq_len", "batch_size", "grad_accum", "dp", "seed", "dataset",
              "dataset_config", "split", "format", "packing", "columns", "roles", "chat_template",
              "train_on_prompt", "eval_fraction", "lora_rank", "lora_alpha", "lora_dropout",
              "lora_targets", "quantize_base", "quantize_block_size", "method", "beta", "dpo_loss")
#: MUST_MATCH fields added after checkpoints were written without them, and the value those runs had.
_ADDED = {"method": "sft", "beta": 0.1, "dpo_loss": "sigmoid"}
#: Settings that split each step's rows another way: only the order of the loss sums changes.
SUMMATION_ORDER = ("microbatches",)
#: Settings whose change applies from the resumed step on (the last three to AdamW's groups).
MAY_CHANGE = ("lr", "min_lr", "lr_schedule", "warmup_steps", "max_steps", "epochs", "max_grad_norm",
              "weight_decay", "betas", "eps")
#: Settings that change how the run is laid out, saved, logged or evaluated, not what it trains.
FREE = ("output_dir", "pp", "ep", "tp",
        "cp",  # context parallelism lays the sequence out over ranks; DCP reshards by name
        "sequence_parallel", "reshard_per_microbatch", "vpp", "schedule",
        "layout", "plan_method", "dtype", "fp8", "fp8_recipe",  # how the matmuls round, not what is trained
        "activation_checkpointing", "compile",  # compiled layers compute as eager ones, names unchanged
        "save_every", "keep", "async_save", "resume", "save_hf_at_end",
        "trust_remote_code", "threads_per_rank", "log_every", "eval_dataset", "eval_split", "eval_every",
        "eval_batches", "keep_best", "report_to", "timeout",
        # the same records give the same rows with it or without it: it only decides whether to refuse
        "allow_dropped_records")
_OPTIMIZER = ("weight_decay", "betas", "eps")


class ResumeMismatch(HfpipeError):
    """The checkpoint was written by a run with other settings (one line: every difference)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_resume(path, saved: dict, cfg, tied: bool, per_microbatch: bool = False) -> list[str]:
    """Refuse a resume that changes the run's meaning; return the names of changed MAY_CHANGE fields.

    Args:
        path: The checkpoint (for the message).
        saved: Its ``hfpipe.json``.
        cfg: This run's FinetuneConfig.
        tied: Whether this run's model ties its head to the embedding.
        per_microbatch: Whether the objective is taken per microbatch (a MoE router aux loss), so that
            another microbatch count would change what is trained.
    """
    old = _recorded(path, saved)
    now = cfg.to_dict()
    diffs = [f"{_flag(k)} {old.get(k)!r} -> {now.get(k)!r}" for k in MUST_MATCH
             if _norm(k, old.get(k)) != _norm(k, now.get(k))]
    diffs += _microbatches_changed(path, old, cfg, per_microbatch)
    digest = (saved.get("data") or {}).get("chat_template_sha256")
    if digest and "--chat-template" not in " ".join(diffs) and digest != template_digest(cfg.chat_template):
        diffs.append(f"--chat-template {cfg.chat_template}: the file changed since the checkpoint")
    if "tied" in saved and bool(saved["tied"]) != tied:
        diffs.append(f"tie_word_embeddings {bool(saved['tied'])} -> {tied}")
    diffs += _base_changed(saved, cfg.model)
    if diffs:
        raise ResumeMismatch(f"--resume {path}: the checkpoint's run differs: {'; '.join(diffs)}; resume with "
                             "the same settings, or start a new run in another --output-dir")
    return [k for k in MAY_CHANGE if k in old and _norm(k, old.get(k)) != _norm(k, now.get(k))]


def _microbatches_changed(path, old: dict, cfg, per_microbatch: bool) -> list[str]:
    """Another microbatch count than the checkpoint's run: said (the same rows, summed in another order), or
    refused with the reason where each microbatch carries a term of its own."""
    was = old.get("microbatches") or old.get("pp", 1) * old.get("vpp", 1)  # the default then: pp x vpp
    now = cfg.num_microbatches
    if was == now:
        return []
    if per_microbatch:
        return [f"--microbatches {was!r} -> {now!r} (this model's router aux loss is taken per microbatch: pass "
                f"--microbatches {was} to keep it)"]
    log.info("--resume %s: each step's %d rows now split into %d microbatches (were %d): the same tokens, "
             "their losses summed in another order", path, cfg.batch_size, now, was)
    return []


def _recorded(path, saved: dict) -> dict:
    """The run settings ``hfpipe.json`` recorded, with every field that must match present.

    A field that is not there is a refusal, never a match: a damaged record (or one saved by the
    Python API, which records no run) would otherwise let a changed --seed or --seq-len through.
    """
    old = saved.get("config")
    old = {**_ADDED, **old} if isinstance(old, dict) and old else {}
    missing = [_flag(k) for k in MUST_MATCH if k not in old]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ResumeMismatch(f"--resume {path}: its hfpipe.json does not record the run's {shown} (damaged, or "
                             "saved by the Python API, not by hfpipe finetune); resume from a checkpoint a run "
                             "saved, or start a new run in another --output-dir")
    return old


def _base_changed(saved: dict, model: str) -> list[str]:
    """A LoRA run's base folder, against what its checkpoint recorded of it (same name, other weights:
    the adapters would go on training on another model). Local folders only: a hub snapshot's
    revision names its content."""
    folder = Path(model).expanduser()
    problem = base_difference(saved, folder) if "base" in saved and folder.is_dir() else None
    return [problem] if problem else []


#: Fields naming a file or folder: the same one given relative or absolute is the same run.
_PATHS = ("model", "dataset", "chat_template")


def _norm(key: str, value):
    """JSON gives lists where the config has tuples (``betas``): compare them alike; a path that
    exists compares as its resolved absolute form."""
    if isinstance(value, tuple):
        return list(value)
    if key in _PATHS and isinstance(value, str) and value:
        path = Path(value).expanduser()
        if path.exists():
            return str(path.resolve())
    return value


def template_digest(path: str | None) -> str | None:
    """sha256 of a ``--chat-template`` file (None without one): the masks a run trained with."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def apply_schedule_changes(changed: list[str], saved: dict, cfg, optimizer, scheduler, step: int) -> str | None:
    """Make changed LR settings take effect from ``step`` on; return the one-line note, if any.

    The scheduler's state dict restores its old ``base_lrs`` (so a new ``--lr`` would be ignored) and
    its lambda is rebuilt from this run's settings (so the schedule follows the new ``--max-steps``).
    Setting ``base_lrs`` and each group's lr to the new schedule's value at ``step`` makes the next
    step use it: no step at a stale lr, and none at lr 0 when the budget grew.
    """
    if not changed:
        return None
    _apply_optimizer(changed, cfg, optimizer)
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * fn(step)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    old = saved["config"]
    parts = ", ".join(f"{_flag(k)} {_show(old.get(k))} -> {_show(getattr(cfg, k))}" for k in changed)
    return f"resumed at step {step} with {parts}: applied from step {step + 1} on"


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _apply_optimizer(changed: list[str], cfg, optimizer) -> None:
    """Put changed AdamW settings into the groups the checkpoint restored (with its old values).

    Weight decay goes to the decay group only: :func:`hfpipe.train.optim.param_groups` keeps norms
    and biases (1-D tensors) at 0, which is how the group is told apart after a load.
    """
    if not set(changed) & set(_OPTIMIZER):
        return
    for group in optimizer.param_groups:
        if "betas" in changed:
            group["betas"] = tuple(cfg.betas)
        if "eps" in changed:
            group["eps"] = cfg.eps
        if "weight_decay" in changed and any(p.ndim >= 2 for p in group["params"]):
            group["weight_decay"] = cfg.weight_decay
