"""The objective: what the last stage computes of each microbatch, and how one step normalises it.

A pipelined step equals the one-process step when its loss is a sum over the batch's rows divided by one
number the whole step shares: then every microbatch, accumulation batch and dp (and cp) shard adds its own
part, and the parts sum to the one-process loss whatever the padding or the split. An :class:`Objective`
says the four things such a loss is made of:

- :meth:`~Objective.targets`: what the last stage is handed beside its input, a tensor whose first dim is
  the batch's rows (torch's schedules cut it into microbatches as they cut the inputs);
- :meth:`~Objective.count`: what a batch adds to the step's normaliser. The step
  (:class:`hfpipe.train.step.StepEngine`) sums the counts of its accumulation batches over the batch
  group (``Dist.batch_group``: every dp and cp shard) and divides by that sum (at least 1);
- :meth:`~Objective.loss`: one microbatch's loss, already divided by that sum: what its backward runs;
- :meth:`~Objective.eval_loss`: the same without gradients, of a whole batch's logits.

SFT's :class:`TokenMean` is the default. Another objective (per sequence, per preference pair) is a new
subclass handed to ``Pipeline(..., objective=...)``: the schedules call it through :class:`StageLoss`,
which adds what is not the objective's, a MoE router aux loss, and hands it the chunked :class:`Head`.
An objective may keep per-microbatch records of its own (rewards, accuracies) for its caller to read; torch
calls the loss once more when it builds a training schedule (``PipelineStage`` infers the gradients' shapes by
running it on the first microbatch's targets), so a record counts that call or tells it apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfpipe.loss.chunked import chunked_loss_sum
from hfpipe.loss.linear_head import LinearHead
from hfpipe.loss.tokens import batch_targets, batch_tokens, token_loss_sum

__all__ = ["Head", "Objective", "StageLoss", "TokenMean"]


@dataclass(frozen=True)
class Head:
    """The last stage's head, handed to the loss when the stage's forward stops at its final hidden states.

    Then no microbatch's whole logits are ever held (:mod:`hfpipe.loss.chunked`).

    Attributes:
        logits: Maps hidden states (B, t, H) to logits (B, t, V) token by token (``stage.logits``).
        chunk: Tokens per chunk of the loss.
        linear: The same head split into its parts where it is a linear head (the loss's fast path), or ``None``.
    """

    logits: Callable[[torch.Tensor], torch.Tensor]
    chunk: int
    linear: LinearHead | None = None


class Objective:
    """What the last stage computes per microbatch and what the step divides it by (see the module docstring).

    The loss must be a sum over the rows of the microbatch divided by ``denominator``, so that the sum over
    microbatches is the same whatever the rows per microbatch.
    """

    def targets(self, batch: dict) -> torch.Tensor:
        """The tensor the last stage is handed for ``batch`` (this rank's part of it), rows first."""
        raise NotImplementedError

    def count(self, batch: dict) -> int:
        """What ``batch`` (this rank's part) adds to the number the step's loss is divided by."""
        raise NotImplementedError

    def loss(self, out: torch.Tensor, targets: torch.Tensor, head: Head | None, denominator: float) -> torch.Tensor:
        """One microbatch's loss, divided by ``denominator``: the scalar whose backward the schedule runs.

        Args:
            out: The last stage's output: logits (B, T, V), or its final hidden states when ``head`` is set.
            targets: This microbatch's rows of :meth:`targets`.
            head: The head to apply to ``out`` (a chunk at a time, to save memory), or ``None``.
            denominator: The step's count (:meth:`count` summed over the step), over the FSDP average.
        """
        raise NotImplementedError

    def eval_loss(self, logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
        """A whole batch's loss from its logits (B, T, V), without gradients; by default :meth:`loss`."""
        return self.loss(logits, targets, None, denominator)


class TokenMean(Objective):
    """Supervised fine-tuning: next-token cross entropy summed over the tokens that carry loss, divided by
    the step's count of them (every microbatch, accumulation batch and shard), as transformers' causal LM
    loss over one full batch (``num_items_in_batch``)."""

    def targets(self, batch: dict) -> torch.Tensor:
        return batch_targets(batch)

    def count(self, batch: dict) -> int:
        return batch_tokens(batch)

    def loss(self, out: torch.Tensor, targets: torch.Tensor, head: Head | None, denominator: float) -> torch.Tensor:
        if head is not None:
            return chunked_loss_sum(head.logits, out, targets, head.chunk, denominator, linear=head.linear)
        return token_loss_sum(out, targets) / denominator


class StageLoss:
    """The ``loss_fn`` torch's schedules call on the last stage: the objective's loss of one microbatch, and
    a MoE router aux loss where the stages carry one (``(out, coef * aux)``, :mod:`hfpipe.models.router_loss`).

    The pipeline sets the divisors and the head before each batch it runs.

    Attributes:
        objective: The :class:`Objective`.
        denominator: What the objective's loss is divided by (:meth:`Objective.loss`).
        router_denominator: What each microbatch's router aux loss is divided by.
        head: The chunked head, or ``None`` when the last stage returns logits.
        router_sums: Where set (evaluation), a list the stages' router sums of each microbatch are kept in, to be
            finished over the whole batch by the caller; the loss returned is then the objective's alone.
    """

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.denominator = 1.0
        self.router_denominator = 1.0
        self.head: Head | None = None
        self.router_sums: list | None = None

    def __call__(self, out, targets: torch.Tensor) -> torch.Tensor:
        router = None
        if isinstance(out, tuple):  # (hidden or logits, coef * aux of the microbatch): hfpipe.models.router_loss
            out, router = out
        loss = self.objective.loss(out, targets, self.head, self.denominator)
        if router is not None and self.router_sums is not None:
            self.router_sums.append(router.detach())
            return loss
        return loss if router is None else loss + router.to(loss.device) / self.router_denominator
