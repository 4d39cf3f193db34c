"""The data options, their checks, and the names every data module shares.

This is the lowest module of :mod:`hfpipe.data`: the others import their constants and
:class:`DataError` from here, so the arrows run one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hfpipe.errors import HfpipeError

__all__ = ["BUILTIN_DATASETS", "COLUMNS", "FORMATS", "ROLES", "DataConfig",
           "DataError", "check_seq_len", "context_limit", "parse_mapping"]

COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask")
FORMATS = ("auto", "alpaca", "sharegpt", "chat", "instruction", "text")
#: Roles a chat template is given; ``--roles`` maps other names onto these.
ROLES = ("system", "user", "assistant", "tool")
_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "data"
BUILTIN_DATASETS = {n: _ASSETS / f"{n.replace('-', '_')}.jsonl" for n in ("tiny-chat", "tiny-text", "tiny-preference")}


class DataError(HfpipeError):
    """Bad data input; the message names the option (or file/line) and the fix."""


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes rows."""

    dataset: str = "builtin:tiny-chat"
    """Hub id, local file (.jsonl .json .parquet .txt .arrow .csv) or folder, or builtin:<name>."""
    dataset_config: str | None = None
    """Hub dataset configuration (the second argument of ``datasets.load_dataset``)."""
    split: str = "train"
    """Split to load; slices such as ``train[:1000]`` work for hub ids and files."""
    format: str = "auto"
    """One of :data:`FORMATS`; auto picks it from the columns (see :mod:`hfpipe.data.formats`)."""
    seq_len: int = 512
    """Tokens per row."""
    packing: bool = True
    """Fill rows with consecutive documents (True) or give each document its own padded row."""
    seed: int = 0
    """Seed of the document order before packing (the epoch order takes its own seed)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Column renames ``{column in the file: field of a format}``, applied before detection."""
    roles: dict[str, str] = field(default_factory=dict)
    """Role renames ``{role in the data: one of ROLES}``, on top of ShareGPT's human/gpt."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the tokenizer's own."""
    train_on_prompt: bool = False
    """Train on prompts and user turns too (default: only responses carry loss)."""
    allow_dropped_records: bool = False
    """Go on when more than half of the records carry no loss and are dropped (refused otherwise)."""

    def __post_init__(self):
        names = ", ".join(f"builtin:{n}" for n in BUILTIN_DATASETS)
        if not (isinstance(self.dataset, str) and self.dataset.strip()):
            raise DataError(f"--dataset is empty; pass a hub id, a local file or one of {names}")
        if self.dataset.startswith("builtin:") and self.dataset[8:] not in BUILTIN_DATASETS:
            raise DataError(f"--dataset {self.dataset} is not a builtin; choose one of {names}")
        if self.dataset_config is not None and not str(self.dataset_config).strip():
            raise DataError("--dataset-config is empty; leave it out or name the configuration")
        if not (isinstance(self.split, str) and self.split.strip()):
            raise DataError("--split is empty; pass a split name such as train")
        if self.format not in FORMATS:
            raise DataError(f"--format {self.format!r} is unknown; choose one of {', '.join(FORMATS)}")
        if not (_is_int(self.seq_len) and self.seq_len >= 2):
            raise DataError(f"--seq-len {self.seq_len!r} must be an integer >= 2")
        for name in ("packing", "train_on_prompt", "allow_dropped_records"):
            if not isinstance(getattr(self, name), bool):
                raise DataError(f"--{name.replace('_', '-')} {getattr(self, name)!r} must be true or false")
        if not (_is_int(self.seed) and self.seed >= 0):
            raise DataError(f"--seed {self.seed!r} must be an integer >= 0")
        self.columns = parse_mapping("--columns", self.columns)
        self.roles = parse_mapping("--roles", self.roles)
        bad = {k: v for k, v in self.roles.items() if v not in ROLES}
        if bad:
            k, v = next(iter(bad.items()))
            raise DataError(f"--roles {k}={v}: {v!r} is not a chat role; map roles onto "
                            f"{', '.join(ROLES)}")
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise DataError(f"--chat-template {self.chat_template} is not a file; pass a Jinja "
                            "template file (such as a tokenizer_config.json's chat_template)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_mapping(flag: str, value) -> dict[str, str]:
    """``"a=b,c=d"`` (a flag) or ``{a: b}`` (a recipe) as a dict of non-empty strings."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.count("=") == 1 for p in pairs):
            raise DataError(f"{flag} {value!r}: write NAME=NEW pairs separated by commas, "
                            "e.g. instruction=prompt,output=response")
        value = dict(tuple(s.strip() for s in p.split("=")) for p in pairs)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items()):
        raise DataError(f"{flag} must map names to names (NAME=NEW,...), got {value!r}")
    return dict(value)


def context_limit(config) -> int | None:
    """The longest sequence the model takes: ``max_position_embeddings``, or None (no limit) when
    its RoPE scaling is ``dynamic``, which transformers stretches to any length as it runs."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = [p for p in rope.values() if isinstance(p, dict)] if isinstance(rope, dict) else []
    kinds = kinds or ([rope] if isinstance(rope, dict) else [])  # one rope, or one per layer type
    if kinds and all((p.get("rope_type") or p.get("type")) == "dynamic" for p in kinds):
        return None
    return getattr(text, "max_position_embeddings", None)


def check_seq_len(seq_len: int, config, flag: str = "--seq-len") -> None:
    """Raise :class:`DataError` if ``seq_len`` exceeds the model's context (:func:`context_limit`)."""
    limit = context_limit(config)
    if limit is not None and seq_len > limit:
        raise DataError(f"{flag} {seq_len} exceeds the model's max_position_embeddings "
                        f"{limit}; lower {flag}")
