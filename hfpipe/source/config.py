"""The two files of a model folder that transformers itself reads: config.json and the tokenizer.

Both are read with remote code refused unless asked for, and every failure becomes one
:class:`SourceError` line naming the file. A floor module: the checkpoint export reads a source's
config here without the rest of :mod:`hfpipe.source.folder`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SourceError", "load_config", "load_tokenizer"]


class SourceError(ValueError):
    """The model folder or hub id cannot be used (one line: what is wrong and what to do)."""


def load_config(folder: Path, *, trust_remote_code: bool = False):
    """The transformers config of ``folder``, refusing remote code unless asked for."""
    from transformers import AutoConfig

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{folder}: no config.json; point at a Hugging Face model folder")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) or (raw.get("auto_map") and not trust_remote_code):
            raise SourceError(
                f"{cfg_path}: model type {raw.get('model_type')!r} needs remote code; "
                "pass --trust-remote-code if you trust it"
            ) from None
        raise SourceError(f"{cfg_path}: {str(e).splitlines()[0]}") from None
    except KeyError as e:
        raise SourceError(f"{cfg_path}: unknown model_type {e}; is transformers up to date?") from None


def load_tokenizer(folder: str | Path, *, trust_remote_code: bool = False):
    """The tokenizer saved with ``folder`` (training and generation both read it here)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:  # no files, a broken file, or remote code refused
        if "trust_remote_code" in str(e):
            raise SourceError(f"{folder}: the tokenizer needs remote code; pass --trust-remote-code "
                              "if you trust it") from None
        why = (str(e).splitlines() or [""])[0][:200]
        raise SourceError(f"{folder}: no usable tokenizer ({type(e).__name__}: {why}); add the base model's "
                          "tokenizer files (tokenizer.json, tokenizer_config.json)") from None
