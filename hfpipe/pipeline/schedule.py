"""Run stage modules through torch.distributed.pipelining schedules.

torch's schedules do the ordering, the send/recv and the backward; this module only chooses the
schedule (its counts are checked up front by hfpipe.parallel.rules), hands the last stage the objective's
loss (hfpipe.loss.objective: a sum divided by the step's count, ``scale_grads=False``), and resizes the
stages when the batch shape changes (hfpipe.pipeline.shapes), since torch's stages size their receive
buffers on first use.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hfpipe.errors import HfpipeError
from hfpipe.loss.budget import chunk_tokens
from hfpipe.loss.linear_head import LinearHead
from hfpipe.loss.objective import Head, Objective, StageLoss, TokenMean
from hfpipe.pipeline.accumulating_stage import AccumulatingStage
from hfpipe.pipeline.inputs import pad_rows, with_router_mask
from hfpipe.pipeline.shapes import resize_schedule
from hfpipe.pipeline.stage_sync import ReducingStage
from hfpipe.parallel.one_replica import release
from hfpipe.parallel.rules import SINGLE_STAGE
from hfpipe.parallel.schedules import schedule_class

__all__ = ["PipelineError", "Pipeline"]

log = logging.getLogger(__name__)

_KEEP_SCHEDULES = 4


class PipelineError(HfpipeError):
    """A schedule / microbatch / batch combination that cannot run (message names the option)."""


def _vocab_split(last) -> bool:
    """Whether the last stage's head is split over tp ranks (its weight sharded on the ``tp`` mesh dim)."""
    weight = getattr(last.lm_head, "weight", None)
    names = getattr(getattr(weight, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names and weight.placements[names.index("tp")].is_shard()


def _agreed_vocab_split(stages, given: bool | None) -> bool:
    """Whether the head is split over tp ranks, as every rank of the pipeline knows it (see ``vocab_split``)."""
    last = next((m for m in stages if m.is_last), None)
    split = _vocab_split(last) if last is not None else any(_on_tp_mesh(p) for m in stages for p in m.parameters())
    if given is not None and last is not None and given != split:
        raise PipelineError(f"Pipeline(vocab_split={given}): the last stage's head is {'' if split else 'not '}split "
                            "over tp ranks; pass what the layout says (--tp > 1)")
    return split if given is None else given


def _on_tp_mesh(param) -> bool:
    return "tp" in (getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ())


class Pipeline:
    """This rank's stages driven by a torch schedule.

    Args:
        stages: This rank's stage modules, in increasing stage index (materialised on ``device``).
        owners: The pipeline rank of every stage of the whole pipeline, in stage order
            (:meth:`hfpipe.plan.split.Plan.rank_of_stage`).
        schedule: A name from :data:`hfpipe.parallel.rules.SCHEDULES`.
        microbatches: Microbatches per step.
        group: The pipeline process group.
        device: This rank's device.
        loss_chunk_tokens: Tokens per chunk of the last stage's loss (hfpipe.loss.chunked); ``None``
            sizes chunks to a logits budget and chunks only microbatches larger than one chunk;
            0 computes the full logits in the last stage's forward.
        reduce_every_microbatch: FSDP2 reduce-scatters and reshards after every microbatch
            (hfpipe.pipeline.stage_sync), instead of once a step.
        context: Under ``--cp``, the stages' :class:`hfpipe.parallel.context.ContextParallel`: every method
            takes whole rows and runs this rank's tokens of them (:meth:`local`).
        objective: What the last stage computes of each microbatch and what a step divides it by
            (:class:`hfpipe.loss.objective.Objective`; default SFT's :class:`~hfpipe.loss.objective.TokenMean`).
        vocab_split: The head is split over tp ranks (``--tp`` > 1), on every rank of the pipeline alike;
            ``None`` reads it from this rank's stages (a parameter on a ``tp`` mesh).
    """

    def __init__(self, stages, owners: list[int], schedule: str, microbatches: int, group, device,
                 loss_chunk_tokens: int | None = None, reduce_every_microbatch: bool = False,
                 context=None, objective: Objective | None = None, vocab_split: bool | None = None) -> None:
        self.modules = stages
        self.vocab_split = _agreed_vocab_split(stages, vocab_split)
        # Stages whose set-up for a new batch shape keeps the gradients of earlier accumulation batches
        self.stage_class = ReducingStage if reduce_every_microbatch else AccumulatingStage
        self.loss_chunk_tokens = loss_chunk_tokens
        self.owners = list(owners)
        self.num_stages = len(self.owners)
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.group = group
        self.device = device
        self.objective = objective if objective is not None else TokenMean()
        self.loss = StageLoss(self.objective)
        self.context = context
        self._schedules: dict = {}  # (kwargs, mode, chunked head) -> (shape, schedule), most recent last
        self.builds = 0  # schedules (and torch stages) built so far

    def use_objective(self, objective: Objective) -> None:
        """Hand the last stage ``objective`` from now on (the schedules built so far hold the old one's loss)."""
        self.objective = objective
        self.loss = StageLoss(objective)
        self._schedules.clear()

    @property
    def has_loss(self) -> bool:
        """Whether the last stage (the loss) lives on this rank."""
        return any(m.is_last for m in self.modules)

    @property
    def has_input(self) -> bool:
        return any(m.is_first for m in self.modules)

    def _get_schedule(self, shape, kwargs, mode: str):
        """A schedule for ``mode`` ("train", "loss" or "logits") and this batch shape.

        A new shape resizes the stages of the schedule kept for this mode (hfpipe.pipeline.shapes);
        only where that cannot be done are new stages built.
        """
        if shape[0] % self.microbatches:  # torch would split it unevenly and return wrong rows, silently
            raise PipelineError(f"a batch of {shape[0]} sequences does not divide into {self.microbatches} "
                                "microbatches; pass a multiple of the microbatch count")
        key = (tuple(sorted(kwargs)), mode, self._set_head(shape, mode))
        self._set_router_sums(mode)
        shape = tuple(shape)
        entry = self._schedules.pop(key, None)
        if entry is not None and entry[0] != shape:
            rows, rest = divmod(shape[0], self.microbatches)
            if rest or not resize_schedule(entry[1], (rows, shape[1])):
                entry = None
        if entry is None:
            pstages = [self.stage_class(m, m.spec.index, self.num_stages, self.device, group=self.group)
                       for m in self.modules]
            cls = schedule_class(self.schedule_name)
            arg = pstages[0] if self.schedule_name in SINGLE_STAGE else pstages
            loss_fn = None if mode == "logits" else self.loss
            entry = (shape, cls(arg, self.microbatches, loss_fn=loss_fn, scale_grads=False))
            self.builds += 1
            while len(self._schedules) >= _KEEP_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
        self._schedules[key] = (shape, entry[1])
        return entry[1]

    def _head_chunk(self, shape, mode: str) -> int:
        """Tokens per chunk of the head loss for this batch shape and ``mode``, 0 for the head in the forward.

        Decided alike on every rank of the pipeline, from the shape and what every rank knows: the choice
        keys the schedules, and a choice made on the loss rank alone would set the stages up for a new shape
        on some ranks and not on others, whose next messages then mismatch. Only training and evaluation
        losses chunk; logits asked for are whole.
        """
        if mode == "logits" or not self.modules:
            return 0
        chunk = chunk_tokens(self.modules[0].config.vocab_size, self.loss_chunk_tokens)
        tokens = shape[0] // self.microbatches * shape[1]
        if 0 < chunk < tokens:
            return chunk
        # One chunk would hold the whole microbatch: nothing to save, unless the head is split over tp
        # ranks, whose logits the stage would otherwise gather whole on every rank (measured by
        # bench/tp.py) instead of taking the vocabulary-parallel loss on them.
        return tokens if self.vocab_split else 0

    def _set_head(self, shape, mode: str) -> bool:
        """Route the last stage's head through the chunked loss for this batch (or not): :meth:`_head_chunk`."""
        last = next((m for m in self.modules if m.is_last), None)
        chunk = self._head_chunk(shape, mode)
        head = None
        if last is not None:
            last.head_in_loss = chunk > 0
            parts = last.head_parts() if chunk else None
            head = Head(last.logits, chunk, LinearHead(*parts) if parts else None) if chunk else None
        self.loss.head = head
        return chunk > 0

    def _set_router_sums(self, mode: str) -> None:
        """Whether the stages' router sums ride along with the hidden states (a loss's: "train", "loss") and
        leave the last stage with its output ("loss": evaluation sums them), or not at all ("logits").
        (hfpipe.models.router_loss)"""
        for m in self.modules:
            m.carry_router_sums, m.router_sums_out = mode in ("train", "loss"), mode == "loss"

    def local(self, batch: dict) -> dict:
        """This rank's part of a batch of whole rows: under --cp its tokens (labels shifted first), else all."""
        if self.context is None or "shift_labels" in batch:
            return batch
        return self.context.split_batch(batch)

    def _inputs(self, batch: dict):
        ids = batch["input_ids"]
        keys = ("attention_mask", "position_ids", "context_keys") + (("router_mask",) if self.router_loss else ())
        kwargs = {k: batch[k].to(self.device) for k in keys if batch.get(k) is not None}
        if "input_ids" in self.modules[0].adapter.layer_inputs:  # every stage's layers read the ids (DeepSeek-V4)
            kwargs["input_ids"] = ids.to(self.device)
        args = (ids.to(self.device),) if self.has_input else ()
        return ids.shape, args, kwargs

    def train_step(self, batch: dict, denominator: float,
                   router_denominator: float | None = None) -> torch.Tensor | None:
        """Forward and backward over one batch; gradients accumulate into the parameters.

        Args:
            batch: ``input_ids`` and ``labels`` [B, T], optional ``attention_mask``/``position_ids``;
                every rank passes the same batch (only the first stage reads the ids, only the
                last the labels).
            denominator: What the objective's loss is divided by: the step's count (loss tokens for SFT).
            router_denominator: What each microbatch's router aux loss is divided by (MoE models
                with ``output_router_logits``): the step's microbatch count over every
                accumulation batch and dp rank, divided by dp as ``denominator`` is (default: the
                microbatches of this batch). See hfpipe.models.router_loss.

        Returns:
            On the rank holding the loss, the summed loss of this batch (already divided by
            ``denominator``); elsewhere ``None``.
        """
        batch = self._whole_microbatches(self.local(batch), train=True)[0]
        shape, args, kwargs = self._inputs(batch)
        schedule = self._get_schedule(shape, kwargs, "train")
        self.loss.denominator = float(denominator)
        self.loss.router_denominator = float(router_denominator or self.microbatches)
        losses: list = []
        target = self.objective.targets(batch).to(self.device) if self.has_loss else None
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not self.has_loss:
            return None
        return torch.stack([x.detach().double() for x in losses]).sum()  # (an fp64 run's loss kept whole)

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor | None:
        """Logits [B, T, V] on the rank holding the last stage; ``None`` elsewhere (under --cp gathered
        from every cp rank's tokens)."""
        logits = self._local_logits(self.local(batch))
        if self.context is None or logits is None:
            return logits
        return self.context.gather_sequence(logits)

    def _local_logits(self, batch: dict, router: bool = False):
        """This rank's logits of ``batch`` (on the loss rank), with ``router`` (the in-order forward's evaluation)
        also its router sums (``(logits, sums)``, :func:`hfpipe.models.router_loss.sums_with_tokens`); ``None``
        elsewhere."""
        was_training = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        try:
            if self._local_hops:  # the schedule's own path sets the stages up in _get_schedule
                self._set_head(batch["input_ids"].shape, "logits")
                self._set_router_sums("loss" if router else "logits")  # an evaluation's sums, beside the logits
                return self._forward_in_order(batch)
            batch, rows = self._whole_microbatches(batch)
            shape, args, kwargs = self._inputs(batch)
            logits = self._get_schedule(shape, kwargs, "logits").eval(*args, **kwargs)
            return None if logits is None else logits[:rows]
        finally:
            release(self.modules)  # bf16-mixed at one replica: the fp32 masters registered again
            for m, mode in zip(self.modules, was_training):
                m.train(mode)

    @property
    def router_loss(self):
        """The stages' :class:`hfpipe.models.router_loss.RouterLossSpec` (a MoE aux loss), or ``None``."""
        return next((m.router_loss for m in self.modules if getattr(m, "router_loss", None)), None)

    @torch.no_grad()
    def eval_loss(self, batch: dict, denominator: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The objective's loss / ``denominator`` of a batch without backward, and where the model has a router
        aux loss the summed router sums of the batch's rows (``(2 * E + 1,)``, finished by the caller over every
        batch and rank: :func:`hfpipe.models.router_loss.finish_summed_router_loss`); on the loss rank, else
        ``(None, None)``."""
        batch = self.local(batch)
        if self.router_loss:
            batch = with_router_mask(batch)  # the rows pad_rows adds count no router statistic
        if self._local_hops:
            out = self._local_logits(batch, router=bool(self.router_loss))
            if out is None:
                return None, None
            logits, sums = out if isinstance(out, tuple) else (out, None)
            targets = self.objective.targets(batch).to(self.device)
            return self.objective.eval_loss(logits, targets, float(denominator)), sums
        batch = self._whole_microbatches(batch)[0]
        shape, args, kwargs = self._inputs(batch)
        schedule = self._get_schedule(shape, kwargs, "loss")
        self.loss.denominator = float(denominator)
        self.loss.router_sums = [] if self.router_loss else None
        losses: list = []
        target = self.objective.targets(batch).to(self.device) if self.has_loss else None
        try:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        finally:
            release(self.modules)
            sums, self.loss.router_sums = self.loss.router_sums, None
        if not self.has_loss:
            return None, None
        return torch.stack([x.float() for x in losses]).sum(), (torch.stack(sums).sum(0) if sums else None)

    def _whole_microbatches(self, batch: dict, train: bool = False) -> tuple[dict, int]:
        """A partial last batch padded with rows that carry no loss (:func:`pad_rows`); its real rows."""
        padded, rows = pad_rows(batch, self.microbatches)
        if train and padded is not batch and any(getattr(m, "router_loss", None) for m in self.modules):
            # The router aux loss is a mean over microbatches: a microbatch of added rows would count in it.
            raise PipelineError(f"a batch of {rows} sequences does not divide into {self.microbatches} "
                                "microbatches, and this model's router aux loss is per microbatch; pass a "
                                "multiple of the microbatch count (a DataLoader with drop_last=True)")
        return padded, rows

    @property
    def _local_hops(self) -> bool:
        """Whether some stage feeds the next one on the same rank (V turn, or pp=1 with vpp>1)."""
        return any(a == b for a, b in zip(self.owners, self.owners[1:]))

    def _forward_in_order(self, batch: dict) -> torch.Tensor | None:
        """Run every stage in index order with plain send/recv, whole batch at once.

        torch's multi-stage schedules cannot run forward-only when a stage hands its output to
        the next stage on the same rank (their eval still steals backward inputs and fails), and
        evaluation needs no overlap, so those pipelines evaluate this way.
        """
        _, args, kwargs = self._inputs(batch)
        local = {m.spec.index: m for m in self.modules}
        owner = self.owners
        me = dist.get_rank(self.group)
        h = (args[0],) if args else ()
        for s in range(self.num_stages):
            if s in local:
                if s > 0 and owner[s - 1] != me:
                    h = self._recv_hidden(batch, owner[s - 1])
                h = local[s](*h, **kwargs)
                h = h if isinstance(h, tuple) else (h,)  # (hidden, router sums) while they ride along
                if s + 1 < self.num_stages and owner[s + 1] != me:
                    for t in h:
                        dist.send(t.contiguous(), dist.get_global_rank(self.group, owner[s + 1]), group=self.group)
        if not self.has_loss:
            return None
        return h if len(h) > 1 else h[0]

    def _recv_hidden(self, batch: dict, src: int) -> tuple[torch.Tensor, ...]:
        # The stage says what it receives: an empty stage has no parameter to read a dtype from,
        # and some families pass hidden states of another shape (DeepSeek-V4's streams).
        m = self.modules[0]
        got = [torch.empty(m.hidden_shape(*batch["input_ids"].shape), dtype=m.hidden_dtype, device=self.device)]
        if m.carry_router_sums and m.router_loss:
            got.append(torch.empty(m.router_loss.size, dtype=torch.float32, device=self.device))
        for t in got:
            dist.recv(t, dist.get_global_rank(self.group, src), group=self.group)
        return tuple(got)
