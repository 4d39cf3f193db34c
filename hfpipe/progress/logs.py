"""Where metrics rows go (``--report-to``), the plain log line, and the commands after a run.

A row is a dict with ``step`` and either training keys (``loss``, ``grad_norm``, ``lr``, ...) or
evaluation keys (``eval_loss``, ``eval_ppl``, ``eval_tokens``). Sinks:

- ``jsonl``: one JSON object per row in ``OUT/metrics.jsonl`` (appended on resume);
- ``tensorboard``: ``train/<key>`` and ``eval/<key>`` scalars in ``OUT/tb`` (if installed);
- ``wandb``: ``wandb.log`` (the ``wandb`` extra; ``WANDB_MODE=offline`` writes ``OUT/wandb``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path

from hfpipe.errors import ConfigError

__all__ = ["IMPORT_NOISE", "LINES", "check_sinks", "default_handler", "duration", "format_line", "log_formatter",
           "log_line", "open_sinks", "quiet_import_noise", "quiet_transformers", "rank_level"]

log = logging.getLogger(__name__)
#: Logger of the plain progress lines; the reporting rank raises it to INFO (see Reporter).
LINES = logging.getLogger("hfpipe.train.lines")

_EVAL_KEYS = ("eval_loss", "eval_ppl", "eval_tokens")

#: Third-party loggers whose import-time warnings say nothing about a run: torchao 0.18, which PEFT
#: imports whenever it is installed (the ``qlora`` extra), logs that its CUDA-only kernels
#: (``_C_mxfp8``, ``_C_cutlass_90a``) do not load on this build, and torch 2.13 warns about two enums
#: torchao registers. Four such lines would open every LoRA run's output, once per rank.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def log_formatter(rank: int | None = None) -> logging.Formatter:
    """The one layout of every log line, the launcher's (``rank`` None) and each worker's.

    ``2026-11-22 17:21:39 INFO [rank1] hfpipe.train.lines: step 4/6 loss 5.9579 ...``: the date
    too, because these lines end up in Slurm and ``nohup`` files that outlive a day.
    """
    where = "" if rank is None else f"[rank{rank}] "
    return logging.Formatter(f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


def default_handler(rank: int) -> None:
    """For a script that set up no logging: hfpipe's lines on stderr, rank 0's at INFO, the others'
    warnings (``HFPIPE_LOG_LEVEL`` changes rank 0's), in :func:`log_formatter`'s layout.

    Without it a script's first minute (loading, the first step) would print nothing: Python shows
    only warnings of a library nobody configured. A script that configured logging keeps its own.
    """
    logger = logging.getLogger("hfpipe")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(rank))
    logger.addHandler(handler)
    logger.setLevel(rank_level(rank))
    logger.propagate = False


def rank_level(rank: int) -> str:
    """A rank's log level: ``HFPIPE_LOG_LEVEL`` (``--log-level``, which the launcher hands its workers;
    INFO by default) on rank 0, warnings on the others (each thing said once), all ranks at DEBUG."""
    level = (os.environ.get("HFPIPE_LOG_LEVEL") or "INFO").upper()
    if rank != 0 and level != "DEBUG":
        level = max(level, "WARNING", key=logging.getLevelName)
    return level


def log_line(text: str) -> str:
    """``text`` as this process's log handler would write it (for a line printed above a bar)."""
    record = LINES.makeRecord(LINES.name, logging.INFO, __file__, 0, text, None, None)
    handlers = [h for h in logging.getLogger("hfpipe").handlers if h.formatter is not None]
    return (handlers[0].formatter if handlers else log_formatter()).format(record)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' load reports and progress bars off while a command loads or writes a model it says
    its own words about (verify, generate, the quickstart's tiny model); both restored after."""
    from transformers.utils import logging as hf_logging  # here: this module is imported before transformers

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def quiet_import_noise(level: str) -> None:
    """Keep :data:`IMPORT_NOISE` to errors, unless hfpipe itself logs at debug level."""
    if str(level).upper() != "DEBUG":
        for name in IMPORT_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)


class _Jsonl:
    def __init__(self, out: Path, start: int = 0) -> None:
        _drop_rows_after(out / "metrics.jsonl", start)  # steps a resume redoes appear once
        self.file = open(out / "metrics.jsonl", "a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def write(self, row: dict) -> None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                name = f"eval/{key[5:]}" if key in _EVAL_KEYS else f"train/{key}"
                self.writer.add_scalar(name, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict | None) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hfpipe"), dir=str(out),
                              name=out.resolve().name, config=config or {})

    def write(self, row: dict) -> None:
        values = {(f"eval/{k[5:]}" if k in _EVAL_KEYS else f"train/{k}"): v
                  for k, v in row.items() if k != "step"}
        self.run.log(values, step=row["step"])

    def close(self) -> None:
        self.run.finish()


def check_sinks(report_to: str) -> None:
    """Raise ConfigError if a sink ``report_to`` names needs a package that is not installed."""
    import importlib.util

    if "wandb" in report_to and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report-to wandb needs the wandb package: pip install 'hfpipe[wandb]' "
                          "(WANDB_MODE=offline logs without an account)")


def open_sinks(out: Path, report_to: str, config: dict | None = None, start: int = 0) -> list:
    """The sinks ``report_to`` names (``"jsonl,tensorboard"``; ``"none"`` for none).

    ``start``: the step a resumed run continues from; rows after it are replaced, not repeated.
    """
    names = [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]
    out.mkdir(parents=True, exist_ok=True)
    sinks = []
    for name in names:
        if name == "jsonl":
            sinks.append(_Jsonl(out, start))
        elif name == "tensorboard":
            writer = _tensorboard(out / "tb", purge_step=start + 1)
            if writer is not None:
                sinks.append(_TensorBoard(writer))
        elif name == "wandb":
            sinks.append(_Wandb(out, config))
    return sinks


def _tensorboard(path: Path, purge_step: int | None = None):
    """A SummaryWriter when tensorboard is installed, else ``None`` (it is optional).

    ``purge_step``: TensorBoard hides the older events at or after it (steps a resume redoes).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        # The default --report-to names it: its absence is normal, not something to warn about.
        log.info("metrics go to metrics.jsonl only; for TensorBoard logs in tb/: pip install tensorboard")
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


def format_line(row: dict, total: int, eta_s: float | None = None) -> str:
    """One line for a log file: ``step 10/100 loss 2.3456 ...`` (the time is the log record's)."""
    if "eval_loss" in row:
        return (f"eval step {row['step']}/{total} eval_loss {row['eval_loss']:.4f} "
                f"ppl {row['eval_ppl']:.3f} tokens {row['eval_tokens']}")
    text = (f"step {row['step']}/{total} loss {row['loss']:.4f} grad_norm "
            f"{row['grad_norm']:.3f} lr {row['lr']:.2e} tok/s seen {row.get('tokens_seen_per_s', 0):.0f} "
            f"trained {row['tokens_per_s']:.0f}")
    if "rewards/margins" in row:  # preference training (--method dpo): TRL's reward metrics
        text += f" reward_acc {row['rewards/accuracies']:.3f} margin {row['rewards/margins']:.4f}"
    if eta_s is not None:
        text += f" eta {duration(eta_s)}"
    return text


def duration(seconds: float) -> str:
    """``HH:MM:SS``, with whole days in front past 24 hours (``12d 04:00:00``): a clock face wraps."""
    if seconds != seconds or seconds == float("inf"):  # NaN or endless: no number to show
        return "?"
    days, rest = divmod(int(max(0.0, seconds)), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {clock}" if days else clock
