"""One process per output folder: an advisory ``flock`` on a file that names its holder.

Two runs writing checkpoints into one folder (or two exports into one OUT) would interleave their
files and both report success. The lock is taken with ``LOCK_NB`` so the second one fails at once,
naming the folder and the process that holds it. The kernel drops a ``flock`` when its holder dies,
so a killed run never leaves a stale lock behind (the file may stay; it is empty of meaning then).
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from hfpipe.errors import HfpipeError

__all__ = ["FolderBusyError", "FolderLock", "run_lock"]


class FolderBusyError(HfpipeError):
    """Another hfpipe process is writing the same folder."""


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

    def check(self) -> None:
        """Raise :class:`FolderBusyError` if another process holds the lock; create nothing."""
        if self._fd is not None or not self.file.is_file():
            return
        fd = os.open(self.file, os.O_RDONLY)
        try:
            self._try_lock(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def acquire(self) -> "FolderLock":
        """Create the lock file and hold it; raise :class:`FolderBusyError` if it is held."""
        if self._fd is not None:
            return self
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._try_lock(fd)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {' '.join(sys.argv)[:500]}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock and remove the file (no-op if not held)."""
        if self._fd is None:
            return
        try:
            self.file.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

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


def run_lock(output_dir: str | Path, nnodes: int = 1, node_rank: int = 0) -> FolderLock:
    """The lock one node of a run holds on its output folder.

    The nodes of one multi-node run share the folder: each holds its own node's lock, so a second
    run is refused node by node while the run's own nodes never block each other.
    """
    name = ".hfpipe.parallel.lock" if nnodes == 1 else f".hfpipe.node{node_rank}.lock"
    return FolderLock(Path(output_dir) / name, Path(output_dir), "--output-dir")
