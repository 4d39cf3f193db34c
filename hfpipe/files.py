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
import errno
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from hfpipe.errors import HfpipeError, NoSuchPathError

__all__ = ["INDEX", "SINGLE", "MAX_SIDE_FILE", "NotRegularFileError", "SideFileError", "open_regular", "check_regular", "check_folder",
           "check_model_name", "did_you_mean", "meant_as_folder", "read_side_file", "read_side_json"]

#: A Hugging Face model folder's weights: the index of a sharded checkpoint, or its one file.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

#: The most hfpipe reads of any side file it keeps beside data (``hfpipe.json``, ``checksums.json``,
#: ``hfpipe_export.json``, DCP's ``.metadata``, a source's ``config.json`` and index): far above
#: what the largest model's records hold (tens of MB), far below what would exhaust memory.
MAX_SIDE_FILE = 256 << 20

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


class NotRegularFileError(HfpipeError):
    """A path that must be a file is a FIFO, socket, device or folder (reading it would hang)."""


class SideFileError(HfpipeError):
    """A record or config file is missing, a link, not a regular file, too large or not JSON."""


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


def read_side_file(path: str | os.PathLike, limit: int = MAX_SIDE_FILE, *, follow: bool = False) -> bytes:
    """The bytes of ``path``: a regular file of at most ``limit`` bytes, not read through a link.

    The one reader of every side file (records, configs, indexes): a link could point a record at
    another file (or ``/dev/zero``), and a huge record would be read whole into memory. ``follow``
    for a model folder's files, which the hub cache keeps as links to its blobs.

    Raises:
        OSError: missing, a link, not a regular file or too large; ``strerror`` says which.
    """
    nofollow = 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:  # O_NOFOLLOW met a link
            raise OSError(errno.ELOOP, "a symbolic link", str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file", str(path))
        if info.st_size > limit:
            raise OSError(0, f"too large: {info.st_size} bytes, at most {limit}", str(path))
        chunks, left = [], info.st_size
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_side_json(path: str | os.PathLike, limit: int = MAX_SIDE_FILE, *, follow: bool = False):
    """``json.loads`` of :func:`read_side_file`; every failure one :class:`SideFileError` naming ``path``.

    The message is ``"<path>: <why>"``; callers add what to do.
    """
    try:
        raw = read_side_file(path, limit, follow=follow)
    except FileNotFoundError:
        raise SideFileError(f"{path}: missing") from None
    except OSError as e:
        raise SideFileError(f"{path}: {_article(e.strerror)}") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise SideFileError(f"{path}: not valid JSON ({why})") from None


def _article(why: str | None) -> str:
    """``strerror`` as what follows "<path>: ": "not a regular file", "is a symbolic link", "unreadable (...)"."""
    if why and why.startswith(("not ", "too large")):
        return why
    if why == "a symbolic link":
        return "is a symbolic link (hfpipe does not read its records through one)"
    return f"unreadable ({why})"


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
