"""Rows of ``seq_len`` tokens from tokenised documents: packed, or one padded row each.

See :mod:`hfpipe.data` for the row contract (positions restart per segment, the first label of a
segment is masked, padding is trailing).
"""

from __future__ import annotations

from hfpipe.data.config import COLUMNS
from hfpipe.loss.tokens import IGNORE_INDEX

__all__ = ["pack_batch", "pad_batch"]


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


def pack_batch(batch, *, seq_len: int, pad_id: int):
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


def pad_batch(batch, *, seq_len: int, pad_id: int):
    """``datasets.map`` body: one row per document, truncated to ``seq_len``, right-padded."""
    rows = _Rows(seq_len, pad_id)
    for ids, labels in zip(batch["ids"], batch["labels"], strict=True):
        rows.add(ids[:seq_len], labels[:seq_len])
        rows.close()
    return rows.out
