"""The reference pass of preference training: the reference log-probs of every pair, without a second model.

DPO compares the policy's log-probs with a frozen reference's. Holding a second pipeline of the same size
would double the weights' memory, so the reference is read once, before training, by a forward-only pass of
the pipeline itself (TRL's ``precompute_ref_log_probs=True``): the model is still the reference then. Under
LoRA the base with its adapters switched off is the reference at any time (as PEFT and TRL do it), so the
pass runs with ``adapters_off``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from hfpipe.loss.preference import Preference, pair_batch
from hfpipe.pipeline.inputs import check_batches

__all__ = ["adapters_disabled", "reference_logps"]


@contextlib.contextmanager
def adapters_disabled(modules):
    """PEFT's adapters in ``modules`` switched off (the base model alone), and back on afterwards."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT: no adapters to switch off
        yield
        return
    layers = [m for module in modules for m in module.modules() if isinstance(m, BaseTunerLayer)]
    on = [not layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, was_on in zip(layers, on):
            layer.enable_adapters(was_on)


@contextlib.contextmanager
def _reference_mode(objective: Preference):
    objective.reference, objective.records = True, []
    try:
        yield
    finally:
        objective.reference, objective.records = False, []


@torch.no_grad()
def reference_logps(pm, batches: Iterable[dict], *, adapters_off: bool = False,
                    over_dp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs of the chosen and of the rejected completion of every pair of ``batches``.

    Every rank of a pipeline calls it with the same batches (dp replicas may pass their own); each batch runs
    forward only through the schedule, and the last stage sums each row's completion log-probs as TRL's
    ``compute_ref_log_probs`` does (:func:`hfpipe.loss.trl_dpo.trl_ref_logps`).

    Args:
        pm: A :class:`hfpipe.pipeline.model.RankPipeline` whose objective is a :class:`Preference`.
        batches: TRL ``DataCollatorForPreference`` batches (``input_ids``, ``attention_mask``,
            ``completion_mask``: chosen rows, then rejected rows).
        adapters_off: Switch PEFT's adapters off for the pass (the reference of a LoRA run).
        over_dp: Every replica passes all the batches; each runs every dp-th of them (replica r: r, r + dp, ...)
            and the results are shared, so each rank returns all of them.

    Returns:
        ``(chosen, rejected)``, float32 (pairs,) each, in the batches' order, the same on every rank of the
        pipeline (sent from the rank of the last stage).
    """
    objective = pm.pipe.objective
    if not isinstance(objective, Preference):
        raise TypeError(f"reference_logps needs a pipeline whose objective is a Preference, not {objective!r}")
    d = pm.dist
    share = over_dp and d.dp > 1
    mine: dict[int, tuple] = {}
    sizes: list[int] = []  # every batch's pairs, known to every replica
    was_training = [m.training for m in pm.modules]
    for m in pm.modules:
        m.eval()
    off = adapters_disabled(pm.modules) if adapters_off else contextlib.nullcontext()
    try:
        with _reference_mode(objective), off:
            first = None
            for i, collated in enumerate(batches):
                sizes.append(collated["input_ids"].shape[0] // 2)
                first = collated if first is None else first
                if not share or i % d.dp == d.dp_rank:
                    mine[i] = _batch_logps(pm, objective, collated)
            if share:  # a replica with one batch fewer runs one more, unused: FSDP2 gathers over every replica
                for _ in range(-(-len(sizes) // d.dp) - len(mine)):
                    _batch_logps(pm, objective, first)
    finally:
        for m, mode in zip(pm.modules, was_training):
            m.train(mode)
    if share:
        mine = _shared_over_dp(d, mine, sizes)
    ordered = [mine[i] for i in sorted(mine)]
    empty = torch.zeros(0)
    return (torch.cat([c for c, _ in ordered]) if ordered else empty,
            torch.cat([r for _, r in ordered]) if ordered else empty)


def _shared_over_dp(d, mine: dict[int, tuple], sizes: list[int]) -> dict[int, tuple]:
    """Every replica's batches from each replica's own: each writes its rows into zeros, summed over dp (adding
    zeros is exact), so no pickled objects cross the wire (``all_gather_object`` would pickle)."""
    ends = torch.tensor([0, *sizes]).cumsum(0).tolist()
    both = torch.zeros(2, ends[-1], dtype=torch.float32)
    for i, (chosen, rejected) in mine.items():
        both[0, ends[i]:ends[i + 1]], both[1, ends[i]:ends[i + 1]] = chosen, rejected
    both = both.to(d.device)
    dist.all_reduce(both, group=d.mesh.get_group("dp"))  # cp ranks of a replica hold the same rows
    both = both.cpu()
    return {i: (both[0, ends[i]:ends[i + 1]], both[1, ends[i]:ends[i + 1]]) for i in range(len(sizes))}


def _batch_logps(pm, objective: Preference, collated: dict) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = collated["input_ids"].shape[0] // 2
    batch = pair_batch(collated, pm.pipe.microbatches)
    check_batches([batch], pm.vocab_size, "reference pass")
    pm.pipe.eval_loss(batch, 1.0)
    both = torch.zeros(2, pairs, dtype=torch.float32, device=pm.dist.device)
    if pm.pipe.has_loss:
        records = objective.take(batch["input_ids"].shape[0])
        both[0] = torch.cat([rec["chosen"] for rec in records])[:pairs].float()
        both[1] = torch.cat([rec["rejected"] for rec in records])[:pairs].float()
    if pm.dist.pp_group is not None and dist.get_world_size(pm.dist.pp_group) > 1:
        dist.broadcast(both, src=pm.dist.pp_peer(pm.loss_rank), group=pm.dist.pp_group)
    return both[0].cpu(), both[1].cpu()
