"""What a batch handed to the pipeline must hold, checked before a schedule runs on it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hfpipe.errors import HfpipeError
from hfpipe.loss.tokens import IGNORE_INDEX

__all__ = ["BatchError", "check_batches", "with_router_mask"]


class BatchError(HfpipeError):
    """A batch the pipeline cannot run: the message names the call, the batch and the key."""


def check_batches(batches: list, vocab_size: int | None, call: str, *, labels: bool = True) -> None:
    """Refuse batches the schedule would crash on (or, on a GPU, read past the embedding with).

    Each must hold ``input_ids`` (and ``labels``) as integer ``[batch, seq]`` tensors of the same
    shape with at least one token; ids within the vocabulary, labels too or ``IGNORE_INDEX`` (-100).
    """
    if not batches:
        raise BatchError(f"{call}: no batch given; pass a dict with input_ids and labels, or a list of them")
    values = []  # (tensor, key, where): every id tensor, its values checked at once below
    for i, batch in enumerate(batches):
        where = f"{call}: batch {i}" if len(batches) > 1 else f"{call}: the batch"
        if not isinstance(batch, Mapping):
            raise BatchError(f"{where} is a {type(batch).__name__}; pass a dict of tensors")
        for key in ("input_ids", "labels") if labels else ("input_ids",):
            _check_ids(batch.get(key), key, where, batch.get("input_ids"))
            values.append((batch[key], key, where))
    if vocab_size:
        _check_values(values, vocab_size)


def _check_values(values: list, vocab: int) -> None:
    """Every id within the vocabulary (labels also ``IGNORE_INDEX``), read on the host once per device (a
    read of device values waits for the device; one wait, not one per tensor), then named where one is not."""
    invalid = [_invalid(t, key, vocab) for t, key, _ in values]
    by_device: dict = {}
    for flag in invalid:
        by_device.setdefault(flag.device, []).append(flag.any())
    if not any(bool(torch.stack(flags).any()) for flags in by_device.values()):
        return
    for (t, key, where), bad in zip(values, invalid):
        if bool(bad.any()):
            raise BatchError(f"{where}: {key} holds {int(t[bad][0])}, outside the model's vocabulary of {vocab} "
                             f"tokens (0 .. {vocab - 1}{f', or {IGNORE_INDEX}' if key == 'labels' else ''})")


def _invalid(t: torch.Tensor, key: str, vocab: int) -> torch.Tensor:
    valid = (t >= 0) & (t < vocab)
    return ~valid if key == "input_ids" else ~(valid | (t == IGNORE_INDEX))


def _check_ids(t, key: str, where: str, ids) -> None:
    if not isinstance(t, torch.Tensor):
        hint = " (a collator such as DataCollatorForLanguageModeling adds them)" if key == "labels" else ""
        raise BatchError(f"{where} has no {key!r} tensor{hint}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise BatchError(f"{where}: {key} must hold integer token ids, got {t.dtype}")
    if t.ndim != 2 or t.numel() == 0:
        raise BatchError(f"{where}: {key} must be [batch, sequence] with at least one token, got shape "
                         f"{list(t.shape)}")
    if key == "labels" and t.shape != ids.shape:
        raise BatchError(f"{where}: labels shape {list(t.shape)} differs from input_ids {list(ids.shape)}")


def pad_rows(batch: dict, microbatches: int) -> tuple[dict, int]:
    """``batch`` grown to a multiple of ``microbatches`` rows; returns it and its own row count.

    A DataLoader's last batch is often smaller (``drop_last=False``), and torch's schedules split a
    batch into equal microbatches only. The rows added copy the last row's inputs (so attention,
    positions and masks stay as in real rows, never an all-masked row whose softmax is NaN) with
    every label (``shift_labels`` too, under --cp) ``IGNORE_INDEX``: they add no loss and no token, so their gradient is exactly zero and the
    step equals the one-process step on the real rows. Logits of added rows are dropped by the caller.
    """
    rows = batch["input_ids"].shape[0]
    extra = -rows % microbatches
    if not extra:
        return batch, rows
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == rows:
            fill = torch.full_like(value[-1:], IGNORE_INDEX) if key in ("labels", "shift_labels") else value[-1:]
            fill = torch.zeros_like(fill) if key == "router_mask" else fill  # nor any router statistic
            value = torch.cat([value, fill.expand(extra, *value.shape[1:])])
        out[key] = value
    return out, rows


def with_router_mask(batch: dict) -> dict:
    """``batch`` with a ``router_mask`` (B, T): the tokens a MoE router aux loss counts (transformers counts those of
    the attention mask, or every token without one), less the rows a caller marked as filling a batch (its own
    ``router_mask`` zero there), so that the rows :func:`pad_rows` adds count none either."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    counted = torch.ones_like(ids) if mask is None else mask.to(ids.dtype)
    given = batch.get("router_mask")
    return {**batch, "router_mask": counted if given is None else counted * given.to(ids.dtype)}
