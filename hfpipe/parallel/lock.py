"""One process per output folder: an advisory ``flock`` on a file that names its holder.

Two runs writing checkpoints into one folder (or two exports into one OUT) would interleave their
files and both report success. The lock is taken with ``LOCK_NB`` so the second one fails at once,
naming the folder and the process that holds it. The kernel drops a ``flock`` when its holder dies,
so a killed run never leaves a stale lock behind (the file may stay; it is empty of meaning then).

The lock file lives in a folder others may write to (a shared scratch, a parent of OUT), and it is
truncated and written: opened through a planted link it would clobber whatever the link names.
So it is opened relative to its folder's descriptor with ``O_NOFOLLOW`` (a symlink is refused),
must be a regular file with one link (a hard link to another file is refused), and is only written
once locked. :func:`write_new` is the same rule for the files hfpipe creates in its own folders.

The lock creates its folder (and any missing parent) when taken; on release it removes again those it
created that are empty then, so a run stopped before it wrote anything (Ctrl-C in start-up) leaves no
folder behind. ``rmdir`` removes only an empty folder, so one with contents stays, and a folder that
was there before the lock is never touched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
from pathlib import Path

from hfpipe.errors import HfpipeError

__all__ = ["FolderBusyError", "FolderLock", "LockFileError", "run_lock", "write_new"]

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO never hangs open()


class FolderBusyError(HfpipeError):
    """Another hfpipe process is writing the same folder."""


class LockFileError(HfpipeError):
    """The lock file is a link or not a regular file: hfpipe will not write through it."""


def write_new(path: str | Path, text: str) -> None:
    """Create ``path`` with ``text``; refuse to follow a link or to reuse a file that is already there.

    Raises:
        FileExistsError: ``path`` exists (a file, a folder, or a link, dangling or not).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        data, done = text.encode(), 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


class FolderLock:
    """An exclusive, non-blocking lock on ``lock_file``, for the folder ``folder``.

    Args:
        lock_file: The file locked (created on :meth:`acquire`).
        folder: What the user named (for the message).
        option: The option to change (``--output-dir``, ``OUT``).
    """

    def __init__(self, lock_file: Path, folder: Path, option: str) -> None:
        self.file, self.folder, self.option = Path(lock_file), Path(folder), option
        self._fd: int | None = None
        self._dir: int | None = None
        self._made: list[Path] = []  # the folders acquire() created, outermost first

    def check(self) -> None:
        """Raise :class:`FolderBusyError` if another process holds the lock; create nothing."""
        if self._fd is not None or not self.file.parent.is_dir():
            return
        dir_fd = os.open(self.file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = self._open(dir_fd, create=False)
            if fd is None:
                return
            try:
                self._try_lock(fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def acquire(self) -> "FolderLock":
        """Create the lock file and hold it; raise :class:`FolderBusyError` if it is held."""
        if self._fd is not None:
            return self
        made, dir_fd = _make_dirs(self.file.parent), None
        try:
            dir_fd = os.open(self.file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fd = self._lock_current(dir_fd)
        except BaseException:
            if dir_fd is not None:
                os.close(dir_fd)
            _remove_empty(made)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {' '.join(sys.argv)[:500]}\n".encode(), 0)
        self._fd, self._dir, self._made = fd, dir_fd, made
        return self

    def _lock_current(self, dir_fd: int) -> int:
        """Lock the file the name refers to now; retry when a releasing holder unlinked it meanwhile."""
        for _ in range(100):
            fd = self._open(dir_fd, create=True)
            try:
                self._try_lock(fd)
                if _same_file(fd, dir_fd, self.file.name):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # we locked a file its holder unlinked on release: lock the new one
        raise FolderBusyError(f"{self.option} {self.folder}: its lock file {self.file} keeps changing; "
                              f"another process is racing for it: choose another {self.option}")

    def _open(self, dir_fd: int, create: bool) -> int | None:
        """The lock file, opened without following a link; None if it is absent and not ``create``."""
        name, mode = self.file.name, (os.O_RDWR if create else os.O_RDONLY) | _NOFOLLOW
        try:
            fd = os.open(name, mode | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd) if create else None
        except FileExistsError:
            fd = None
        try:
            if fd is None:
                fd = os.open(name, mode, dir_fd=dir_fd)
        except FileNotFoundError:
            if create:  # removed between our two opens: its holder released it
                return self._open(dir_fd, create)
            return None
        except IsADirectoryError:
            raise LockFileError(self._refusal("is not a regular file")) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise LockFileError(self._refusal("is a symbolic link")) from None
        info = os.fstat(fd)
        why = ("is not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"has {info.st_nlink} hard links" if info.st_nlink != 1 else None)
        if why is not None:
            os.close(fd)
            raise LockFileError(self._refusal(why))
        return fd

    def _refusal(self, why: str) -> str:
        return (f"{self.option} {self.folder}: its lock file {self.file} {why}; hfpipe never writes "
                "through one (it would overwrite what it points to): remove it and run again")

    def release(self) -> None:
        """Drop the lock and remove the file (no-op if not held)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self._dir, self.file.name):  # never unlink what someone put there since
                os.unlink(self.file.name, dir_fd=self._dir)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            os.close(self._dir)
            self._fd = self._dir = None
            _remove_empty(self._made)  # what a run that wrote nothing leaves: none of our folders
            self._made = []

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _try_lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 600, 0).decode(errors="replace").strip() or "unknown"
            pid, _, cmd = holder.partition(" ")
            raise FolderBusyError(
                f"{self.option} {self.folder} is in use by process {pid} ({cmd or 'hfpipe'}); wait for it "
                f"to finish or stop it, or choose another {self.option}") from None


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those this call created, outermost first.

    One ``mkdir`` per level rather than ``mkdir(parents=True)``: a folder another process made meanwhile
    is not counted as ours, so it is never removed by :func:`_remove_empty`.
    """
    folder = Path(os.path.abspath(folder))  # removed by the same path even if the working folder changes
    made: list[Path] = []
    try:
        for path in [p for p in (folder, *folder.parents) if not p.is_dir()][::-1]:
            try:
                path.mkdir()
            except FileExistsError:
                if not path.is_dir():
                    raise
                continue
            made.append(path)
    except BaseException:
        _remove_empty(made)
        raise
    return made


def _remove_empty(made: list[Path]) -> None:
    """Remove the folders in ``made`` (outermost first) that are empty, innermost first; stop at one that is not."""
    for path in reversed(made):
        try:
            path.rmdir()  # refuses a folder with contents: what the run wrote stays
        except OSError:
            return


def _same_file(fd: int, dir_fd: int, name: str) -> bool:
    """Whether ``name`` in ``dir_fd`` is still the file open as ``fd``."""
    try:
        here = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def run_lock(output_dir: str | Path, nnodes: int = 1, node_rank: int = 0) -> FolderLock:
    """The lock one node of a run holds on its output folder.

    The nodes of one multi-node run share the folder: each holds its own node's lock, so a second
    run is refused node by node while the run's own nodes never block each other.
    """
    name = ".hfpipe.parallel.lock" if nnodes == 1 else f".hfpipe.node{node_rank}.lock"
    return FolderLock(Path(output_dir) / name, Path(output_dir), "--output-dir")
