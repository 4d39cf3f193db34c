"""Labels, their causal shift, the tokens that carry loss, and the summed token cross-entropy.

The one place ``-100`` is written: data marks the tokens without loss with it, the cp split shifts
labels with it, the pipeline pads rows with it and the losses skip it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "batch_targets", "batch_tokens", "count_tokens", "shift_labels", "token_loss_sum"]

#: The label of a token that carries no loss (transformers' and torch's ``ignore_index``).
IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: ``labels`` moved one left, the last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # (B, T): predict token t+1 at t


def batch_targets(batch: dict) -> torch.Tensor:
    """A batch's shifted labels: a cp rank's ``shift_labels`` (shifted before the sequence split), else its
    ``labels`` shifted here."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])


def count_tokens(labels) -> int:
    """Tokens that carry loss after the causal shift (of unshifted ``labels``, a tensor or an array)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def batch_tokens(batch: dict) -> int:
    """Tokens that carry loss in a batch: of its ``labels``, or of a cp rank's ``shift_labels``."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return count_tokens(batch["labels"])


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy (fp32; fp64 for fp64 logits) over ``targets`` != ``IGNORE_INDEX``; ``targets``
    already shifted."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide.flatten(0, -2), targets.flatten().to(logits.device), ignore_index=IGNORE_INDEX,
                           reduction="sum")
