"""What tensor parallelism (``--tp N``) and FSDP resharding per microbatch cost each rank, for ``hfpipe plan``.

**Tensor parallelism** splits every matrix of a decoder layer (q/k/v/o, gate/up/down, each
expert's matrices) over ``tp`` ranks, and the embedding and head by vocabulary rows; the norms, a
MoE router and MLA's down-projections stay whole on every rank (:func:`hfpipe.plan.cost._replicated`
counts them). A rank's weights, gradients and optimizer state then scale by the share of parameters
it keeps: ``(params - whole) / tp + whole``. Under ``--ep`` the routed experts are not split: each tp
rank holds its ep shard whole (:mod:`hfpipe.plan.experts` prices them; :func:`price_ranks` leaves them
as priced).

Activations are measured per layer (:mod:`hfpipe.plan.activations`) with each saved tensor tagged
by how the runtime's tp plan leaves it on a rank (:mod:`hfpipe.plan.layouts`): split by heads or
features (``1 / tp``), the residual stream and the norms' (``1 / tp`` with sequence parallelism,
whole without), or whole (a block's gathered input that its column-split projections save, and a
LoRA adapter's fp32 copy of it). A layer's input kept under activation checkpointing is a residual.
The head's log-probabilities are vocabulary-parallel (``1 / tp``); the final norm and the head's
input are whole (the last layer's output is gathered).

Collectives per microbatch, as hfpipe's plan runs them (counted at torch's dispatcher by
``bench/tp.py``: measured / planned 1.00 on Llama, Qwen3-MoE and DeepSeek-V3). In units of one
all-reduce of the microbatch's hidden states (a ring moves ``2 * (tp - 1) / tp * size`` per rank; an
all-gather or a reduce-scatter half of it):

- a decoder layer: its family's count (:mod:`hfpipe.plan.tensor_comm`: attention, MLA, a dense MLP,
  routed and shared experts, sequence parallelism, LoRA's adapters). A dense Llama-type layer moves
  Megatron's count: 2 in forward (after attention and after the MLP: all-reduces, or under sequence
  parallelism an all-gather before and a reduce-scatter after each) and 2 in backward (one sum of each
  block's input gradient, which its column-split projections share: all-reduces, or under sequence
  parallelism a reduce-scatter and the all-gather of the output's reduce-scatter's gradient). A
  recomputed layer runs its forward once more.
- the first stage's vocabulary-parallel embedding: 1 (an all-reduce, or a reduce-scatter and its
  backward all-gather); under sequence parallelism each stage gathers its last layer's output (1/2)
  and a later stage's first layer takes its gradient gathered (1/2); the head's column split sums its
  input gradient (1); the vocabulary-parallel loss all-reduces 3 fp32 values per token.
- once per step, the gradients left as partial sums over tp (norms under sequence parallelism,
  Qwen3's head norms, a rowwise base's ``lora_B``) are all-reduced, and so is the gradient norm's
  squared sum (one fp32; clipping is on by default).

Under ``--ep`` the routed experts are not split over tp: each tp rank keeps its ep share of them
whole (weights, gradients and optimizer state not divided by tp) and runs 1/tp of the tokens.

**FSDP resharded per microbatch** (``--reshard-per-microbatch``): instead of holding its stage's
compute-dtype weights gathered and its gradients unsharded for the whole step, a rank reshards
after each microbatch's forward and reduce-scatters after each backward (NeMo AutoModel's
``defer_fsdp_grad_sync=False``). Weights and gradients then divide by dp
(:func:`hfpipe.plan.memory.param_bytes` with ``reshard``) plus the one unit FSDP2 holds gathered at
a time: the stage's root (embedding, final norm, head) and its largest decoder layer, in the compute
dtype, with their gradient unsharded in the reduce dtype. Traffic per microbatch: an all-gather in
forward, another in backward (resharded after forward) and a reduce-scatter, each moving
``(dp - 1) / dp`` of the rank's parameters (routed experts over their ``dp / ep`` replicas), but the
last stage's root, which stays gathered from forward to backward for the head loss (one all-gather);
without the option, one all-gather and one reduce-scatter per step.
"""

from __future__ import annotations

import dataclasses

from hfpipe.errors import PlanError
from hfpipe.plan.experts import replicas
from hfpipe.plan.layouts import share
from hfpipe.plan.memory import ACT_BYTES, BYTES_PER_PARAM, fsdp_bytes
from hfpipe.plan.tensor_comm import LORA_BYTES, Adapters, adapter_comm, layer_comm, spared_bytes, step_partials

__all__ = ["check_tp", "describe", "fsdp_traffic", "gathered_unit", "layer_bytes", "price_ranks",
           "tp_traffic"]


def check_tp(config, tp: int, *, dp: int = 1, reshard: bool = False, lora: bool = False) -> None:
    """Refuse what the planner cannot price. What a run cannot do (tp over the heads and sizes, resharding
    with nothing to shard) is :func:`hfpipe.parallel.rules.check_layout`'s, which ``plan_report`` calls too."""
    if reshard and lora:
        raise PlanError("--reshard-per-microbatch prices full fine-tuning; a LoRA run keeps its frozen "
                        "base as FSDP2 holds it per step: leave it out with --lora-rank")


def layer_bytes(layouts, tp: int, sp: bool) -> tuple[int, ...]:
    """Each layer's activation bytes per token on one tensor-parallel rank, from its measured
    ``(whole, by sequence, split)`` bytes (:func:`hfpipe.plan.activations.layer_layouts`)."""
    return tuple(int(share(held, tp, sp)) for held in layouts)


def price_ranks(ranks, plan, costs, tp: int, ep: int = 1) -> tuple:
    """``ranks`` with weights, gradients, optimizer state and dequantized weights cut to the share
    of parameters one tensor-parallel rank keeps (the norms and routers stay whole; under ``ep`` the
    routed experts too, which :func:`hfpipe.plan.experts.price_ranks` then cuts to ``1 / ep``)."""
    if tp == 1:
        return tuple(ranks)
    out = []
    for r in ranks:
        whole = _replicated_on(plan, r.rank, costs) + (_routed_on(plan, r.rank, costs) if ep > 1 else 0)
        params = (r.params - whole) // tp + whole
        share = params / max(1, r.params)
        out.append(dataclasses.replace(
            r, params=params, weight_bytes=int(r.weight_bytes * share), grad_bytes=int(r.grad_bytes * share),
            optimizer_bytes=int(r.optimizer_bytes * share), transient_bytes=int(r.transient_bytes * share)))
    return tuple(out)


def _replicated_on(plan, rank: int, costs) -> int:
    rep = costs.layer_replicated_params
    return sum((rep[i] if rep else 0) for s in plan.stages_of_rank(rank) for i in s.layers) + sum(
        costs.head_replicated_params for s in plan.stages_of_rank(rank) if s.head)


def _routed_on(plan, rank: int, costs) -> int:
    routed = costs.layer_routed_params
    return sum(routed[i] for s in plan.stages_of_rank(rank) for i in s.layers) if routed else 0


def _held(costs, layer: int, tp: int, ep: int) -> tuple[float, float]:
    """(params FSDP shards over dp, routed-expert params it shards over dp / ep, x tp) of one layer on a
    rank. Under ep the experts are whole on each tp rank; without it tp splits them."""
    routed = costs.layer_routed_params[layer] if costs.layer_routed_params else 0
    whole = costs.layer_replicated_params[layer] if costs.layer_replicated_params else 0
    other = costs.layer_params[layer] - routed
    return (other - whole) / tp + whole, routed / ep / (1 if ep > 1 else tp)  # under ep, experts whole over tp


def _root(costs, stage, tp: int) -> float:
    """The stage's own FSDP unit (embedding, final norm, head), on one tensor-parallel rank."""
    split = costs.embed_params * stage.embed + (costs.head_params - costs.head_replicated_params) * stage.head
    return split / tp + costs.head_replicated_params * stage.head


def gathered_unit(ranks, plan, costs, dtype: str, tp: int, ep: int) -> tuple:
    """``ranks`` plus the unit FSDP2 holds gathered when it reshards per microbatch: a stage's root
    and its largest decoder layer, in the compute dtype, and their unsharded gradient."""
    _, compute, grad, _ = fsdp_bytes(dtype)
    out = []
    for r in ranks:
        unit = max((_root(costs, s, tp) + max((sum(_held(costs, i, tp, ep)) for i in s.layers), default=0)
                    for s in plan.stages_of_rank(r.rank)), default=0)
        out.append(dataclasses.replace(r, weight_bytes=int(r.weight_bytes + unit * compute),
                                       grad_bytes=int(r.grad_bytes + unit * grad)))
    return tuple(out)


def tp_traffic(plan, costs, config, tp: int, microbatches: int, tokens: int, dtype: str, ac: str, *,
               sequence_parallel: bool = True, ep: int = 1, adapters: Adapters | None = None,
               reshard: bool = False) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU moves in tensor-parallel collectives per schedule step.

    Args:
        config: The model's config: each layer's collectives are its family's
            (:func:`hfpipe.plan.tensor_comm.layer_comm`).
        sequence_parallel: Whether the run splits activations by sequence (the runtime's default).
        ep: Expert-parallel degree (the routed experts then stay whole over tp).
        adapters: A LoRA run's :class:`~hfpipe.plan.tensor_comm.Adapters`
            (:func:`hfpipe.plan.lora.tp_adapters`); ``None`` for full fine-tuning.
        reshard: FSDP2 reshards every microbatch (the partial gradients are then reduced each one).
    """
    if tp == 1:
        return (0,) * plan.pp
    sp, act = sequence_parallel, ACT_BYTES[dtype]
    ring, h = 2 * (tp - 1) / tp, config.hidden_size * act
    lora = adapters.layers if adapters is not None else {}
    comm = [_layer(config, costs.is_moe[i], sp, act, ep, lora.get(i)) for i in range(len(costs.layers))]
    # partial gradients: a full run's norms, or a LoRA run's rowwise lora_B under SP (its norms are frozen)
    partial = ({i: a[2] * sp * LORA_BYTES for i, a in lora.items()} if adapters is not None else
               dict.fromkeys(range(len(comm)), step_partials(config, sp) * BYTES_PER_PARAM[dtype][1]))
    # a LoRA run's frozen embedding: no gradient into it or into the first layer's projections reading it
    spared = spared_bytes(config, adapters.frozen_first, sp, act) if adapters is not None else 0
    step = {"none": 0, "full": 1, "selective": 2}[ac]
    out = []
    for rank in range(plan.pp):
        per_mb = per_step = 0.0
        for stage in plan.stages_of_rank(rank):
            for j, i in enumerate(stage.layers):
                f, b = comm[i]
                per_mb += f + b + (f if step and j % step == 0 else 0)  # a recomputed layer's forward again
                per_step += partial.get(i, 0)
            per_mb += h * (stage.embed + stage.head) + 3 * 4 * stage.head  # + the loss's 3 fp32 per token
            if sp and stage.layers:  # the gather after the last layer, the scatter before the first
                per_mb += h / 2 * (1 + (not stage.embed))
            per_mb -= spared if stage.embed and stage.layers else 0
        per_step *= microbatches if reshard else 1
        per_step += 4  # clipping's squared gradient norm, summed over tp in fp32 once a step (parallel/grads.py)
        out.append(int(ring * (per_mb * tokens * microbatches + per_step)))
    return tuple(out)


def _layer(config, moe: bool, sp: bool, act: int, ep: int, adapters) -> tuple[float, float]:
    f, b = layer_comm(config, moe, sp, act, ep)
    if adapters:
        lf, lb = adapter_comm(adapters[0], adapters[1], sp)
        f, b = f + lf, b + lb
    return f, b


def fsdp_traffic(plan, costs, dtype: str, dp: int, ep: int, tp: int, microbatches: int,
                 reshard: bool) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU moves in FSDP2's all-gathers and reduce-scatters per step."""
    if dp == 1:
        return (0,) * plan.pp
    _, compute, grad, _ = fsdp_bytes(dtype)
    rounds, gathers = (microbatches, 2) if reshard else (1, 1)
    edp = replicas(dp, ep, tp)  # the ranks holding one expert
    out = []
    for rank in range(plan.pp):
        other = expert = 0.0
        for s in plan.stages_of_rank(rank):
            other += _root(costs, s, tp)
            for i in s.layers:
                o, e = _held(costs, i, tp, ep)
                other, expert = other + o, expert + e
        moved = other * (dp - 1) / dp + expert * (edp - 1) / edp
        # resharding, the last stage's root (norm, head) stays gathered from forward to backward
        # (hfpipe.pipeline.stage_sync): gathered once per microbatch, not twice
        kept = sum(_root(costs, s, tp) for s in plan.stages_of_rank(rank) if s.head) * (dp - 1) / dp
        out.append(int(rounds * (moved * (gathers * compute + grad) - (gathers - 1) * kept * compute)))
    return tuple(out)


def describe(tp: int, sp: bool, dp: int, reshard: bool, tp_bytes, fsdp_once, fsdp_now, size,
             ep: int = 1, mla: bool = False) -> list[str]:
    """The lines ``hfpipe plan`` prints about tensor parallelism and FSDP's resharding."""
    lines = []
    if tp > 1:
        how = ("sequence parallel: activations / tp" if sp else
               "no sequence parallelism: norms' and residuals' activations whole")
        whole = "norms, routers" + (", MLA's down-projections" if mla else "") + (
            ", the ep-sharded experts" if ep > 1 else "")
        which = "every matrix but the routed experts'" if ep > 1 else "every matrix"
        lines.append(f"tensor parallel: tp {tp}, {which}, the embedding and the head split {tp} ways "
                     f"({whole} whole; rank params count the share); {how}; all-reduce "
                     f"{'(all-gather + reduce-scatter) ' if sp else ''}{size(max(tp_bytes))} per GPU per "
                     f"step on the busiest rank")
    if reshard:
        lines.append(f"FSDP2 resharded per microbatch: weights and grads / dp {dp} plus one gathered "
                     f"layer and stage root; all-gather + reduce-scatter {size(max(fsdp_now))} per GPU per "
                     f"step on the busiest rank (once per step: {size(max(fsdp_once))})")
    return lines
