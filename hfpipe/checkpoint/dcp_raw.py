"""Where a tensor's bytes lie, as they are, inside a DCP checkpoint's ``.distcp`` files.

DCP writes each item with ``torch.save`` (an uncompressed zip) at a byte range of a ``.distcp``
file. When an item holds a whole contiguous tensor (or a row block of one, as FSDP2 shards dim 0)
its raw bytes are one zip record, and export can move them into the safetensors file with
``os.copy_file_range``: the kernel copies file to file, as ``cp`` does, with no user-space copy
(measured on this machine: a user-space read + write moves ~5x slower than ``cp``). Only the
item's small pickle is read, with ``weights_only`` and torch's ``skip_data`` (no tensor bytes),
to check shape, dtype and layout; anything else (transformed items, views, other layouts) is left
to the ordinary reader.

The kernel's copy is CPU-bound memcpy between page-cache pages, one core per call (``cp`` makes a
single call). :class:`CopyPool` fills several output files at once, so export uses every core it
has: measured here, 2 threads copy 1.86 GB into two files in 0.40 s against 0.76 s for one.

Copying raw bytes must not copy rot: each span carries the check of its DCP item's checksum
(:mod:`.checksums`), run by the copying thread right after the copy, while the item's pages are
in the page cache (a hash at ~10x the copy's speed, on the same cores; the temporary folder is
removed when a check fails).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["CopyPool", "RawSpan", "copy_raw", "copy_span", "default_workers", "raw_spans"]

_RECORD = re.compile(r"(^|/)data/\d+$")


@dataclass(frozen=True)
class RawSpan:
    """``nbytes`` raw bytes at ``offset`` of ``path`` that belong at ``dst`` bytes into the tensor."""

    path: Path
    offset: int
    nbytes: int
    dst: int
    verify: Callable[[], None] | None = field(default=None, compare=False)  # its DCP item's checksum


def raw_spans(ckpt: Path, metadata, key: str, file_view, checksums=None) -> list[RawSpan] | None:
    """The raw byte spans making up ``key``'s whole tensor, or ``None`` if they do not lie as is.

    With ``checksums`` (a :class:`~hfpipe.checkpoint.checksums.Checksums`) each span verifies its item.
    """
    md = metadata.state_dict_metadata[key]
    size, dtype = tuple(md.size), md.properties.dtype
    row = math.prod(size[1:]) * dtype.itemsize
    spans = []
    for chunk in md.chunks:
        if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != size[1:]:
            return None  # not a block of whole rows
        info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        if info.transform_descriptors or file_view is None:
            return None
        try:
            span = _record(ckpt / info.relative_path, info.offset, info.length, tuple(chunk.sizes), dtype, file_view)
        except Exception:  # noqa: BLE001 - a damaged item: the ordinary reader checks it and names it
            span = None
        if span is None:
            return None
        verify = None if checksums is None else functools.partial(checksums.check, key, info)
        spans.append(RawSpan(span[0], span[1], span[2], chunk.offsets[0] * row if size else 0, verify))
    covered = sum(s.nbytes for s in spans)
    return spans if covered == math.prod(size) * dtype.itemsize else None


def _record(path: Path, start: int, length: int, shape: tuple, dtype, file_view):
    """(path, offset, nbytes) of the single storage record of a saved contiguous tensor."""
    with open(path, "rb") as f:
        view = file_view(f, start, length)
        with torch.serialization.skip_data():  # the pickle only: shape, dtype, layout
            t = torch.load(view, map_location="cpu", weights_only=True)
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                or not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes):
            return None
        view.seek(0)
        archive = torch._C.PyTorchFileReader(view)  # torch.load's own zip reader (also used for mmap)
        records = [r for r in archive.get_all_records() if _RECORD.search(r)]
        if len(records) != 1:
            return None
        return path, start + archive.get_record_offset(records[0]), t.nbytes


def copy_span(src_fd: int, dst_fd: int, nbytes: int, src_offset: int, dst_offset: int) -> None:
    """Copy file to file in the kernel (``copy_file_range``), falling back to read + write."""
    done = 0
    while done < nbytes:
        try:
            n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
        except (AttributeError, OSError):  # not Linux, or across file systems that refuse it
            n = os.pwrite(dst_fd, os.pread(src_fd, min(nbytes - done, 1 << 26), src_offset + done),
                          dst_offset + done)
        if n <= 0:
            raise OSError(f"short copy from a DCP file at byte {src_offset + done}")
        done += n


def copy_raw(span: RawSpan, dst_fd: int, dst_offset: int) -> None:
    """Copy ``span`` to ``dst_offset`` of ``dst_fd`` in the kernel, then check its item's checksum."""
    _copy_from(span.path, dst_fd, span.nbytes, span.offset, dst_offset)
    if span.verify is not None:
        span.verify()  # after the copy: the item's pages are in the page cache now


def default_workers() -> int:
    """Copy threads: the cores this process may use, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


class CopyPool:
    """Kernel copies (:func:`copy_span`) into several files at once, one file per thread.

    ``copy_file_range`` releases the GIL, but the kernel serialises writers to one file (its inode
    lock; measured here: two threads into one file take as long as one thread), so the unit of
    work is a whole output file. At most ``2 * workers`` files are queued, which bounds the open
    files and raises a failed copy (a full disk) soon after it happened. Use it as a context
    manager: leaving waits for every started copy and cancels the rest, so no thread writes to a
    file descriptor after its owner has closed it.

    Args:
        workers: Threads (default: the usable cores, at most 8).
        progress: Called with the bytes of each finished span, from the pool's threads (so thread-safe).
    """

    def __init__(self, workers: int | None = None, progress=None):
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="hfpipe-copy")
        self._queue: collections.deque[Future] = collections.deque()
        self._progress = progress

    def run(self, dst_fd: int, copies: list[tuple[RawSpan, int]]) -> Future:
        """Copy each span to its offset of ``dst_fd``, in one task; waits first if too many are queued."""
        while len(self._queue) >= 2 * self.workers:
            self._queue.popleft().result()  # raises a failed copy here, in the caller's thread
        future = self._pool.submit(self._copy_all, dst_fd, copies)
        self._queue.append(future)
        return future

    def _copy_all(self, dst_fd: int, copies: list[tuple[RawSpan, int]]) -> None:
        for span, dst_offset in copies:
            copy_raw(span, dst_fd, dst_offset)
            if self._progress is not None:
                self._progress(span.nbytes)

    def __enter__(self) -> CopyPool:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _copy_from(path: Path, dst_fd: int, nbytes: int, src_offset: int, dst_offset: int) -> None:
    src = os.open(path, os.O_RDONLY)
    try:
        copy_span(src, dst_fd, nbytes, src_offset, dst_offset)
    finally:
        os.close(src)
