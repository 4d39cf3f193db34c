"""One optimizer step over a pipeline, equal to the single-process full-batch step.

Three things make a pipelined step differ from the plain one unless handled here:
- the loss must be divided by the count of the *whole* step (every microbatch, every accumulation
  batch, every dp rank), not per microbatch: for SFT its loss tokens; what is counted is the
  pipeline's objective's (:class:`hfpipe.loss.objective.Objective`);
- a tied embedding lives on two ranks, so its two gradient halves must be summed;
- gradient clipping needs the norm over all stages (and dp shards), the tied weight counted once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfpipe.models.router_loss import finish_summed_router_loss
from hfpipe.pipeline.schedule import Pipeline
from hfpipe.pipeline.inputs import BatchError, check_batches
from hfpipe.pipeline.params import by_mesh, unique_parameters
from hfpipe.parallel.grads import squared_norm

__all__ = ["BatchError", "EvalSum", "StepResult", "StepEngine", "check_batches", "trainer_for"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step measured (identical on every rank)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int  # the step's count (StepEngine.step_count): its loss tokens under SFT's TokenMean
    seen: int = 0  # the input positions the step read over its dp replicas (rows x length, padding included)


@dataclass
class EvalSum:
    """An evaluation's sums over the batch group, which add up over calls (:meth:`StepEngine.eval_sum`).

    Attributes:
        loss: The objective's loss summed over the rows (its mean x ``count``).
        count: What the objective divides it by (loss tokens for SFT).
        router: A MoE model's router sums of those rows (:func:`hfpipe.models.router_loss.sums_with_tokens`,
            float64 on the host), or ``None``.
    """

    loss: float
    count: int
    router: torch.Tensor | None = None

    def __add__(self, other: EvalSum) -> EvalSum:
        router = self.router if other.router is None else other.router if self.router is None else (
            self.router + other.router)
        return EvalSum(self.loss + other.loss, self.count + other.count, router)

    def value(self, spec, count: int | None = None) -> float:
        """The objective's loss / ``count`` (default: the counted one) plus ``coef * aux`` of the rows."""
        loss = self.loss / max(count or self.count, 1)
        if self.router is not None and spec is not None:
            loss += float(finish_summed_router_loss(self.router, spec))
        return loss


def _as_list(batches: list[dict] | dict) -> list[dict]:
    return [batches] if isinstance(batches, Mapping) else list(batches)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class StepEngine:
    """Runs exact optimizer steps for this rank's stages.

    Args:
        pipe: This rank's :class:`hfpipe.pipeline.schedule.Pipeline`.
        dist_info: This rank's :class:`hfpipe.parallel.mesh.Dist`.
        optimizer: Any torch optimizer over this rank's parameters (the user's own is fine).
        scheduler: Optional LR scheduler stepped after each optimizer step.
        max_grad_norm: Clip to this global norm; ``None`` or 0 disables clipping (norm still reported).
        tied_group: From :meth:`hfpipe.parallel.mesh.Dist.tied_group`.
        loss_rank: Pipeline rank that holds the last stage (where the loss is computed).
        vocab_size: Token ids a batch may hold (checked before a schedule runs), or ``None``.

    What the step's loss is divided by is the pipeline's objective's (``pipe.objective``): one object says
    both what the last stage computes and how the step normalises it.
    """

    def __init__(self, pipe: Pipeline, dist_info, optimizer, *, scheduler=None, max_grad_norm=None,
                 tied_group=None, loss_rank: int, vocab_size: int | None = None) -> None:
        self.pipe, self.dist, self.optimizer, self.scheduler = pipe, dist_info, optimizer, scheduler
        self.vocab_size = vocab_size
        self.max_grad_norm = max_grad_norm
        self.tied_group = tied_group
        self.loss_rank = loss_rank
        named = unique_parameters(pipe.modules)
        self._params = [p for _, p in named]
        self._tied = [p for n, p in named if n in ("model.embed_tokens.weight", "lm_head.weight")]
        # The head copy of a tied embedding is counted in the norm on the embedding's rank only.
        self._norm_params = [p for n, p in named if not (tied_group is not None and n == "lm_head.weight")]
        # Every rank sums the norm in one dtype (a rank of empty stages has no gradient to read it from).
        fp64 = any(m.hidden_dtype == torch.float64 for m in pipe.modules)
        self._norm_dtype = torch.float64 if fp64 else torch.float32

    @property
    def objective(self):
        """The pipeline's :class:`hfpipe.loss.objective.Objective`: what a batch counts, what its loss is."""
        return self.pipe.objective

    def step(self, batches: list[dict] | dict) -> StepResult:
        """One optimizer step over ``batches`` (accumulated), in the one order every face follows.

        This rank's part of each batch (:meth:`local_batches`), the step's count (:meth:`step_count`), the
        backward of each batch (:meth:`backward`), the tied halves summed and the gradients clipped
        (:meth:`clip_gradients`), then the optimizer and the scheduler (:meth:`optimizer_step`).
        ``hfpipe.hf``'s Trainer runs the same pieces, one accumulation batch at a time.

        Args:
            batches: One batch, or ``grad_accum`` batches for one optimizer step. Every rank of a
                pipeline passes the same batches; dp ranks pass their own shards.
        """
        batches = _as_list(batches)
        seen = sum(int(b["input_ids"].numel()) for b in batches) * self.dist.dims.dp  # each replica: its shard
        batches = self.local_batches(batches, "trainer.step")
        count = self.step_count(batches)
        loss = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for batch in batches:
            loss += self.backward(batch, count, len(batches))
        norm = self.clip_gradients()
        lr = self.optimizer_step()
        loss, norm = torch.stack([self.shared_loss(loss), norm.double()]).tolist()  # the step's one host read
        return StepResult(loss, norm, lr, count, seen)

    def local_batches(self, batches: list[dict], call: str, split=None) -> list[dict]:
        """``batches`` checked (ids and labels within the vocabulary, named by ``call``), then each cut to
        this rank's part by ``split`` (default ``Pipeline.local``: under --cp its tokens, labels shifted first)."""
        check_batches(batches, self.vocab_size, call)
        return [(split or self.pipe.local)(b) for b in batches]

    def step_count(self, batches: list[dict]) -> int:
        """What the step's loss is divided by: the objective's count of ``batches`` (this rank's parts; loss
        tokens for SFT) summed over the batch group (every dp and cp shard), at least 1."""
        count = sum(self.objective.count(b) for b in batches)
        if self.dist.batch_group is not None:
            count = torch.tensor(count, dtype=torch.int64, device=self.dist.device)
            dist.all_reduce(count, group=self.dist.batch_group)
        return max(1, int(count))

    def backward(self, batch: dict, count: int, batches_in_step: int) -> torch.Tensor:
        """Forward/backward of one accumulation batch; returns this rank's part of the step loss (float64, on
        the device: nothing waits for the backward to finish).

        ``count`` is the step's :meth:`step_count`, ``batches_in_step`` its accumulation batches.
        """
        # FSDP averages gradients over its ranks (gloo has no pre-scaled sum), so each rank's loss is
        # scaled up by as much, to leave the sum over the batch group / the step's count.
        dp = self.dist.dims.grad_divide_factor
        # A microbatch's router aux loss counts 1 / (all microbatches of the step), scaled up by dp
        # like the token loss (hfpipe.models.router_loss).
        router_denominator = batches_in_step * self.pipe.microbatches
        part = self.pipe.train_step(batch, count / dp, router_denominator)
        if part is None:
            return torch.zeros((), dtype=torch.float64, device=self.dist.device)
        return part.double().to(self.dist.device) / dp

    def clip_gradients(self) -> torch.Tensor:
        """Sum the tied embedding's two gradient halves, then clip to the global norm; returns the norm (an
        fp32 tensor on the device, as ``torch.nn.utils.clip_grad_norm_``: read only when logged)."""
        self._sync_tied_grads()
        return self._clip()

    def optimizer_step(self) -> float:
        """Step the optimizer and the scheduler, then drop the gradients; returns the learning rate stepped with."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    @torch.no_grad()
    def eval_loss(self, batches: list[dict] | dict) -> float:
        """What transformers' model returns as ``loss`` on the rows of ``batches`` run as one batch, without
        gradients (same value on every rank): the objective's loss, plus a MoE model's router aux loss."""
        return self.eval_sum(batches).value(self.pipe.router_loss)

    @torch.no_grad()
    def eval_sum(self, batches: list[dict] | dict) -> EvalSum:
        """The parts of :meth:`eval_loss` over the batch group (every dp and cp shard), summed, for a caller that
        adds several calls up (an evaluation set: ``sum(parts).value(spec)``)."""
        batches = self.local_batches(_as_list(batches), "trainer.eval_loss")
        count = self.step_count(batches)
        spec = self.pipe.router_loss
        # [the objective's loss, then the router sums (counts, probabilities, tokens)]: one reduction for both
        t = torch.zeros(1 + (spec.size + 1 if spec else 0), dtype=torch.float64, device=self.dist.device)
        for batch in batches:
            part, sums = self.pipe.eval_loss(batch, count)
            if part is not None:
                t[0] += part.double().to(self.dist.device)
            if sums is not None:
                t[1:] += sums.double().to(self.dist.device)
        t = self.shared_loss(t).cpu()
        return EvalSum(float(t[0]) * count, count, t[1:] if spec else None)

    def _sync_tied_grads(self) -> None:
        if self.tied_group is None:
            return
        for p in self._tied:
            if p.grad is not None:
                dist.all_reduce(_local(p.grad), group=self.tied_group)

    def _clip(self) -> torch.Tensor:
        """Global L2 norm over all ranks' gradients; scale them down to ``max_grad_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` (the plain Trainer's): the coefficient stays on the device,
        clamped to 1, and every gradient is multiplied by it, so no rank waits to read the norm.
        """
        grads = [p.grad for p in self._norm_params if p.grad is not None]
        pp_group = self.dist.pp_group if self.dist.dims.pp > 1 else None
        norm = squared_norm(grads, pp_group, self.dist.device, self._norm_dtype).sqrt()
        if self.max_grad_norm:
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            grads = [p.grad for p in self._params if p.grad is not None]
            # foreach refuses an empty list (a rank of empty stages) and a list mixing meshes: one call per mesh;
            # on the local shards, as a DTensor would not take a plain tensor as the factor
            for same in by_mesh(grads):
                local = [_local(g) for g in same]
                torch._foreach_mul_(local, coef.to(local[0].device))
        return norm

    def shared_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum over the batch group on the loss rank, then broadcast along the pipeline (on the device; no
        collective where a group is this rank alone)."""
        t = loss.to(self.dist.device)
        if self.dist.batch_group is not None and self.pipe.has_loss:
            dist.all_reduce(t, group=self.dist.batch_group)
        if self.dist.dims.pp > 1:
            dist.broadcast(t, src=self.dist.pp_peer(self.loss_rank), group=self.dist.pp_group)
        return t

    def share_loss(self, loss: torch.Tensor) -> float:
        """:meth:`shared_loss`, read on the host."""
        return float(self.shared_loss(loss))


def trainer_for(pm, optimizer, *, scheduler=None, max_grad_norm: float | None = 1.0) -> StepEngine:
    """A :class:`StepEngine` over a :class:`hfpipe.pipeline.model.PipelineModel`'s stages."""
    return StepEngine(pm.pipe, pm.dist, optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm,
                           tied_group=pm.tied_group, loss_rank=pm.loss_rank, vocab_size=pm.vocab_size)
