"""Reading named tensors out of a safetensors file with plain ``read`` calls.

Why not ``safetensors.safe_open``: it memory-maps the whole file, so every page a stage touches
counts in its resident memory and file-backed pages linger until the file is closed. A pipeline
rank must read *only* its own tensors and hold nothing else; reading each tensor's byte range
straight into its final buffer does that with one copy and makes "bytes read" exact (the format is
an 8-byte header length, a JSON header, then raw little-endian tensor bytes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

__all__ = ["SafetensorsError", "read_header", "read_tensors", "DTYPES"]

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
    "BOOL": torch.bool,
}

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own bound


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed."""


def read_header(path: str | Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header (``__metadata__`` removed).

    Raises:
        SafetensorsError: the file is missing, too short or its header is not valid JSON.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file (no header); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise SafetensorsError(f"{path}: corrupt safetensors header length {n}; re-download it")
            raw = f.read(n)
        header = json.loads(raw)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: shard file is missing; re-download the checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SafetensorsError(f"{path}: corrupt safetensors header; re-download it") from None
    header.pop("__metadata__", None)
    header["__data_start__"] = {"offset": 8 + n}
    return header


def read_tensors(path: str | Path, names: list[str], header: dict | None = None) -> dict[str, torch.Tensor]:
    """Read ``names`` from ``path``, each straight into a fresh CPU tensor.

    Args:
        path: The safetensors file.
        names: Tensor names to read; reading follows file order for sequential I/O.
        header: ``read_header(path)`` if the caller already has it.

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
            out[name] = _read_one(f, path, name, header[name], start)
    return out


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
