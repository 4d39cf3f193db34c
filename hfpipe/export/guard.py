"""What export checks before and while it writes: the inputs it trusts, and the ways a write fails.

Kept apart from the export data path: which source files may be copied (regular files inside the
source, never a link out of it), which shard names may be read, whether the checkpoint's tied-ness
matches its source, whether every DCP data file is there and whole, and how a full disk or a
SIGTERM ends an export (one line, the temporary folder removed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hfpipe.errors import ExportError

__all__ = ["ExportError", "source_config_json", "check_tied", "check_data_files", "disk_full",
           "signals_raise"]

log = logging.getLogger(__name__)


def source_config_json(src: Path) -> dict:
    """The source's config.json as a dict (its own fields checked), or one line naming it."""
    from hfpipe.source.config import SourceError, read_config_json

    try:
        return read_config_json(src / "config.json")
    except SourceError as e:
        raise ExportError(f"{e} (or pass the source the run started from: --source)") from None


def check_tied(meta: dict, config, ckpt: Path, src: Path) -> None:
    """Refuse a checkpoint trained with another tied-ness than its source has (its head would be lost)."""

    tied = bool(getattr(config, "tie_word_embeddings", False))
    if bool(meta["tied"]) != tied:
        raise ExportError(
            f"checkpoint {ckpt} was trained with tie_word_embeddings={bool(meta['tied'])} but the source "
            f"{src} has {tied}; exporting would drop or invent lm_head: pass the source the run "
            "started from (--source)")


def check_data_files(ckpt: Path, metadata) -> None:
    """Every ``.distcp`` file the metadata names exists, is readable and holds its items' bytes."""

    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = ckpt / name
        try:
            with open(path, "rb"):
                have = path.stat().st_size
        except OSError as e:
            raise ExportError(f"checkpoint {ckpt}: data file {name} is missing or unreadable ({e.strerror}); "
                              "pick an earlier checkpoint") from None
        if have < size:
            raise ExportError(f"checkpoint {ckpt}: data file {name} is truncated ({have} of {size} bytes); "
                              "pick an earlier checkpoint")


def disk_full(e: BaseException, where: Path, nbytes: int):
    """The one-line error for ENOSPC/EDQUOT while writing ``where``, or ``None`` for other errors
    (safetensors reports it as a SafetensorError whose text carries the errno)."""
    from hfpipe.checkpoint.disk import is_disk_full

    if not is_disk_full(e):
        return None
    return ExportError(f"disk full while writing {where} (the export needs about {nbytes} bytes); "
                       "free space or choose another OUT; the partial folder was removed")


def signals_raise():
    """SIGTERM, Ctrl-C and SIGHUP unwind the block (main thread only), so cleanups run; the CLI
    then says so in one line and exits 143/130/129 (:mod:`hfpipe.parallel.signals`)."""
    from hfpipe.parallel.signals import stop_at_once

    return stop_at_once()
