"""Where a model's files come from: a local folder or the Hugging Face hub cache.

A :class:`ModelSource` knows the config and the checkpoint's key -> shard map without reading any
weights; shards are fetched (for hub ids) only when a stage asks for them, so each rank downloads
and opens only the shards holding its own tensors.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from hfpipe.files import INDEX, SINGLE
from hfpipe.source.config import SourceError, load_config, load_tokenizer
from hfpipe.source.safetensors_io import SafetensorsError, read_header
from hfpipe.source.tensor_checks import (SCALE, ExpertShapes, check_expert_keys, check_fp8_scales, decoder_layers,
                                         fp8_block)

__all__ = ["ModelSource", "SourceError", "check_dtypes", "check_shard_names", "load_config", "load_tokenizer"]

log = logging.getLogger(__name__)

META_FILES = ("config.json", "generation_config.json", INDEX)


def _is_local(name: str) -> bool:
    return os.path.isdir(name) or name.startswith((".", "/", "~")) or os.path.exists(name)


@dataclass
class ModelSource:
    """A model's config and weight map, with shards resolved lazily.

    Attributes:
        name: What the user gave (folder or hub id).
        folder: Local folder holding config.json (for hub ids, the snapshot in the cache).
        repo_id: The hub id, or ``None`` for a local folder.
        config: The transformers config.
        weight_map: Checkpoint key -> shard file name.
    """

    name: str
    folder: Path
    repo_id: str | None
    config: object
    weight_map: dict[str, str]
    _headers: dict[str, dict] = field(default_factory=dict, repr=False)
    _experts: ExpertShapes = field(default_factory=ExpertShapes, repr=False)

    @classmethod
    def open(cls, name: str | os.PathLike, *, trust_remote_code: bool = False) -> "ModelSource":
        """Resolve ``name`` (local folder or hub id) and read its config and index only."""
        name = str(name)
        repo_id = None
        if _is_local(name):
            folder = Path(name).expanduser().resolve()
            if not folder.is_dir():
                raise SourceError(f"{name}: no such model folder")
        else:
            repo_id = name
            folder = _hub_metadata(repo_id)
        config = load_config(folder, trust_remote_code=trust_remote_code)
        src = cls(name, folder, repo_id, config, {})
        src.weight_map = src._read_weight_map()
        index = folder / (INDEX if (folder / INDEX).is_file() else SINGLE)
        _refuse(check_expert_keys(index, src.weight_map, config))  # names only: before any header is read
        return src

    def _read_weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SourceError(f"{index}: malformed index (no 'weight_map'); re-download it") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise SourceError(f"{index}: empty or malformed 'weight_map'; re-download it")
            check_shard_names(index, weight_map)
            return dict(weight_map)
        single = self.path(SINGLE) if self.repo_id or (self.folder / SINGLE).is_file() else None
        if single is None or not single.is_file():
            if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
                raise SourceError(
                    f"{self.folder}: only pickle weights (*.bin/*.pt) found; hfpipe reads safetensors "
                    "only: convert them with transformers' save_pretrained(safe_serialization=True)"
                )
            raise SourceError(f"{self.folder}: no {INDEX} and no {SINGLE}")
        return {key: SINGLE for key in self.header(SINGLE) if key != "__data_start__"}

    def path(self, filename: str) -> Path:
        """Local path of a shard, downloading only that file for hub ids."""
        if self.repo_id is None:
            return self.folder / filename
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.repo_id, filename))
        except Exception as e:  # network, auth and offline errors all mean the same to the user
            raise SourceError(f"{self.repo_id}: cannot fetch {filename} ({type(e).__name__}); "
                              "check the hub id, your token, or HF_HUB_OFFLINE") from None

    def header(self, filename: str) -> dict:
        """The parsed safetensors header of a shard (cached), its dtypes checked against the config."""
        if filename not in self._headers:
            try:
                header = read_header(self.path(filename))
            except SafetensorsError as e:
                raise SourceError(str(e)) from None
            check_dtypes(self.folder / filename, header, self.config, self.weight_map or header)
            self._check_scales(filename, header)
            _refuse(self._experts.add(self.folder / filename, header, decoder_layers(self.config)))
            self._headers[filename] = header
        return self._headers[filename]

    def _check_scales(self, filename: str, header: dict) -> None:
        """Each FP8 scale grid against its weight, once both headers are read (they may be two shards)."""
        block = fp8_block(self.config)
        if block is None:
            return
        for key, entry in header.items():
            if key.endswith(SCALE):  # from the scale: its weight here or in a shard read before
                weight = key[: -len(SCALE)]
                w, s = header.get(weight) or self._cached(weight), entry
            elif key + SCALE in self.weight_map and key + SCALE not in header:  # its scale read before
                weight, w, s = key, entry, self._cached(key + SCALE)
            else:
                continue
            if isinstance(w, dict) and isinstance(s, dict):
                _refuse(check_fp8_scales(self.folder / filename, weight, w.get("shape"), s.get("shape"), block))

    def _cached(self, key: str) -> dict | None:
        return self._headers.get(self.weight_map.get(key, ""), {}).get(key)

    @property
    def tied(self) -> bool:
        """Whether the head shares the embedding (no ``lm_head.weight`` expected on disk)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))


def _refuse(problem: str | None) -> None:
    if problem:
        raise SourceError(problem)


_FP8 = ("F8_E4M3", "F8_E5M2")
_INTEGER = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL")


def check_dtypes(path: Path, header: dict, config, names) -> None:
    """Refuse tensors whose stored dtype the model cannot take as it is (a cast would be silent).

    - an integer weight or bias in a model without ``quantization_config``: a float parameter
      read from integers is garbage, whatever the cast;
    - FP8 weights without ``quantization_config``, or without their ``_scale_inv`` beside them:
      the scale is what turns them back into the trained values.

    Args:
        path: The shard (for the message).
        header: Its tensor entries.
        config: The model's transformers config.
        names: Every tensor name of the checkpoint (the index's keys), to find the scales.
    """
    quantized = getattr(config, "quantization_config", None) is not None
    for key, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype in _INTEGER and not quantized and key.endswith((".weight", ".bias")):
            raise SourceError(f"{path}: tensor {key!r} is stored as {dtype}, but it is a float parameter "
                              "and config.json has no quantization_config; the weights are not this model's")
        if dtype in _FP8 and key.endswith(".weight"):
            if not quantized:
                raise SourceError(f"{path}: tensor {key!r} is FP8 ({dtype}) but config.json has no "
                                  "quantization_config; restore the model's config.json")
            if key + "_scale_inv" not in names:
                raise SourceError(f"{path}: FP8 tensor {key!r} has no {key + '_scale_inv'!r} beside it; "
                                  "without its scale it cannot be dequantised; re-download the checkpoint")


def check_shard_names(index: Path, weight_map: dict) -> None:
    """Refuse shard names that are not plain file names inside the model folder.

    An index naming ``../../etc/passwd`` or ``/data/x.safetensors`` would make hfpipe read (and
    train on) a file outside the folder. A shard that is itself a symlink (the hub cache links each
    file to its blob) is fine: only the *name* is checked, never where the link points.
    """
    for key, name in weight_map.items():
        if not isinstance(name, str) or not _plain_name(name):
            raise SourceError(f"{index}: tensor {key!r} names shard {name!r}, which is not a plain file name "
                              "inside the model folder; fix the index or re-download the checkpoint")


def _plain_name(name: str) -> bool:
    return (bool(name) and "/" not in name and "\\" not in name and "\0" not in name
            and name not in (".", "..") and not os.path.isabs(name) and name.endswith(".safetensors"))


def _hub_metadata(repo_id: str) -> Path:
    """Fetch config, index and tokenizer files of a hub model (never weights)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"],
            )
        )
    except Exception as e:
        offline = " (HF_HUB_OFFLINE is set and it is not in the cache)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise SourceError(
            f"{repo_id}: not a local folder and not fetchable from the hub{offline} ({type(e).__name__})"
        ) from None
