"""The transformers config ``hfpipe plan`` prices: from a folder, a JSON file, a bundled model id
(``hfpipe/assets/configs``, so shipped recipes plan offline) or a hub id (config.json only)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

__all__ = ["load_model_config"]


def load_model_config(name: str, *, trust_remote_code: bool = False):
    """A transformers config from a folder, a JSON file, a bundled model id or a hub id.

    Only config.json is read (or, for hub ids not bundled with hfpipe, downloaded).

    Raises:
        SourceError: nothing usable under that name.
    """
    from hfpipe.source.config import SourceError, bundled_config_dir, bundled_ids, load_config

    path = Path(name).expanduser()
    if path.is_dir():
        return load_config(path, trust_remote_code=trust_remote_code)
    if path.is_file():
        return _config_from_file(path, trust_remote_code)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".json"):
        raise SourceError(f"{name}: no such folder or config file")
    bundled = bundled_config_dir(name)
    if bundled is not None:
        return load_config(bundled, trust_remote_code=trust_remote_code)
    if name.lower() in (i.lower() for i in bundled_ids()):  # a miscased bundled id: say which
        raise SourceError(f"{name}: not a bundled model as spelled; {_known_ids(name)}")
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(name, "config.json"))
    except Exception as e:  # network, auth, offline and unknown-repo errors mean the same here
        raise SourceError(f"{name}: not a folder, a config file, a bundled model or a fetchable "
                          f"hub id ({type(e).__name__}); {_known_ids(name)}; or pass a config.json path") from None
    return load_config(path.parent, trust_remote_code=trust_remote_code)


def _known_ids(name: str) -> str:
    """``did you mean X?`` (the closest bundled id, ignoring case) and every bundled id."""
    from hfpipe.source.config import bundled_ids

    ids = {i.lower(): i for i in bundled_ids()}
    close = difflib.get_close_matches(name.lower(), list(ids), n=1, cutoff=0.6)
    meant = f"did you mean {ids[close[0]]}? " if close else ""
    return f"{meant}bundled ids: {', '.join(ids.values())}"


def _config_from_file(path: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    from hfpipe.source.config import SourceError, load_config

    if path.name == "config.json":
        return load_config(path.parent, trust_remote_code=trust_remote_code)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: not valid JSON ({e})") from None
    if raw.get("auto_map") and not trust_remote_code:
        raise SourceError(f"{path}: model type {raw.get('model_type')!r} needs remote code; "
                          "pass --trust-remote-code if you trust it")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        raise SourceError(f"{path}: {str(e).splitlines()[0]}") from None
