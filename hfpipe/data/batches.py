"""Per-rank batches of the rows :func:`hfpipe.data.load_examples` makes.

:func:`iterate_batches` shuffles rows by ``(seed, epoch)`` and shards each global batch over ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from hfpipe.data.config import COLUMNS, DataError

__all__ = ["BatchSampler", "batches_per_epoch", "epoch_sampler", "iterate_batches", "model_inputs"]


def batches_per_epoch(ds, batch_size: int, dp_size: int = 1) -> int:
    """Full global batches of ``batch_size * dp_size`` rows in one epoch (the rest is dropped)."""
    return len(ds) // (batch_size * dp_size)


class BatchSampler:
    """Row indices of one data-parallel rank's batches in one epoch.

    The epoch order is ``torch.randperm`` from a generator seeded by a hash of ``(seed, epoch)``.
    Global batch ``b`` is ``order[b*G:(b+1)*G]`` with ``G = batch_size * dp_size``; rank ``r``
    takes the contiguous slice ``[r*batch_size:(r+1)*batch_size]`` of it, so the ranks' batches
    in rank order make up the global batch. ``start`` skips batches already consumed (resume).
    """

    def __init__(self, num_rows: int, *, batch_size: int, seed: int, epoch: int,
                 dp_rank: int = 0, dp_size: int = 1, start: int = 0):
        if batch_size < 1 or not 0 <= dp_rank < dp_size or seed < 0 or epoch < 0:
            raise ValueError(f"need batch_size >= 1, 0 <= dp_rank < dp_size, seed >= 0, epoch >= 0;"
                             f" got {batch_size=} {dp_rank=} {dp_size=} {seed=} {epoch=}")
        self.num_batches = num_rows // (batch_size * dp_size)
        if not 0 <= start <= self.num_batches:
            raise ValueError(f"start={start} is outside the epoch's {self.num_batches} batches")
        self.num_rows, self.batch_size, self.seed, self.epoch = num_rows, batch_size, seed, epoch
        self.dp_rank, self.dp_size, self.start = dp_rank, dp_size, start

    def __len__(self) -> int:
        return self.num_batches - self.start

    def __iter__(self) -> Iterator[list[int]]:
        # mt19937 keeps only 32 bits of a seed: hash (seed, epoch) into 32 well-spread bits
        mixed = hashlib.sha256(f"hfpipe-epoch:{self.seed}:{self.epoch}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(mixed[:4], "little"))
        order = torch.randperm(self.num_rows, generator=gen)
        g, first = self.batch_size * self.dp_size, self.dp_rank * self.batch_size
        for b in range(self.start, self.num_batches):
            yield order[b * g + first : b * g + first + self.batch_size].tolist()


def epoch_sampler(num_rows: int, *, what: str = "rows", fix: str = "lower --batch-size or --seq-len, or add data",
                  **order) -> BatchSampler:
    """The :class:`BatchSampler` of one epoch (``order``: its keywords), refusing data of less than one global
    batch of ``what`` (rows, pairs) in one line that says the ``fix``."""
    sampler = BatchSampler(num_rows, **order)
    if sampler.num_batches == 0:
        size, dp = order["batch_size"], order.get("dp_size", 1)
        raise DataError(f"the dataset has {num_rows} {what}, fewer than one global batch of {size * dp} "
                        f"({size} per rank x {dp} ranks); {fix}")
    return sampler


def iterate_batches(ds, *, batch_size: int, seed: int, epoch: int, dp_rank: int = 0,
                    dp_size: int = 1, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of one epoch: int64 tensors ``[batch_size, seq_len]`` per column.

    See :class:`BatchSampler` for the order and the sharding rule.
    """
    sampler = epoch_sampler(len(ds), batch_size=batch_size, seed=seed, epoch=epoch, dp_rank=dp_rank,
                            dp_size=dp_size, start=start)
    view = ds.with_format("numpy", columns=list(COLUMNS))
    for indices in sampler:
        rows = view[indices]
        yield {c: torch.from_numpy(rows[c]).long() for c in COLUMNS}


def model_inputs(batch: dict, *, packed: bool) -> dict:
    """The tensors a data batch feeds the model.

    Packed rows go in with ``position_ids`` and *no* attention mask: transformers detects packed
    documents from restarting positions only when the mask is absent, and then no document
    attends to another. Their only padding is at the end of a row (labels -100), which causal
    attention never lets a real token see.
    """
    if packed:
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch
