"""One optimizer step over a pipeline, equal to the single-process full-batch step.

Three things make a pipelined step differ from the plain one unless handled here:
- the loss must be divided by the token count of the *whole* step (every microbatch, every
  accumulation batch, every dp rank), not per microbatch;
- a tied embedding lives on two ranks, so its two gradient halves must be summed;
- gradient clipping needs the norm over all stages (and dp shards), the tied weight counted once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfpipe.pipeline.schedule import Pipeline, count_tokens
from hfpipe.train.optim import unique_parameters

__all__ = ["StepResult", "PipelineTrainer", "tied_groups"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step measured (identical on every rank)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tied_groups(plan, dist_info, tied: bool):
    """Create the {first, last} rank groups of every dp replica; return this rank's (or None).

    Every rank must call this (group creation is collective), in the same order.
    """
    first, last = plan.rank_of_stage(0), plan.rank_of_stage(len(plan.stages) - 1)
    if not tied or first == last:
        return None  # one rank holds both: the two uses already share one parameter
    mine = None
    for d in range(dist_info.dp):
        ranks = [d * dist_info.pp + first, d * dist_info.pp + last]
        group = dist.new_group(ranks)
        if dist_info.rank in ranks:
            mine = group
    return mine


class PipelineTrainer:
    """Runs exact optimizer steps for this rank's stages.

    Args:
        pipe: This rank's :class:`hfpipe.pipeline.schedule.Pipeline`.
        dist_info: This rank's :class:`hfpipe.parallel.mesh.Dist`.
        optimizer: Any torch optimizer over this rank's parameters (the user's own is fine).
        scheduler: Optional LR scheduler stepped after each optimizer step.
        max_grad_norm: Clip to this global norm; ``None`` or 0 disables clipping (norm still reported).
        tied_group: From :func:`tied_groups`.
        loss_rank: Pipeline rank that holds the last stage (where the loss is computed).
    """

    def __init__(self, pipe: Pipeline, dist_info, optimizer, *, scheduler=None, max_grad_norm=None,
                 tied_group=None, loss_rank: int) -> None:
        self.pipe, self.dist, self.optimizer, self.scheduler = pipe, dist_info, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.tied_group = tied_group
        self.loss_rank = loss_rank
        named = unique_parameters(pipe.modules)
        self._params = [p for _, p in named]
        self._tied = [p for n, p in named if n in ("model.embed_tokens.weight", "lm_head.weight")]
        # The head copy of a tied embedding is counted in the norm on the embedding's rank only.
        self._norm_params = [p for n, p in named if not (tied_group is not None and n == "lm_head.weight")]

    def step(self, batches: list[dict] | dict) -> StepResult:
        """Forward/backward over ``batches`` (accumulated), then clip and step the optimizer.

        Args:
            batches: One batch, or ``grad_accum`` batches for one optimizer step. Every rank of a
                pipeline passes the same batches; dp ranks pass their own shards.
        """
        batches = [batches] if isinstance(batches, Mapping) else list(batches)
        tokens = self._global_tokens(batches)
        # FSDP averages gradients over dp (gloo has no pre-scaled sum), so each rank's loss is
        # scaled up by dp to leave the sum over all tokens / global token count.
        dp = self.dist.dp
        loss = torch.zeros((), dtype=torch.float64)
        # A microbatch's router aux loss counts 1 / (all microbatches of the step), scaled up by dp
        # like the token loss (hfpipe.pipeline.router_loss).
        router_denominator = len(batches) * self.pipe.microbatches
        for batch in batches:
            part = self.pipe.train_step(batch, tokens / dp, router_denominator)
            if part is not None:
                loss += part.double().cpu() / dp
        self._sync_tied_grads()
        norm = self._clip()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(self._share_loss(loss), norm, lr, tokens)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict] | dict) -> float:
        """Token-mean loss over ``batches`` without gradients (same value on every rank)."""
        batches = [batches] if isinstance(batches, Mapping) else list(batches)
        tokens = self._global_tokens(batches)
        loss = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            part = self.pipe.eval_loss(batch, tokens)
            if part is not None:
                loss += part.double().cpu()
        return self._share_loss(loss)

    def _global_tokens(self, batches: list[dict]) -> int:
        count = torch.tensor(sum(count_tokens(b["labels"]) for b in batches), dtype=torch.int64)
        if self.dist.dp_group is not None:
            count = count.to(self.dist.device)
            dist.all_reduce(count, group=self.dist.dp_group)
        return max(1, int(count))

    def _sync_tied_grads(self) -> None:
        if self.tied_group is None:
            return
        for p in self._tied:
            if p.grad is not None:
                dist.all_reduce(_local(p.grad), group=self.tied_group)

    def _clip(self) -> float:
        """Global L2 norm over all ranks' gradients; scale them down to ``max_grad_norm``."""
        grads = [_local(p.grad) for p in self._norm_params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.dist.device)
        if grads:
            sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).pow(2).sum()
        dist.all_reduce(sq)  # every stage and every dp shard holds a disjoint part of the gradient
        norm = float(sq.sqrt())
        if self.max_grad_norm:
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coef)
        return norm

    def _share_loss(self, loss: torch.Tensor) -> float:
        """Sum over dp on the loss rank, then broadcast along the pipeline."""
        t = loss.to(self.dist.device)
        if self.dist.dp_group is not None and self.pipe.has_loss:
            dist.all_reduce(t, group=self.dist.dp_group)
        src = self.dist.pp_peer(self.loss_rank)
        dist.broadcast(t, src=src, group=self.dist.pp_group)
        return float(t)
