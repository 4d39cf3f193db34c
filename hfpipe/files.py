"""Opening a file a user named without hanging on it: regular files only.

A FIFO (or a socket, a device) given as a shard, a dataset or a template blocks ``open()`` or
``read()`` forever, with no word. Every file hfpipe reads from a user's path goes through
:func:`open_regular` (or is checked by :func:`check_regular` before a library reads it): it opens
without blocking, looks at what it opened, and refuses anything but a regular file in one line.
Next to the floor: it imports only :mod:`hfpipe.errors` (its errors are hfpipe's, which the CLI
reports in one line, exit 2, as it does every user error), and neither torch nor transformers.
"""

from __future__ import annotations

import difflib
import os
import stat
from pathlib import Path
from typing import BinaryIO

from hfpipe.errors import NoSuchPathError

__all__ = ["NotRegularFileError", "open_regular", "check_regular", "check_folder", "check_model_name", "did_you_mean", "meant_as_folder"]

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


class NotRegularFileError(ValueError):
    """A path that must be a file is a FIFO, socket, device or folder (reading it would hang)."""


def _refuse(path: Path, mode: int, what: str) -> NotRegularFileError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return NotRegularFileError(f"{what}{path}: is {kind}, not a regular file; give a regular file")


def open_regular(path: str | os.PathLike, what: str = "", *, buffering: int = -1) -> BinaryIO:
    """``open(path, "rb")`` for a regular file; anything else raises without blocking.

    Args:
        path: The file.
        what: A prefix for the message naming the option, e.g. ``"--dataset "``.
        buffering: As for :func:`open`.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | os.PathLike, what: str = "") -> None:
    """Refuse ``path`` unless it is a regular file (a link to one is fine); it must exist."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _refuse(Path(path), mode, what)


def check_folder(folder: str | os.PathLike, what: str = "") -> None:
    """Refuse a folder holding a FIFO, socket or device among its files (libraries read them all).

    Subfolders and broken links are left to the reader (they never block it).
    """
    for entry in sorted(Path(folder).iterdir()):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise _refuse(entry, mode, what)


def meant_as_folder(name: str) -> bool:
    """Whether ``name``, which is no folder here, was meant as one rather than as a hub id.

    A hub id is ``repo`` or ``org/repo``; a path that starts like one (``./``, ``/``, ``~``), has
    more parts, or starts in a folder that is here (``out/hff`` beside ``out/``) is a local folder.
    """
    parts = Path(name).parts
    return (name.startswith((".", "/", "~")) or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).expanduser().is_dir()))


def did_you_mean(path: str | os.PathLike) -> str:
    """`` (did you mean out/hf?)`` for the closest name beside a path that does not exist, else ''."""
    path = Path(path).expanduser()
    try:
        names = [p.name for p in path.parent.iterdir()]
    except OSError:  # the parent is missing too (or unreadable): nothing to offer
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f" (did you mean {path.parent / close[0]}?)" if close else ""


def check_model_name(name: str, what: str = "MODEL") -> None:
    """Refuse a model named as a local folder that is not there, before anything heavy loads
    (or the hub answers with "couldn't connect"); the closest name beside it is offered."""
    local = Path(name).expanduser()
    if not local.is_dir() and meant_as_folder(name):
        raise NoSuchPathError(f"{what} {name}: no such folder{did_you_mean(local)}; pass a model "
                                  "folder, hub id or checkpoint")
