"""Reading named tensors out of a safetensors file with plain ``read`` calls.

Why not ``safetensors.safe_open``: it memory-maps the whole file, so every page a stage touches
counts in its resident memory and file-backed pages linger until the file is closed. A pipeline
rank must read *only* its own tensors and hold nothing else; reading each tensor's byte range
straight into its final buffer does that with one copy and makes "bytes read" exact (the format is
an 8-byte header length, a JSON header, then raw little-endian tensor bytes).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

__all__ = ["SafetensorsError", "read_header", "check_header", "read_tensors", "DTYPES"]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BOOL": torch.bool,
}

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own bound


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed."""


def read_header(path: str | Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header (``__metadata__`` removed), checked totally.

    Nothing of the data is read before the whole header passes safetensors' own rules (see
    :func:`check_header`), so a crafted header cannot make hfpipe allocate or alias anything.

    Raises:
        SafetensorsError: the file is missing, too short, or its header breaks a rule (names which).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file (no header); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{path}: corrupt safetensors header length {n} "
                                       f"(file has {size} bytes); re-download it")
            raw = f.read(n)
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: shard file is missing; re-download the checkpoint") from None
    except IsADirectoryError:
        raise SafetensorsError(f"{path}: is a folder, not a safetensors shard; re-download the checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError, _Duplicate) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header ({e}); re-download it") from None
    check_header(path, header, size - 8 - n)
    header.pop("__metadata__", None)
    header["__data_start__"] = {"offset": 8 + n}
    return header


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise _Duplicate(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def check_header(path: Path, header, data_len: int) -> None:
    """Raise :class:`SafetensorsError` unless ``header`` follows safetensors' rules.

    The rules of safetensors' own ``Metadata::validate``: a JSON object; ``__metadata__`` (if any)
    maps strings to strings; every tensor has a known ``dtype``, a ``shape`` of non-negative ints and
    ``data_offsets`` ``[begin, end]`` whose length is ``numel * itemsize``; sorted by offset, the
    tensors tile the data area exactly (no gap, no overlap, nothing beyond the file).
    """
    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: {what}; not a valid safetensors file: re-download or re-save it")

    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must map strings to strings")
    spans = []
    for name, entry in header.items():
        if name != "__metadata__":
            spans.append((*_check_entry(name, entry, bad), name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap at byte {end}"
            raise bad(f"tensor {name!r} data_offsets [{begin}, {stop}] {what}")
        end = stop
    if end > data_len:
        raise SafetensorsError(f"{path}: truncated shard: its tensors need {end} data bytes but the file "
                               f"holds {data_len}; re-download it")
    if end < data_len:
        raise bad(f"{data_len - end} bytes follow the last tensor")


def _check_entry(name: str, entry, bad) -> tuple[int, int]:
    if not isinstance(entry, dict):
        raise bad(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if begin > end:
        raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}] are reversed")
    numel = 1
    for d in shape:
        numel *= d
    if numel * DTYPES[dtype].itemsize != end - begin:
        raise bad(f"tensor {name!r}: shape {shape} of {dtype} needs {numel * DTYPES[dtype].itemsize} "
                  f"bytes but data_offsets span {end - begin}")
    return begin, end


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_tensors(path: str | Path, names: list[str], header: dict | None = None,
                 rows: dict[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Read ``names`` from ``path``, each straight into a fresh CPU tensor.

    Args:
        path: The safetensors file.
        names: Tensor names to read; reading follows file order for sequential I/O.
        header: ``read_header(path)`` if the caller already has it.
        rows: Name -> rows ``[lo, hi)`` of dim 0 to read instead of the whole tensor (one rank's
            experts of a fused 3-D tensor): only those bytes are read.

    Raises:
        SafetensorsError: a name is absent, its dtype unknown, or the file ends early.
    """
    path = Path(path)
    header = header or read_header(path)
    start = header["__data_start__"]["offset"]
    for name in names:
        if name not in header:
            raise SafetensorsError(f"{path}: tensor {name!r} is not in this file although the index says so; "
                                   "the index and the shard disagree: re-download the checkpoint")
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
            out[name] = _read_one(f, path, name, _rows_entry(header[name], (rows or {}).get(name)), start)
    return out


def _rows_entry(entry: dict, rows: tuple[int, int] | None) -> dict:
    """The header entry of rows ``[lo, hi)`` of dim 0 of ``entry`` (a contiguous byte range)."""
    if rows is None:
        return entry
    lo, hi = rows
    shape = entry["shape"]
    if not shape or not 0 <= lo <= hi <= shape[0]:
        raise SafetensorsError(f"rows [{lo}, {hi}) are outside a tensor of shape {shape}")
    begin, end = entry["data_offsets"]
    row = (end - begin) // shape[0] if shape[0] else 0
    return {**entry, "shape": [hi - lo, *shape[1:]], "data_offsets": [begin + lo * row, begin + hi * row]}


def _read_one(f, path: Path, name: str, entry: dict, start: int) -> torch.Tensor:
    if entry["dtype"] not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    buf = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(start + begin)
    view = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(view):  # raw reads may return short counts
        n = f.readinto(view[got:])
        if not n:
            raise SafetensorsError(f"{path}: truncated while reading {name!r}; re-download the shard")
        got += n
    dtype = DTYPES[entry["dtype"]]
    return buf.view(dtype).reshape(entry["shape"])
