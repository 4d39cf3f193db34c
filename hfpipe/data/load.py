"""``--dataset`` (and the eval set) to rows: load, rename, detect, tokenise, pack.

Both steps are ``datasets.map`` calls with explicit fingerprints, so they are cached on disk and
a second run (or another rank) reads the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hfpipe.data.config import COLUMNS, DataConfig, DataError
from hfpipe.data.formats import FIELDS, OPTIONAL, detect_format
from hfpipe.data.packing import pack_batch, pad_batch
from hfpipe.data.preference import PAIR_COLUMNS, TokenisePairs, require_trl
from hfpipe.data.sources import explain_source, load_raw, locate
from hfpipe.data.tokenise import Tokenise

if TYPE_CHECKING:
    import datasets

__all__ = ["load_examples", "load_pairs", "load_splits"]

log = logging.getLogger(__name__)

_VERSION = "4"  # bump when tokenisation or packing output changes: it keys the cache
_KNOWN = sorted({f for needs in FIELDS.values() for n in needs for f in (n if isinstance(n, tuple) else (n,))}
                | {f for extra in OPTIONAL.values() for f in extra} | {"chosen", "rejected"})


@dataclass
class _Locator:
    """Index in the (possibly selected) dataset -> ``FILE line N``; picklable for ``map``."""

    name: str
    indices: list[int] | None = None

    def __call__(self, i: int) -> str:
        return locate(self.name, self.indices[i] if self.indices is not None else i)


def load_examples(cfg: DataConfig, tokenizer, *, num_proc: int | None = None) -> datasets.Dataset:
    """Rows of ``seq_len`` tokens, cached by ``datasets`` (see :mod:`hfpipe.data`).

    Args:
        cfg: The data options.
        tokenizer: A fast transformers tokenizer; chat data needs a chat template (its own or
            ``cfg.chat_template``).
        num_proc: Processes for the tokenising ``map``.

    Returns:
        A dataset with the int columns :data:`COLUMNS`, each ``cfg.seq_len`` long.
    """
    with _bars_on_terminals_only():
        raw = load_raw(cfg.dataset, cfg.dataset_config, cfg.split)
        return _rows(cfg, raw, tokenizer, _Locator(cfg.dataset), num_proc)


def load_splits(cfg: DataConfig, tokenizer, *, eval_cfg: DataConfig | None = None,
                eval_fraction: float | None = None, num_proc: int | None = None):
    """Training rows and evaluation rows (or None).

    The eval set is ``eval_cfg``'s source, or ``eval_fraction`` of ``cfg``'s records, chosen by
    ``cfg.seed`` and held out *before* packing, so no document is in both.
    """
    with _bars_on_terminals_only():
        return _splits(cfg, tokenizer, eval_cfg, eval_fraction, num_proc)


@contextlib.contextmanager
def _bars_on_terminals_only():
    """No ``datasets`` progress bars when stderr is a file: their ``\\r`` updates garble logs."""
    import datasets

    quiet = not sys.stderr.isatty() and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet:
            datasets.enable_progress_bars()


def _splits(cfg, tokenizer, eval_cfg, eval_fraction, num_proc):
    raw = load_raw(cfg.dataset, cfg.dataset_config, cfg.split)
    if not eval_fraction:
        train = _rows(cfg, raw, tokenizer, _Locator(cfg.dataset), num_proc)
        if eval_cfg is None:
            return train, None
        held = load_raw(eval_cfg.dataset, eval_cfg.dataset_config, eval_cfg.split)
        return train, _rows(eval_cfg, held, tokenizer, _Locator(eval_cfg.dataset), num_proc)
    import numpy as np

    n_eval = round(len(raw) * eval_fraction)
    if not 1 <= n_eval < len(raw):
        raise DataError(f"--eval-fraction {eval_fraction} of {len(raw)} records leaves "
                        f"{n_eval} for evaluation and {len(raw) - n_eval} for training; change it")
    order = np.random.default_rng(cfg.seed).permutation(len(raw))
    parts = sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist())
    train, held = (_rows(cfg, raw.select(p), tokenizer, _Locator(cfg.dataset, p), num_proc)
                   for p in parts)
    return train, held


def _rows(cfg: DataConfig, raw, tokenizer, where: _Locator, num_proc: int | None):
    from datasets import Features, List, Value

    raw = _rename(cfg, raw)
    fmt = detect_format(cfg.format, list(raw.column_names), f"--dataset {cfg.dataset}")
    template = _template_text(cfg)
    body = Tokenise(tokenizer, fmt, cfg.roles, template, cfg.train_on_prompt, where, cfg.chat_template)
    _check_tokenizer(cfg, fmt, body)
    key = _fingerprint(_VERSION, raw._fingerprint, fmt, json.dumps(cfg.roles, sort_keys=True),
                       template, cfg.train_on_prompt, _tokenizer_key(tokenizer))
    try:
        docs = raw.map(body, batched=True, with_indices=True, num_proc=num_proc,
                       remove_columns=raw.column_names, new_fingerprint=key, desc="tokenise")
    except UnicodeDecodeError:  # pyarrow loads bytes that are not UTF-8; reading them fails here
        explain_source(cfg.dataset)
        raise DataError(f"--dataset {cfg.dataset}: holds text that is not UTF-8; re-save it as UTF-8") from None
    docs = _drop_unusable(cfg, docs, fmt)
    if cfg.packing:
        docs = docs.shuffle(seed=cfg.seed)  # mixes neighbours within rows; rows reshuffle per epoch
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    int_type = {c: Value("int8" if c == "attention_mask" else "int32") for c in COLUMNS}
    features = Features({c: List(t, length=cfg.seq_len) for c, t in int_type.items()})
    key = _fingerprint(docs._fingerprint, cfg.packing, cfg.seq_len, pad_id)
    rows = docs.map(pack_batch if cfg.packing else pad_batch, batched=True, batch_size=1000,
                    fn_kwargs=dict(seq_len=cfg.seq_len, pad_id=pad_id), features=features,
                    remove_columns=docs.column_names, new_fingerprint=key, desc="pack")
    log.info("%s: %d documents -> %d rows of %d tokens (%s, packing=%s)", cfg.dataset,
             len(docs), len(rows), cfg.seq_len, fmt, cfg.packing)
    return rows


def load_pairs(cfg: DataConfig, tokenizer, *, num_proc: int | None = None) -> datasets.Dataset:
    """Preference pairs of ``--dataset`` as token ids (:mod:`hfpipe.data.preference`), cached by ``datasets``.

    Pairs whose prompt fills ``seq_len`` are dropped as TRL drops them, and said (most of them dropped is
    refused, as for SFT). ``cfg.format`` and ``cfg.packing`` do not apply: the format is TRL's, and pairs are
    padded per batch by TRL's collator.
    """
    require_trl()
    with _bars_on_terminals_only():
        raw = _rename(cfg, load_raw(cfg.dataset, cfg.dataset_config, cfg.split))
        missing = [c for c in ("chosen", "rejected") if c not in raw.column_names]
        if missing:
            raise DataError(f"--dataset {cfg.dataset} has columns [{', '.join(raw.column_names)}]; preference "
                            f"data needs 'chosen' and 'rejected' (and 'prompt', unless the prompt is the shared "
                            "beginning of both); rename columns with --columns COLUMN=FIELD")
        template = _template_text(cfg)
        body = TokenisePairs(tokenizer, cfg.roles, template, cfg.seq_len, _Locator(cfg.dataset), cfg.chat_template)
        key = _fingerprint(_VERSION, "pairs", raw._fingerprint, json.dumps(cfg.roles, sort_keys=True), template,
                           cfg.seq_len, _tokenizer_key(tokenizer))
        try:
            pairs = raw.map(body, batched=True, with_indices=True, num_proc=num_proc,
                            remove_columns=raw.column_names, new_fingerprint=key, desc="tokenise pairs")
        except UnicodeDecodeError:
            explain_source(cfg.dataset)
            raise DataError(f"--dataset {cfg.dataset}: holds text that is not UTF-8; re-save it as UTF-8") from None
        pairs = _drop_unusable(cfg, pairs, "preference pairs")
    log.info("%s: %d preference pairs (%d sequences of at most %d tokens)", cfg.dataset, len(pairs),
             2 * len(pairs), cfg.seq_len)
    return pairs.select_columns(list(PAIR_COLUMNS))


def _template_text(cfg: DataConfig) -> str | None:
    try:
        return Path(cfg.chat_template).expanduser().read_text() if cfg.chat_template else None
    except UnicodeDecodeError:
        raise DataError(f"--chat-template {cfg.chat_template}: not UTF-8 text (a binary file?); give a jinja "
                        "template file") from None


def _drop_unusable(cfg: DataConfig, docs, fmt: str):
    """The documents that carry loss; how many records were dropped and why, said in one line.

    Most of the data dropped is refused (unless ``cfg.allow_dropped_records``): it is far more
    often a wrong ``--format``, ``--columns`` or ``--roles`` than what the user meant to train on.
    """
    dropped = docs["dropped"]
    reasons = Counter(dropped)
    kept, total = reasons.pop("", 0), len(docs)
    why = ", ".join(f"{n} with {reason}" for reason, n in reasons.most_common())
    said = f"--dataset {cfg.dataset}: {total - kept} of {total} records dropped ({why})"
    if kept == 0:
        raise DataError(f"{said}: no document with a trainable token ({fmt}); check --format, "
                        "--columns and --roles")
    if 2 * (total - kept) > total and not cfg.allow_dropped_records:
        raise DataError(f"{said}, more than half; check --format, --columns and --roles, or pass "
                        "--allow-dropped-records if that is expected")
    if kept < total:
        log.warning("%s", said)
        docs = docs.select([i for i, r in enumerate(dropped) if not r])
    return docs.remove_columns("dropped")


def _rename(cfg: DataConfig, raw):
    """Apply ``--columns COLUMN=FIELD``: each column must exist, each field be one a format reads."""
    for column, field in cfg.columns.items():
        if column not in raw.column_names:
            raise DataError(f"--columns {column}={field}: --dataset {cfg.dataset} has no column "
                            f"{column!r}; it has [{', '.join(raw.column_names)}]")
        if field not in _KNOWN:
            raise DataError(f"--columns {column}={field}: {field!r} is not a field any format "
                            f"reads; choose one of {', '.join(_KNOWN)}")
    clash = [f for c, f in cfg.columns.items() if f in raw.column_names and f not in cfg.columns]
    raw = raw.remove_columns(clash)  # the renamed column wins over one already called that
    return raw.rename_columns(cfg.columns) if cfg.columns else raw


def _check_tokenizer(cfg: DataConfig, fmt: str, body: Tokenise) -> None:
    if fmt in ("chat", "sharegpt") and not body.has_template:
        raise DataError(f"--dataset {cfg.dataset} is {fmt} data but the tokenizer has no chat "
                        "template; pass --chat-template FILE, or use a tokenizer that has one")
    if body.has_template and fmt in ("chat", "sharegpt", "alpaca") and not getattr(body.tok, "is_fast", False):
        raise DataError(f"--dataset {cfg.dataset} is {fmt} data, whose loss mask needs token "
                        "offsets; load the tokenizer with use_fast=True")


def _fingerprint(*parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def _tokenizer_key(tok) -> str:
    """A stable identity of the tokenizer for cache fingerprints."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    ids = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.chat_template]
    return _fingerprint(body, json.dumps(ids, default=str))
