"""The folder an export writes: one writer at a time, built in a hidden sibling, moved in when whole.

Shared by full, adapter and merged exports so that each one holds ``OUT``'s lock, leaves ``out``
either as it was or complete (a full disk, SIGTERM or Ctrl-C removes the sibling), reports a full
disk in one line, and leaves files as readable as ``save_pretrained``'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import hfpipe.checkpoint.export_guard as guard
from hfpipe.checkpoint.export_guard import ExportError
from hfpipe.parallel.lock import FolderLock

__all__ = ["build_folder", "check_out", "locked_out", "make_dir"]


@contextlib.contextmanager
def locked_out(out: Path, force: bool, protected: tuple[Path, ...]):
    """Hold ``out``'s lock (one export into a folder at a time), with ``out`` checked before and after taking it."""
    check_out(out, force, protected)
    with FolderLock(out.parent / f".{out.name}.lock", out, "OUT"):
        check_out(out, force, protected)  # again: another export may have finished meanwhile
        yield


def build_folder(out: Path, fill, nbytes: int) -> Path:
    """Run ``fill(tmp)`` on a hidden sibling of ``out``, then move it into place once complete.

    On any failure (a full disk, SIGTERM, Ctrl-C, a bad input found midway) the sibling is removed
    and ``out`` is left as it was; a full disk becomes one line naming ``out`` and ``nbytes``.
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        with guard.signals_raise():
            shutil.rmtree(tmp, ignore_errors=True)
            make_dir(tmp)
            fill(tmp)
            _make_readable(tmp)
            _install(tmp, out)
    except Exception as e:  # noqa: BLE001 - only a full disk is translated; the rest re-raised
        shutil.rmtree(tmp, ignore_errors=True)
        full = guard.disk_full(e, out, nbytes)
        if full is None:
            raise
        raise full from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_out(out: Path, force: bool, protected: tuple[Path, ...]) -> None:
    """``out`` must not hold an input, must not exist unless ``force``, and its parent must be writable."""
    for path in protected:
        if out == path or out in path.parents:
            raise ExportError(f"out {out} would overwrite {path}; choose another --out")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to overwrite")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {out.parent} ({e.strerror}); choose a writable --out") from None
    if not os.access(out.parent, os.W_OK):
        raise ExportError(f"{out.parent} is not writable; choose a writable --out")


def make_dir(path: Path) -> None:
    try:
        path.mkdir()
    except OSError as e:
        raise ExportError(f"cannot create {path} ({e.strerror}); choose a writable --out") from None


def _install(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old ``out`` is removed only after that."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)  # put the previous export back
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _make_readable(folder: Path) -> None:
    """Give the exported files the modes a plain ``open`` gives (0644 under the usual umask 022).

    safetensors writes its files 0600 and ``copy2`` keeps a source's modes; a model folder is
    meant to be shared with the group, as ``save_pretrained``'s config and tokenizer files are.
    """
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777  # 0o666 minus this process's umask
    probe.unlink()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)
