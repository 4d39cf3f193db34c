"""The data pipeline: a ``--dataset`` option becomes fixed-length rows, then per-rank batches.

Flow: :func:`load_examples` loads raw rows (builtin, local file/folder or hub id), detects the
format, tokenises each document into ``(ids, labels)`` and packs or pads them to ``seq_len``; both
steps are ``datasets.map`` calls with explicit fingerprints, so they are cached on disk.
:func:`iterate_batches` (:mod:`hfpipe.batches`) shuffles rows by ``(seed, epoch)`` and shards each
global batch over ranks.

Row contract (labels are *unshifted*, as transformers' ``labels=`` expects):

- ``input_ids``, ``labels``, ``position_ids``, ``attention_mask``, each ``seq_len`` long.
- A row is a run of *segments* (documents, or pieces of one cut at a row end) then padding.
  ``position_ids`` restart at 0 at each segment and keep counting through trailing padding.
- ``labels`` are -100 on padding, on tokens without loss (prompts, user/system turns) and on the
  first token of each segment, which nothing in its segment can predict: packed and unpacked rows
  train on the same tokens and a shifted loss never crosses a document boundary.
- ``attention_mask`` is 1 on real tokens, 0 on trailing padding. Feed packed rows with
  ``position_ids``, ``attention_mask=None`` and ``use_cache=False``: transformers then builds a
  block-diagonal causal mask from the position resets (with a cache it silently does not).
  Padding is trailing, so under a causal mask no real token attends to it.
- Every row has a labelled token: documents and rows without one are dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hfpipe.batches import BatchSampler, batches_per_epoch, iterate_batches

if TYPE_CHECKING:
    import datasets

__all__ = ["BUILTIN_DATASETS", "COLUMNS", "IGNORE_INDEX", "BatchSampler", "DataConfig", "DataError",
           "batches_per_epoch", "check_seq_len", "iterate_batches", "load_examples"]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask")
FORMATS = ("auto", "text", "chat", "instruction")
_FORMAT_NAMES = ", ".join(FORMATS)
_ASSETS = Path(__file__).parent / "assets" / "data"
BUILTIN_DATASETS = {n: _ASSETS / f"{n.replace('-', '_')}.jsonl" for n in ("tiny-chat", "tiny-text")}
_BUILDERS = dict(jsonl="json", json="json", parquet="parquet", txt="text", arrow="arrow", csv="csv")
_ROLE_CONTENT = ("role", "content")
_VERSION = "1"  # bump when tokenisation or packing output changes: it keys the cache


class DataError(ValueError):
    """Bad data input; the message names the option (or file/field) and the fix."""


@dataclass
class DataConfig:
    """Where the training text comes from and how it becomes rows."""

    dataset: str = "builtin:tiny-chat"
    """Hub id, local file (.jsonl .json .parquet .txt .arrow .csv) or folder, or builtin:<name>."""
    dataset_config: str | None = None
    """Hub dataset configuration (the second argument of ``datasets.load_dataset``)."""
    split: str = "train"
    """Split to load; slices such as ``train[:1000]`` work for hub ids and files."""
    format: str = "auto"
    """auto | text | chat | instruction; auto: messages -> chat, prompt+response, text."""
    seq_len: int = 512
    """Tokens per row."""
    packing: bool = True
    """Fill rows with consecutive documents (True) or give each document its own padded row."""
    seed: int = 0
    """Seed of the document order before packing (the epoch order takes its own seed)."""
    text_field: str = "text"
    """Column holding the text of the text format."""

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
            raise DataError(f"--format {self.format!r} is unknown; choose one of {_FORMAT_NAMES}")
        if not (_is_int(self.seq_len) and self.seq_len >= 2):
            raise DataError(f"--seq-len {self.seq_len!r} must be an integer >= 2")
        if not isinstance(self.packing, bool):
            raise DataError(f"--packing {self.packing!r} must be true or false")
        if not (_is_int(self.seed) and self.seed >= 0):
            raise DataError(f"--seed {self.seed!r} must be an integer >= 0")
        if not (isinstance(self.text_field, str) and self.text_field):
            raise DataError("--text-field is empty; name the column that holds the text")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_seq_len(seq_len: int, config) -> None:
    """Raise :class:`DataError` if ``seq_len`` exceeds the model config's position limit."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise DataError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                        f"{limit}; lower --seq-len")


# ----------------------------------------------------------------------------- loading


def _load_raw(cfg: DataConfig) -> datasets.Dataset:
    """The raw rows named by ``--dataset``, ``--dataset-config`` and ``--split``."""
    import datasets

    name, split = cfg.dataset, cfg.split
    path = BUILTIN_DATASETS[name[8:]] if name.startswith("builtin:") else Path(name).expanduser()
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = _guard(name, datasets.load_from_disk, str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"--split {split} is not in {name}; it has {', '.join(loaded)}")
            loaded = loaded[split]
        return loaded
    if path.is_dir():
        return _guard(name, datasets.load_dataset, str(path), split=split)
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower().lstrip("."))
        if builder is None:
            raise DataError(f"--dataset {name}: unknown file type {path.suffix!r}; use .jsonl, "
                            ".json, .parquet, .txt, .arrow, .csv or a save_to_disk folder")
        return _guard(name, datasets.load_dataset, builder, data_files=str(path), split=split)
    if _looks_like_path(name):
        raise DataError(f"--dataset {name} does not exist; pass an existing file or folder, "
                        "a hub id such as org/name, or builtin:tiny-chat")
    return _guard(name, datasets.load_dataset, name, cfg.dataset_config, split=split)


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; any other missing name is a mistyped path."""
    return (
        name.startswith((".", "/", "~"))
        or Path(name).suffix.lower().lstrip(".") in _BUILDERS
        or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)
    )


def _guard(name: str, load, *args, **kwargs):
    """Call a ``datasets`` loader; its errors become one :class:`DataError` line."""
    try:
        return load(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; we add the option name
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"--dataset {name} could not be loaded ({type(e).__name__}: {first}); "
                        "check the path or hub id, --dataset-config and --split") from e


def _detect_format(cfg: DataConfig, columns: list[str]) -> str:
    """The format ``--format`` names, or the one the columns imply; error if fields are missing."""
    needs = {"chat": ["messages"], "instruction": ["prompt", "response"], "text": [cfg.text_field]}
    fits = [f for f, cols in needs.items() if all(c in columns for c in cols)]
    if cfg.format in fits or (cfg.format == "auto" and fits):
        return cfg.format if cfg.format in fits else fits[0]
    asked = needs if cfg.format == "auto" else {cfg.format: needs[cfg.format]}
    wants = ", ".join(f"{f} needs " + " and ".join(map(repr, c)) for f, c in asked.items())
    hint = "; or set --text-field" if "text" in asked else ""
    raise DataError(f"--dataset {cfg.dataset} has columns [{', '.join(columns)}]; {wants}{hint}")


# ----------------------------------------------------------------------------- documents


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _bos(tok) -> list[int]:
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def _eos(tok) -> list[int]:
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


def _text_doc(tok, text: str) -> tuple[list[int], list[int]]:
    """BOS (if any) + text + EOS, loss on every token."""
    ids = _bos(tok) + _encode(tok, text) + _eos(tok)
    return ids, list(ids)


def _instruction_doc(tok, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """BOS + prompt + response + EOS, loss on the response and EOS only."""
    head, tail = _bos(tok) + _encode(tok, prompt), _encode(tok, response) + _eos(tok)
    return head + tail, [IGNORE_INDEX] * len(head) + tail


def _chat_doc(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The chat-template rendering, loss on the characters of assistant turns.

    The text is tokenised once, as at inference (the template adds its own BOS, if any); a token
    carries loss when its first character lies in a span from :func:`_assistant_spans`.
    """
    text, spans = _assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts, labels = [s for s, _ in spans], []
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        k = bisect_right(starts, a) - 1
        labels.append(token if k >= 0 and a < spans[k][1] and b > a else IGNORE_INDEX)
    return enc["input_ids"], labels


def _assistant_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans that carry loss.

    Incremental prefixes first: assistant turn ``i`` is what rendering ``messages[:i+1]`` adds to
    ``messages[:i]`` rendered with the generation prompt, i.e. the reply and the template's
    end-of-turn text, without the role header. That needs prefix renderings to be prefixes of the
    whole. Templates that rewrite history (e.g. drop reasoning from earlier turns) are not; then
    each message's content is found in order in the full rendering, and an assistant span is its
    content plus a special token (the end-of-turn marker) directly after it.
    """

    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    try:
        spans = _prefix_spans(render, messages, full)
    except Exception:  # noqa: BLE001 - a template may reject a prefix (e.g. no user turn yet)
        spans = None
    return full, _search_spans(tok, messages, full) if spans is None else spans


def _prefix_spans(render, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    """Spans from incremental renderings, or None if a rendering is not a prefix of the next."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(messages[:i], True) if i else ""
            done = render(messages[: i + 1], False)
            if not (done.startswith(head) and full.startswith(done)):
                return None
            spans.append((len(head), len(done)))
    return spans


def _search_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Spans found by searching each message's content, in order, in the full rendering."""
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    specials.sort(key=len, reverse=True)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m["content"].strip()
        at = full.find(content, cursor)
        if at < 0:
            raise DataError(f"the chat template does not render message {i} ({m['role']}) "
                            "verbatim, so its loss mask cannot be placed; fix the template")
        cursor = at + len(content)
        if m["role"] == "assistant":
            cursor += next((len(s) for s in specials if full.startswith(s, cursor)), 0)
            spans.append((at, cursor))
    return spans


def _messages(value, where: str) -> list[dict]:
    """Messages as plain dicts, without the ``None`` fields Arrow adds for other rows' keys."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in _ROLE_CONTENT)):
            raise DataError(f"{where}: messages[{j}] needs string role and content, got {m!r:.80}")
    return [{k: v for k, v in m.items() if v is not None} for m in value]


def _tokenise_batch(batch, indices, *, tok, fmt: str, cfg: DataConfig):
    """``datasets.map`` body: raw columns -> ``ids``/``labels``; drops documents without loss."""
    out = {"ids": [], "labels": []}
    fields = {"chat": ["messages"], "text": [cfg.text_field], "instruction": ["prompt", "response"]}
    for k, row in enumerate(indices):
        values, where = [batch[f][k] for f in fields[fmt]], f"--dataset {cfg.dataset} row {row}"
        if fmt == "chat":
            ids, labels = _chat_doc(tok, _messages(values[0], where))
        elif not all(isinstance(v, str) for v in values):
            raise DataError(f"{where}: {' and '.join(fields[fmt])} must be strings, "
                            f"got {', '.join(type(v).__name__ for v in values)}")
        elif fmt == "text":
            ids, labels = _text_doc(tok, values[0]) if values[0].strip() else ([], [])
        else:
            ids, labels = _instruction_doc(tok, *values)
        if any(y != IGNORE_INDEX for y in labels[1:]):
            out["ids"].append(ids)
            out["labels"].append(labels)
    return out


# ----------------------------------------------------------------------------- rows


class _Rows:
    """Rows under construction: segments are appended, full rows padded and kept."""

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.out = {c: [] for c in COLUMNS}
        self.ids, self.labels, self.pos = [], [], []

    def add(self, ids: list[int], labels: list[int]) -> None:
        """Append a segment: positions from 0, first label masked."""
        self.ids += ids
        self.labels += [IGNORE_INDEX] + labels[1:]
        self.pos += range(len(ids))

    def close(self) -> None:
        """Pad the current row to ``seq_len`` and keep it if any token carries loss."""
        n, pad = len(self.ids), self.seq_len - len(self.ids)
        if any(y != IGNORE_INDEX for y in self.labels):
            nxt = self.pos[-1] + 1
            self.out["input_ids"].append(self.ids + [self.pad_id] * pad)
            self.out["labels"].append(self.labels + [IGNORE_INDEX] * pad)
            self.out["position_ids"].append(self.pos + list(range(nxt, nxt + pad)))
            self.out["attention_mask"].append([1] * n + [0] * pad)
        self.ids, self.labels, self.pos = [], [], []


def _pack_batch(batch, *, seq_len: int, pad_id: int):
    """``datasets.map`` body: fill rows with consecutive documents, cutting them at row ends.

    Each map batch ends with one padded row, so padding is at most one row per 1000 documents.
    """
    rows = _Rows(seq_len, pad_id)
    for ids, labels in zip(batch["ids"], batch["labels"], strict=True):
        at = 0
        while at < len(ids):
            take = seq_len - len(rows.ids)
            rows.add(ids[at : at + take], labels[at : at + take])
            at += take
            if len(rows.ids) == seq_len:
                rows.close()
    rows.close()
    return rows.out


def _pad_batch(batch, *, seq_len: int, pad_id: int):
    """``datasets.map`` body: one row per document, truncated to ``seq_len``, right-padded."""
    rows = _Rows(seq_len, pad_id)
    for ids, labels in zip(batch["ids"], batch["labels"], strict=True):
        rows.add(ids[:seq_len], labels[:seq_len])
        rows.close()
    return rows.out


def _fingerprint(*parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def _tokenizer_key(tok) -> str:
    """A stable identity of the tokenizer for cache fingerprints."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    ids = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.chat_template]
    return _fingerprint(body, json.dumps(ids, default=str))


def load_examples(cfg: DataConfig, tokenizer, *, num_proc: int | None = None) -> datasets.Dataset:
    """Rows of ``seq_len`` tokens for training, cached by ``datasets`` (see the module docstring).

    Args:
        cfg: The data options.
        tokenizer: A fast transformers tokenizer; chat data needs its ``chat_template``.
        num_proc: Processes for the tokenising ``map``.

    Returns:
        A dataset with the int columns :data:`COLUMNS`, each ``cfg.seq_len`` long.
    """
    from datasets import Features, List, Value

    raw = _load_raw(cfg)
    fmt = _detect_format(cfg, list(raw.column_names))
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"--dataset {cfg.dataset} is chat data but the tokenizer has no chat "
                        "template; use a tokenizer with a chat_template or --format text")
    if fmt == "chat" and not getattr(tokenizer, "is_fast", False):
        raise DataError(f"--dataset {cfg.dataset} is chat data, whose loss mask needs token "
                        "offsets; load the tokenizer with use_fast=True")
    key = _fingerprint(_VERSION, raw._fingerprint, fmt, cfg.text_field, _tokenizer_key(tokenizer))
    docs = raw.map(_tokenise_batch, batched=True, with_indices=True, num_proc=num_proc,
                   fn_kwargs=dict(tok=tokenizer, fmt=fmt, cfg=cfg), remove_columns=raw.column_names,
                   new_fingerprint=key, desc="tokenise")
    if len(docs) == 0:
        raise DataError(f"--dataset {cfg.dataset} has no document with a trainable token ({fmt})")
    if cfg.packing:
        docs = docs.shuffle(seed=cfg.seed)  # mixes neighbours within rows; rows reshuffle per epoch
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    int_type = {c: Value("int8" if c == "attention_mask" else "int32") for c in COLUMNS}
    features = Features({c: List(t, length=cfg.seq_len) for c, t in int_type.items()})
    key = _fingerprint(docs._fingerprint, cfg.packing, cfg.seq_len, pad_id)
    rows = docs.map(_pack_batch if cfg.packing else _pad_batch, batched=True, batch_size=1000,
                    fn_kwargs=dict(seq_len=cfg.seq_len, pad_id=pad_id), features=features,
                    remove_columns=docs.column_names, new_fingerprint=key, desc="pack")
    log.info("%s: %d documents -> %d rows of %d tokens (%s, packing=%s)", cfg.dataset,
             len(docs), len(rows), cfg.seq_len, fmt, cfg.packing)
    return rows
