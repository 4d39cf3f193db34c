"""Checksums of a checkpoint's stored items: recorded when it is saved, checked before it is read.

A flipped byte inside a ``.distcp`` tensor still loads as a tensor: without a record, resume and
export use it as a good weight (issue 19: 64 flipped bytes exported with max |delta| 5.9e23). At
save every rank hashes the items of the data files it wrote, from the page cache right after
writing them, and rank 0 writes ``checksums.json``: one digest per DCP item (keyed by file and
byte offset) and one of ``.metadata``. ``hfpipe.json`` holds the digest of ``checksums.json``
itself, so a lost or replaced record is noticed as well. Readers check each item right before
they use it (resume, export, generate) and name the first damaged one in one line.

xxh3-64 because it hashes at memory speed: measured here ~12-15 GB/s on one core, against
~3.4 GB/s for ``zlib.crc32`` and ~1.5 GB/s for the kernel's file-to-file copy that export runs.
It finds rot and partial copies, not a forger (who could rewrite the record too); nothing read
from a checkpoint runs code either way (:mod:`hfpipe.checkpoint.safe_metadata`).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
from pathlib import Path

from hfpipe.errors import HfpipeError
from hfpipe.files import read_side_file

__all__ = ["ALGORITHM", "RECORD", "Checksums", "DamagedCheckpointError", "hash_items", "mine", "write_record"]

ALGORITHM = "xxh3_64"
RECORD = "checksums.json"
_MAP_ABOVE = 1 << 20  # larger ranges are hashed through mmap (no copy), smaller ones read
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter names files by writer rank


class DamagedCheckpointError(HfpipeError):
    """A checkpoint's bytes differ from what was recorded when it was saved."""


def _hasher():
    import xxhash  # a dependency of datasets, declared by hfpipe too

    return xxhash.xxh3_64()


def hash_range(path: Path, offset: int, length: int) -> str | None:
    """Hex xxh3-64 of ``length`` bytes at ``offset`` of ``path``; None if it is not a file that long."""
    h = _hasher()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < offset + length:
            return None  # mapping past the end would SIGBUS
        if length < _MAP_ABOVE:
            h.update(os.pread(fd, length, offset))
        else:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, offset + length - start, prot=mmap.PROT_READ, offset=start) as mm:
                with memoryview(mm)[offset - start:] as view:
                    h.update(view)
    finally:
        os.close(fd)
    return h.hexdigest()


def _digest(data: bytes) -> str:
    h = _hasher()
    h.update(data)
    return h.hexdigest()


def mine(metadata, rank: int, world: int) -> set[str]:
    """The data files rank ``rank`` hashes at save: those it wrote (their pages are in its cache)."""
    files = {info.relative_path for info in metadata.storage_data.values()}
    out = set()
    for name in files:
        m = _RANK_FILE.match(name)
        if (int(m.group(1)) % world if m else 0) == rank:
            out.add(name)
    return out


def hash_items(ckpt: Path, metadata, files: set[str]) -> list[list]:
    """``[file, offset, length, digest]`` of every item stored in ``files`` of ``ckpt``."""
    items = sorted({(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()
                    if i.relative_path in files})
    return [[name, offset, length, hash_range(ckpt / name, offset, length)] for name, offset, length in items]


def write_record(ckpt: Path, rows: list[list]) -> dict:
    """Write ``checksums.json`` (new file) from every rank's rows; return ``hfpipe.json``'s entry."""
    items: dict[str, dict[str, list]] = {}
    for name, offset, length, digest in rows:
        items.setdefault(name, {})[str(offset)] = [length, digest]
    meta = read_side_file(ckpt / ".metadata")
    text = json.dumps({"algorithm": ALGORITHM, "metadata": _digest(meta), "items": items}, sort_keys=True)
    # a new file, never through a planted link (as hfpipe.parallel.lock.write_new; this module imports no hfpipe)
    fd = os.open(ckpt / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return {"file": RECORD, "algorithm": ALGORITHM, "digest": _digest(text.encode())}


def _read_or_empty(path: Path) -> bytes:
    try:
        return read_side_file(path)
    except OSError:  # missing or not a file: differs from the recorded digest, named as damaged
        return b""


class Checksums:
    """The record of one checkpoint; :meth:`check` verifies an item against it.

    Use :meth:`load`, which returns ``None`` for a checkpoint saved before hfpipe recorded checksums.
    """

    def __init__(self, ckpt: Path, items: dict[tuple[str, int], tuple[int, str]]) -> None:
        self.ckpt, self.items = ckpt, items

    @classmethod
    def load(cls, ckpt: str | Path) -> Checksums:
        """The record of ``ckpt`` named by its ``hfpipe.json``, checked against it; ``.metadata`` checked too.

        Every checkpoint hfpipe writes has one, so no record is damage, never "nothing to check":
        an ``hfpipe.json`` that is a link, unreadable or without its ``checksums`` entry is refused.

        Raises:
            DamagedCheckpointError: the record is missing, damaged or replaced, or ``.metadata`` is damaged.
        """
        ckpt = Path(ckpt)
        entry = _record_entry(ckpt)
        record = cls._read_record(ckpt, entry)
        items = {}
        try:
            for name, by_offset in record["items"].items():
                for offset, (length, digest) in by_offset.items():
                    items[(name, int(offset))] = (int(length), str(digest))
            want = str(record["metadata"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DamagedCheckpointError(f"checkpoint {ckpt}: {RECORD} is malformed; pick an earlier "
                                         "checkpoint") from None
        if _digest(_read_or_empty(ckpt / ".metadata")) != want:
            raise DamagedCheckpointError(f"checkpoint {ckpt}: .metadata is damaged (fails its {ALGORITHM} "
                                         "checksum); pick an earlier checkpoint")
        return cls(ckpt, items)

    @staticmethod
    def _read_record(ckpt: Path, entry: dict) -> dict:
        path = ckpt / RECORD
        try:
            raw = read_side_file(path)
        except OSError as e:
            raise DamagedCheckpointError(f"checkpoint {ckpt}: {RECORD} named by hfpipe.json cannot be read "
                                         f"({e.strerror}); pick an earlier checkpoint") from None
        if _digest(raw) != entry.get("digest"):
            raise DamagedCheckpointError(f"checkpoint {ckpt}: {RECORD} is damaged or was replaced (fails "
                                         "hfpipe.json's digest); pick an earlier checkpoint")
        try:
            record = json.loads(raw)
        except ValueError:  # the digest matched: hfpipe.json was rewritten to fit a bad record
            record = None
        if not isinstance(record, dict):
            raise DamagedCheckpointError(f"checkpoint {ckpt}: {RECORD} is not a JSON object; pick an earlier "
                                         "checkpoint")
        return record

    def check(self, name: str, info) -> None:
        """Raise :class:`DamagedCheckpointError` unless item ``name`` (DCP ``_StorageInfo`` ``info``) is intact."""
        where = f"{info.relative_path} bytes {info.offset}-{info.offset + info.length}"
        want = self.items.get((info.relative_path, info.offset))
        if want is None or want[0] != info.length:
            raise DamagedCheckpointError(f"checkpoint {self.ckpt}: {name} ({where}) has no checksum recorded at "
                                         "save; the checkpoint was changed since: pick an earlier checkpoint")
        got = hash_range(self.ckpt / info.relative_path, info.offset, info.length)
        if got is None:
            raise DamagedCheckpointError(f"checkpoint {self.ckpt}: {name} is damaged ({info.relative_path} is "
                                         f"truncated before byte {info.offset + info.length}); pick an earlier checkpoint")
        if got != want[1]:
            raise DamagedCheckpointError(f"checkpoint {self.ckpt}: {name} is damaged ({where} fail their "
                                         f"{ALGORITHM} checksum); pick an earlier checkpoint")


def _record_entry(ckpt: Path) -> dict:
    """``hfpipe.json``'s ``checksums`` entry: present, and naming a record this hfpipe reads."""
    path = ckpt / "hfpipe.json"
    try:
        meta = json.loads(read_side_file(path))
    except OSError as e:
        why = "missing" if isinstance(e, FileNotFoundError) else e.strerror
        raise DamagedCheckpointError(f"checkpoint {ckpt}: hfpipe.json cannot be read ({why}); pick an "
                                     "earlier checkpoint") from None
    except ValueError:
        raise DamagedCheckpointError(f"checkpoint {ckpt}: hfpipe.json: not valid JSON; pick an earlier "
                                     "checkpoint") from None
    entry = meta.get("checksums") if isinstance(meta, dict) else None
    if entry is None:
        raise DamagedCheckpointError(f"checkpoint {ckpt}: hfpipe.json records no checksums (every checkpoint "
                                     "hfpipe saves has them: the record was damaged); pick an earlier checkpoint")
    if not isinstance(entry, dict) or entry.get("file") != RECORD or entry.get("algorithm") != ALGORITHM:
        raise DamagedCheckpointError(f"checkpoint {ckpt}: hfpipe.json's checksums entry {entry!r} is not "
                                     f"one this hfpipe reads ({ALGORITHM} in {RECORD}); upgrade hfpipe "
                                     "or pick another checkpoint")
    return entry
