"""What a checkpoint records (``hfpipe.json``) and the HF folder it came from.

Shared by the full export, the adapter export and the merge, which all start from the record, the
source folder's meta-device model and its side files; kept below all three so none imports another's
internals.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hfpipe.errors import ExportError
from hfpipe.files import SideFileError, read_side_json

__all__ = ["EXPORT_RECORD", "check_record_objects", "copy_side_files", "side_files", "read_checkpoint_meta", "read_record",
           "resolve_source"]

log = logging.getLogger(__name__)

#: The file every export folder gets: what wrote it. ``--force`` replaces only a folder that has it.
EXPORT_RECORD = "hfpipe_export.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
#: What a Hugging Face model folder holds besides weights, index and config.json (transformers'
#: tokenizer, generation and processor files): the only source files an export copies.
_MODEL_FILES = frozenset({
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json"})
_DOC_PREFIXES = ("README", "LICENSE", "LICENCE", "NOTICE", "USE_POLICY")
_META_FIELDS = {"format": int, "step": int, "source": str, "source_dtype": str, "tied": bool, "config": dict}
#: Fields of ``hfpipe.json`` that hold a JSON object when present (null only where :data:`_MAY_BE_NULL` says):
#: a string there would pass every ``.get`` as far as the first one and end a resume in an AttributeError.
_OBJECT_FIELDS = ("config", "world", "train", "lora", "base", "quantize_base", "checksums", "eval", "data")
_TRAIN_OBJECTS = ("position", "scheduler")
#: Object fields whose null has a meaning of its own: no adapters, no quantized base, and checksums whose
#: entry was set to null (damage :mod:`hfpipe.checkpoint.checksums` names in its own words).
_MAY_BE_NULL = ("lora", "quantize_base", "checksums")


def read_checkpoint_meta(ckpt: str | Path) -> dict:
    """Parse and validate a checkpoint folder's ``hfpipe.json`` (and check DCP's ``.metadata``).

    Raises:
        ExportError: the folder, ``.metadata`` or ``hfpipe.json`` is missing, or a field is wrong.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint {ckpt} not found; pass a folder like OUT/checkpoints/step-00000010")
    for name in (".metadata", "hfpipe.json"):
        if not (ckpt / name).is_file() and not (ckpt / name).is_symlink():  # a link is named by the reader below
            raise ExportError(f"checkpoint {ckpt} is incomplete: {name} missing; pick an earlier checkpoint")
    path = ckpt / "hfpipe.json"
    meta = read_record(path, ExportError, "pick an earlier checkpoint")
    check_record_objects(meta, path, ExportError, "pick an earlier checkpoint")
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


def check_record_objects(meta: dict, path: Path, error: type[Exception], fix: str) -> None:
    """Refuse a run record whose object fields (:data:`_OBJECT_FIELDS`, and ``train``'s own) hold another
    JSON type, in one line naming the file and the field."""
    fields = [(k, meta.get(k)) for k in _OBJECT_FIELDS if k in meta]
    train = meta.get("train")
    fields += [(f"train.{k}", train.get(k)) for k in _TRAIN_OBJECTS if isinstance(train, dict) and k in train]
    for name, value in fields:
        if value is not None and not isinstance(value, dict) or value is None and name not in _MAY_BE_NULL:
            raise error(f"{path}: field {name!r} must be a JSON object, got {_json_type(value)}; {fix}")


def _json_type(value) -> str:
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            type(None): "null"}.get(type(value), type(value).__name__)


def read_record(path: Path, error: type[Exception], fix: str) -> dict:
    """A JSON object hfpipe wrote beside data (``hfpipe.json``, ``hfpipe_export.json``), read once.

    Through :func:`hfpipe.files.read_side_json`: a link, a FIFO, a huge or a broken file is refused
    as ``error`` in one line naming ``path`` and ending with ``fix``.
    """
    try:
        record = read_side_json(path)
    except SideFileError as e:
        raise error(f"{e}; {fix}") from None
    if not isinstance(record, dict):
        raise error(f"{path}: must hold a JSON object; {fix}")
    return record


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


def copy_side_files(src: Path, tmp: Path) -> list[str]:
    """Copy the files a model folder is made of besides weights and config (tokenizer, generation
    config, chat template, README and license); return their names.

    Only those: a source folder may hold anything beside the weights (a token, credentials, notes)
    and an export is made to be shared. What is left out is named in the log. A copy is never more
    readable than its original: a 0600 file stays 0600.
    """
    left_out, copied = [], []
    for path in side_files(src, lambda name: name in ("config.json", EXPORT_RECORD) or name.endswith(_WEIGHT_SUFFIXES)
                           or name.endswith(".index.json")):  # regular files inside the source only
        if not _is_model_file(path.name):
            left_out.append(path.name)
            continue
        shutil.copyfile(path, tmp / path.name)  # content only: the new file gets this process's umask mode
        (tmp / path.name).chmod((tmp / path.name).stat().st_mode & path.stat().st_mode & 0o777)
        copied.append(path.name)
    if left_out:
        log.warning("export left out %d file(s) of %s that are not part of a model folder: %s", len(left_out), src,
                    ", ".join(left_out))
    return copied


def _is_model_file(name: str) -> bool:
    return name in _MODEL_FILES or name.upper().startswith(_DOC_PREFIXES) or name.endswith(".tiktoken")


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
