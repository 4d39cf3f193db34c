"""The folder an export writes: one writer at a time, built in a hidden sibling, moved in when whole.

Shared by full, adapter and merged exports so that each one holds ``OUT``'s lock, leaves ``out``
either as it was or complete (a full disk, SIGTERM or Ctrl-C removes the sibling), reports a full
disk in one line, and leaves files as readable as ``save_pretrained``'s.

``--force`` deletes the old ``out``, so it must be a folder hfpipe exported: every export gets an
``hfpipe_export.json`` record, and ``--force`` refuses anything without one (a file, a link, a
folder of other files), and ``/``, the working folder or a folder holding an input, whatever they hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

import hfpipe.checkpoint.export_guard as guard
from hfpipe.checkpoint.export_guard import ExportError
from hfpipe.checkpoint.meta import EXPORT_RECORD
from hfpipe.parallel.lock import FolderLock, write_new

__all__ = ["build_folder", "check_out", "locked_out", "make_dir"]


@contextlib.contextmanager
def locked_out(out: Path, force: bool, protected: tuple[Path, ...]):
    """Hold ``out``'s lock (one export into a folder at a time), with ``out`` checked before and after taking it."""
    check_out(out, force, protected)
    with FolderLock(out.parent / f".{out.name}.lock", out, "OUT"):
        check_out(out, force, protected)  # again: another export may have finished meanwhile
        yield


def build_folder(out: Path, fill, nbytes: int, record: dict | None = None) -> Path:
    """Run ``fill(tmp)`` on a hidden sibling of ``out``, then move it into place once complete.

    The folder gets ``hfpipe_export.json`` holding ``record`` (what was exported), which marks it
    as hfpipe's for a later ``--force``. On any failure (a full disk, SIGTERM, Ctrl-C, a bad input
    found midway) the sibling is removed and ``out`` is left as it was; a full disk becomes one line
    naming ``out`` and ``nbytes``.
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        with guard.signals_raise():
            shutil.rmtree(tmp, ignore_errors=True)
            make_dir(tmp)
            fill(tmp)
            write_new(tmp / EXPORT_RECORD, json.dumps({"written_by": "hfpipe", **(record or {})}, indent=2) + "\n")
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
    """``out`` must not hold an input, must not exist unless ``force`` (then be an earlier export),
    and its parent must be writable."""
    real, cwd = out.resolve(), Path.cwd().resolve()
    if real == Path(real.anchor) or real == cwd or real in cwd.parents:
        what = "/" if real == Path(real.anchor) else "the working folder" if real == cwd else "a parent of the working folder"
        raise ExportError(f"OUT {out} is {what}; export would replace it: choose another OUT")
    for path in protected:
        if out == path or out in path.parents or real == path.resolve() or real in path.resolve().parents:
            raise ExportError(f"out {out} would overwrite {path}; choose another --out")
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportError(f"{out} exists; pass --force to overwrite")
        why = _not_an_export(out)
        if why is not None:
            raise ExportError(f"OUT {out} {why}; --force replaces only a folder hfpipe exported (it holds "
                              f"{EXPORT_RECORD}): remove it yourself or choose another OUT")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {out.parent} ({e.strerror}); choose a writable --out") from None
    if not os.access(out.parent, os.W_OK):
        raise ExportError(f"{out.parent} is not writable; choose a writable --out")


def _not_an_export(out: Path) -> str | None:
    """Why ``--force`` may not replace the existing ``out``; None for an earlier export or an empty folder."""
    info = out.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is a file, not a folder"
    record = out / EXPORT_RECORD
    if not any(out.iterdir()):
        return None
    try:
        if not stat.S_ISREG(record.lstat().st_mode):
            return f"holds a {EXPORT_RECORD} that is not a file"
        written = json.loads(record.read_text()).get("written_by")
    except FileNotFoundError:
        return f"holds files and no {EXPORT_RECORD}"
    except (OSError, ValueError, AttributeError):
        return f"holds an unreadable {EXPORT_RECORD}"
    return None if written == "hfpipe" else f"holds a {EXPORT_RECORD} hfpipe did not write"


def make_dir(path: Path) -> None:
    try:
        path.mkdir()
    except OSError as e:
        raise ExportError(f"cannot create {path} ({e.strerror}); choose a writable --out") from None


def _install(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old ``out`` (an earlier export) is removed only after that."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return
    why = _not_an_export(out)  # again: something else may have been put there while we wrote
    if why is not None:
        raise ExportError(f"OUT {out} {why} now; it was left as it is: remove it yourself or choose another OUT")
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
