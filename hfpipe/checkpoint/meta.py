"""What a checkpoint records (``hfpipe.json``) and the HF folder it came from.

Shared by the full export, the adapter export and the merge, which all start from the record, the
source folder's meta-device model and its side files; kept below all three so none imports another's
internals.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from hfpipe.errors import ExportError

__all__ = ["EXPORT_RECORD", "INDEX", "SINGLE", "copy_side_files", "side_files", "read_checkpoint_meta", "resolve_source"]

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: The file every export folder gets: what wrote it. ``--force`` replaces only a folder that has it.
EXPORT_RECORD = "hfpipe_export.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_META_FIELDS = {"format": int, "step": int, "source": str, "source_dtype": str, "tied": bool, "config": dict}


def read_checkpoint_meta(ckpt: str | Path) -> dict:
    """Parse and validate a checkpoint folder's ``hfpipe.json`` (and check DCP's ``.metadata``).

    Raises:
        ExportError: the folder, ``.metadata`` or ``hfpipe.json`` is missing, or a field is wrong.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint {ckpt} not found; pass a folder like OUT/checkpoints/step-00000010")
    for name in (".metadata", "hfpipe.json"):
        if not (ckpt / name).is_file():
            raise ExportError(f"checkpoint {ckpt} is incomplete: {name} missing; pick an earlier checkpoint")
    path = ckpt / "hfpipe.json"
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); pick an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{path} must hold a JSON object; pick an earlier checkpoint")
    for name, kind in _META_FIELDS.items():
        value = meta.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            got = "missing" if name not in meta else type(value).__name__
            raise ExportError(
                f"{path}: field {name!r} must be {kind.__name__}, got {got}; not an hfpipe checkpoint?"
            )
    if meta["format"] != 1:
        raise ExportError(f"{path}: format {meta['format']} is not supported (expected 1); upgrade hfpipe")
    return meta


def resolve_source(meta: dict, source: str | Path | None) -> Path:
    """The HF folder a run started from: `source` if given, else the one ``hfpipe.json`` records."""
    src = Path(source if source is not None else meta["source"]).expanduser().absolute()
    if not (src / "config.json").is_file():
        origin = "" if source is not None else " (recorded in hfpipe.json)"
        raise ExportError(
            f"source folder {src}{origin} has no config.json (moved or deleted?); "
            "pass source=<the HF model folder the run started from> (--source)"
        )
    return src


def copy_side_files(src: Path, tmp: Path) -> None:
    """Copy every non-weight file of the source (generation config, tokenizer, chat template, code)."""
    def skip(name: str) -> bool:
        return (name in ("config.json", EXPORT_RECORD) or name.endswith(_WEIGHT_SUFFIXES)
                or name.endswith(".index.json"))

    for path in side_files(src, skip):  # regular files inside the source only
        name = path.name
        shutil.copy2(path, tmp / name)
        log.debug("copied %s", name)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def side_files(src: Path, skip) -> list[Path]:
    """Files of ``src`` export may copy: regular files that live inside the source.

    A symlink is followed only to a regular file inside ``src`` or, for a hub-cache snapshot
    (``.../snapshots/<rev>``), inside that repository's ``blobs`` folder, where the hub keeps every
    file. Anything else (``secrets.txt -> /etc/shadow``, a folder, a device) is skipped with a warning.
    """
    root = src.resolve()
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    out = []
    for path in sorted(src.iterdir()):
        if path.name.startswith(".") or skip(path.name):
            continue
        target = path.resolve()
        if not target.is_file() or not any(_inside(target, a) for a in allowed):
            if path.is_symlink() or not path.is_dir():
                log.warning("not copying %s: it is not a regular file inside the source", path)
            continue
        out.append(path)
    return out
