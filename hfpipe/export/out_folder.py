"""The folder an export writes: one writer at a time, built in a hidden sibling, moved in when whole.

Shared by full, adapter and merged exports so that each one holds ``OUT``'s lock, leaves ``out``
either as it was or complete (a full disk, SIGTERM or Ctrl-C removes the sibling), reports a full
disk in one line, and leaves files as readable as ``save_pretrained``'s.

``--force`` deletes the old ``out``, so it must be a folder hfpipe exported: every export gets an
``hfpipe_export.json`` record listing its files, and ``--force`` refuses anything else (a file, a
link, a folder of other files, an export with a file put in since), and ``/``, the working folder or a
folder holding an input, whatever they hold; it deletes only the files the record lists.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from pathlib import Path

import hfpipe.export.guard as guard
from hfpipe.export.guard import ExportError
from hfpipe.checkpoint.meta import EXPORT_RECORD, copy_side_files
from hfpipe.files import SideFileError, read_side_json
from hfpipe.parallel.lock import FolderLock, write_new

__all__ = ["build_folder", "check_out", "locked_out", "make_dir", "new_parents_removed_on_failure"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def locked_out(out: Path, force: bool, protected: tuple[Path, ...]):
    """Hold ``out``'s lock (one export into a folder at a time), with ``out`` checked before and after taking it."""
    with new_parents_removed_on_failure(out):
        check_out(out, force, protected)
        with FolderLock(out.parent / f".{out.name}.lock", out, "OUT"):
            check_out(out, force, protected)  # again: another export may have finished meanwhile
            yield


@contextlib.contextmanager
def new_parents_removed_on_failure(out: Path):
    """On a failure (a bad input, a full disk, Ctrl-C), remove again the parents of ``out`` that did not exist
    before (:func:`check_out` creates them, for the lock and the hidden sibling), deepest first, while empty:
    a failed export leaves the disk as it found it."""
    new, parent = [], Path(os.path.abspath(out)).parent
    while not parent.exists() and parent != parent.parent:
        new.append(parent)
        parent = parent.parent
    try:
        yield
    except BaseException:
        for folder in new:
            try:
                folder.rmdir()
            except OSError:  # not empty (something else was put there meanwhile), or gone: leave it
                break
        raise


def build_folder(out: Path, fill, nbytes: int, record: dict | None = None, *, side_from: Path | None = None,
                 extra: dict[str, Path] | None = None) -> Path:
    """Run ``fill(tmp)`` on a hidden sibling of ``out``, then move it into place once complete.

    ``side_from``: a source folder whose model-folder files (tokenizer, chat template, ...) are
    copied in, never more readable than there; ``extra``: name -> a file copied in under that name.
    The folder gets ``hfpipe_export.json`` holding ``record`` (what was exported) and every file
    name in the folder, which marks those files as hfpipe's for a later ``--force``. On any failure
    (a full disk, SIGTERM, Ctrl-C, a bad input found midway) the sibling is removed and ``out`` is
    left as it was; a full disk becomes one line naming ``out`` and ``nbytes``.
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        with guard.signals_raise():
            shutil.rmtree(tmp, ignore_errors=True)
            make_dir(tmp)
            fill(tmp)
            _make_readable(tmp)  # what hfpipe wrote; copies below keep their source's narrower modes
            if side_from is not None:
                copy_side_files(side_from, tmp)
            for name, path in (extra or {}).items():
                shutil.copyfile(path, tmp / name)
            files = sorted(p.name for p in tmp.iterdir())
            write_new(tmp / EXPORT_RECORD, json.dumps({"written_by": "hfpipe", **(record or {}), "files": files},
                                                      indent=2) + "\n")
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
    """Why ``--force`` may not replace the existing ``out``; None for an earlier export or an empty folder.

    An earlier export is a folder holding a record hfpipe wrote and only the files it lists: a file
    put there since (notes, another tool's output) is not hfpipe's to delete, and is named.
    """
    info = out.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is a file, not a folder"
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return None
    if EXPORT_RECORD not in names:
        return f"holds files and no {EXPORT_RECORD}"
    if not stat.S_ISREG((out / EXPORT_RECORD).lstat().st_mode):
        return f"holds a {EXPORT_RECORD} that is not a file"
    try:
        record = read_side_json(out / EXPORT_RECORD)
    except SideFileError:
        return f"holds an unreadable {EXPORT_RECORD}"
    if not isinstance(record, dict) or record.get("written_by") != "hfpipe":
        return f"holds a {EXPORT_RECORD} hfpipe did not write"
    listed = record.get("files")
    if not isinstance(listed, list):
        return f"holds a {EXPORT_RECORD} that lists no files (an older hfpipe's)"
    foreign = [n for n in names if n != EXPORT_RECORD and n not in listed]
    if foreign:
        return f"holds {foreign[0]!r}, which is not hfpipe's (not in its {EXPORT_RECORD})"
    return None


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
    _remove_export(old)


def _remove_export(old: Path) -> None:
    """Delete the files an earlier export's record lists, then its folder if nothing else is left."""
    if not any(old.iterdir()):
        old.rmdir()
        return
    for name in read_side_json(old / EXPORT_RECORD)["files"]:  # checked by _not_an_export just before
        if "/" not in name and name not in (".", ".."):
            (old / name).unlink(missing_ok=True)
    (old / EXPORT_RECORD).unlink()
    try:
        old.rmdir()
    except OSError:  # something was put there in the meantime: not ours to delete
        log.warning("kept %s: it holds files the earlier export did not write", old)


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
