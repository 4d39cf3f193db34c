"""Name the line that breaks a local data file: binary bytes, non-UTF-8 text, bad or doubled JSON.

``datasets`` (through pyarrow) reads JSON lines, text and CSV quickly but reports a broken file
without a line number, or not at all: invalid UTF-8 passes the load and fails later, deep in
tokenisation. These checks read the file in Python, so they run only once a load (or a
tokenisation) has failed, to say where: ``FILE line N: ...``.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from hfpipe.data.config import DataError
from hfpipe.files import open_regular

__all__ = ["DuplicateKey", "check_text", "check_json_lines", "parse", "sniff_binary"]

_CHUNK = 1 << 20


def check_text(path: Path) -> None:
    """Refuse a file with a NUL byte (binary, not text) or bytes that are not UTF-8, by line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            nul = chunk.find(b"\0")
            if nul >= 0:
                at = line + chunk.count(b"\n", 0, nul)
                raise DataError(f"{path} line {at}: binary data (a NUL byte), not a text file; "
                                "give JSON lines, JSON, CSV, text or parquet")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                at = line + chunk.count(b"\n", 0, max(0, e.start))
                raise DataError(f"{path} line {at}: not UTF-8 text (byte 0x{chunk[e.start]:02x}); "
                                "re-save the file as UTF-8") from None
            line += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{path} line {line}: not UTF-8 text (cut inside a character at the end); "
                            "re-save the file as UTF-8") from None


_SNIFF = 1 << 16


def sniff_binary(path: Path) -> None:
    """Refuse a file whose first 64 KiB hold a NUL byte (as git and grep tell binary from text)."""
    with open_regular(path) as f:
        head = f.read(_SNIFF)
    nul = head.find(b"\0")
    if nul >= 0:
        line = 1 + head.count(b"\n", 0, nul)
        raise DataError(f"{path} line {line}: binary data (a NUL byte), not a text file; give JSON "
                        "lines, JSON, CSV, text or parquet")


class DuplicateKey(ValueError):
    """A JSON object gives one key twice (``args[0]`` is the key)."""


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def parse(text: str):
    """``json.loads`` that refuses a key given twice in one object (JSON leaves it undefined)."""
    return json.loads(text, object_pairs_hook=_no_duplicates)


def check_json_lines(path: Path, text: str) -> None:
    """Name the first line that is not one JSON object, or that gives a key twice."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse(line)
        except DuplicateKey as e:
            raise DataError(f"{path} line {number}: key {e.args[0]!r} given twice in one record; "
                            "keep one") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number}: not valid JSON ({e.msg}, column {e.colno}); "
                            "fix or remove the line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {number}: expected a JSON object {{...}} per line, got "
                            f"{type(record).__name__}")
