"""Raw records from a ``--dataset``: builtin, local file or folder, or hub id.

Errors say where: a broken JSON line is reported by its line number, and :func:`locate` turns a
record's index back into ``FILE line N`` for the messages of later steps.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hfpipe.data.config import BUILTIN_DATASETS, DataError
from hfpipe.data.text_check import DuplicateKey, check_json_lines, check_text, parse, sniff_binary
from hfpipe.files import check_folder, check_regular

if TYPE_CHECKING:
    import datasets

__all__ = ["check_exists", "load_raw", "locate", "explain", "explain_source"]

_BUILDERS = dict(jsonl="json", json="json", parquet="parquet", txt="text", arrow="arrow", csv="csv")


def _path(name: str) -> Path:
    return BUILTIN_DATASETS[name[8:]] if name.startswith("builtin:") else Path(name).expanduser()


def load_raw(name: str, dataset_config: str | None, split: str) -> datasets.Dataset:
    """The raw records of one source (``--dataset``, ``--dataset-config``, ``--split``)."""
    import datasets

    path = _path(name)
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = _guard(name, datasets.load_from_disk, str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"--split {split} is not in {name}; it has {', '.join(loaded)}")
            loaded = loaded[split]
        return loaded
    if path.is_dir():
        check_folder(path, "--dataset ")
        return _guard(name, datasets.load_dataset, str(path), split=split)
    if path.exists():
        check_regular(path, "--dataset ")  # a FIFO would block the load forever
        builder = _BUILDERS.get(path.suffix.lower().lstrip("."))
        if builder is None:
            raise DataError(f"--dataset {name}: unknown file type {path.suffix!r}; use .jsonl, "
                            ".json, .parquet, .txt, .arrow, .csv or a save_to_disk folder")
        if builder in ("json", "text", "csv"):
            sniff_binary(path)  # datasets reads a NUL-laden file as text, silently
        if path.suffix.lower() == ".json":  # one document: datasets reads it with Python's json,
            _check_json(path)                # which keeps the last of a doubled key, silently
        try:
            return _guard(name, datasets.load_dataset, builder, data_files=str(path), split=split)
        except DataError:
            explain(path)  # the load's errors name no line: find it (only now, it reads all)
            raise
    check_exists(name)
    return _guard(name, datasets.load_dataset, name, dataset_config, split=split)


def check_exists(name: str, flag: str = "--dataset") -> None:
    """A name that is a path, not a hub id, must exist (torch-free: the CLI calls it before loading)."""
    if not name.startswith("builtin:") and not _path(name).exists() and _looks_like_path(name):
        raise DataError(f"{flag} {name} does not exist; pass an existing file or folder, "
                        "a hub id such as org/name, or builtin:tiny-chat")


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; any other missing name is a mistyped path."""
    return (
        name.startswith((".", "/", "~"))
        or Path(name).suffix.lower().lstrip(".") in _BUILDERS
        or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)
    )


def explain(path: Path) -> None:
    """Raise the line that breaks a local text file of ``path``'s type, if one does."""
    builder = _BUILDERS.get(path.suffix.lower().lstrip("."))
    if builder in ("json", "text", "csv"):
        check_text(path)
    if builder == "json":
        _check_json(path)
        _check_types(path)


def explain_source(name: str) -> None:
    """:func:`explain` for a ``--dataset`` that is a local file (else nothing)."""
    path = _path(name)
    if path.is_file():
        explain(path)


def _guard(name: str, load, *args, **kwargs):
    """Call a ``datasets`` loader; its errors become one :class:`DataError` line (its own log
    lines about them, tracebacks included, are kept off the console unless HFPIPE_DEBUG=1)."""
    quiet = logging.getLogger("datasets")
    level = quiet.level
    if os.environ.get("HFPIPE_DEBUG") != "1":
        quiet.setLevel(logging.CRITICAL + 1)
    try:
        return load(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; we add the option name
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"--dataset {name} could not be loaded ({type(e).__name__}: {first}); "
                        "check the path or hub id, --dataset-config and --split") from e
    finally:
        quiet.setLevel(level)


def _check_json(path: Path) -> None:
    """Name the first line that is not a JSON object (pyarrow's error has no line number).

    A ``.json`` file may be one JSON document (an array of records) or JSON lines, as
    ``datasets`` accepts both; a file that parses as a whole is left to ``datasets``.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".json":
        try:
            parse(text)
            return
        except DuplicateKey as e:
            raise DataError(f"{path}: key {e.args[0]!r} given twice in one record; keep one") from None
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg}, column "
                                f"{e.colno}); fix the file") from None
    check_json_lines(path, text)


def _check_types(path: Path) -> None:
    """Name the first record whose field has another JSON type than in an earlier record.

    Arrow needs one type per column; its error names neither the line nor the field.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    records = json.loads(text) if text.lstrip().startswith("[") else None
    lines = enumerate(text.splitlines(), 1) if records is None else enumerate(records, 1)
    first: dict[str, tuple[str, int]] = {}
    for number, item in lines:
        record = item if records is not None else json.loads(item) if item.strip() else None
        for key, value in (record or {}).items():
            kind = _json_type(value)
            seen = first.setdefault(key, (kind, number))
            if kind is not None and seen[0] is None:
                first[key] = seen = (kind, number)
            if kind is not None and kind != seen[0]:
                unit = "record" if records is not None else "line"
                raise DataError(f"{path} {unit} {number}: {key!r} is {kind} but {seen[0]} on {unit} "
                                f"{seen[1]}; give each field one type in every record")


def _json_type(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def locate(name: str, index: int) -> str:
    """``FILE line N`` for record ``index`` of a JSON lines source, else ``--dataset NAME row N``."""
    path = _path(name)
    if path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096).lstrip()[:1]
            f.seek(0)
            if head != "[":  # JSON lines: blank lines hold no record
                seen = -1
                for number, line in enumerate(f, 1):
                    seen += bool(line.strip())
                    if seen == index:
                        return f"{path} line {number}"
        return f"{path} record {index}"
    return f"--dataset {name} row {index}"
