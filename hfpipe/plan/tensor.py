"""What tensor parallelism (``--tp N``) and FSDP resharding per microbatch cost each rank, for ``hfpipe plan``.

**Tensor parallelism** splits every matrix of a decoder layer (q/k/v/o, gate/up/down, each
expert's matrices) over ``tp`` ranks, and the embedding and head by vocabulary rows; the norms and
a MoE router stay whole on every rank (:func:`hfpipe.plan.cost._replicated` counts them). A rank's
weights, gradients and optimizer state then scale by the share of parameters it keeps:
``(params - whole) / tp + whole``. Under ``--ep`` the routed experts are not split: each tp rank holds
its ep shard whole (:mod:`hfpipe.plan.experts` prices them; :func:`price_ranks` leaves them as priced).

Activations follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models"): of a GPT block's ``34 * h`` bytes per token, tensor parallelism alone divides ``24 * h``
(what sits between the split matmuls) and leaves ``10 * h`` whole (the norms' and residuals' inputs
and the dropout masks, replicated on every rank); sequence parallelism splits those over the
sequence too, so everything divides by tp. hfpipe measures each layer's bytes
(:mod:`hfpipe.plan.activations`) and splits them in that ratio. A layer's input kept under
activation checkpointing is a residual: whole without sequence parallelism, ``1 / tp`` with it. The
head's logits are vocabulary-parallel (``1 / tp``).

Collectives per microbatch, as hfpipe's plan runs them (counted at torch's dispatcher by
``bench/tp.py``, measured / planned 1.00 on a dense Llama). In units of one all-reduce of the
microbatch's hidden states (a ring moves ``2 * (tp - 1) / tp * size`` per rank; an all-gather or a
reduce-scatter half of it):

- a decoder layer: 2 in forward (after attention and after the MLP: all-reduces, or under sequence
  parallelism an all-gather before and a reduce-scatter after each); in backward, one all-reduce for
  *each* column-split projection that reads the layer's hidden states (q, k, v, gate, up: 5 on a
  dense Llama-type layer), because every ``ColwiseParallel`` sums its own input gradient, and under
  sequence parallelism 1 more (the all-gathers of the two reduce-scatters' gradients). Megatron sums
  one gradient per block instead (2 in all): hfpipe's backward moves more, and this prices what it moves.
  A recomputed layer runs its forward pair once more.
- the first stage's vocabulary-parallel embedding: 1 (an all-reduce, or a reduce-scatter and its
  backward all-gather); under sequence parallelism each stage gathers its last layer's output (1/2)
  and a later stage's first layer takes its gradient gathered (1/2); the head's column split sums its
  input gradient (1); the vocabulary-parallel loss all-reduces 3 fp32 values per token.

MoE and MLA layers run other collectives (the experts' summed outputs, MLA's narrower latents): they are
priced as a dense layer, approximately.

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
from hfpipe.plan.memory import ACT_BYTES, fsdp_bytes

__all__ = ["check_tp", "describe", "fsdp_traffic", "gathered_unit", "layer_bytes", "price_ranks",
           "tp_traffic"]

#: Korthikanti et al.'s 34 h bytes per token of a block, of which tensor parallelism alone splits 24 h.
_SPLIT_BY_TP = 24 / 34


def check_tp(config, tp: int, *, dp: int = 1, reshard: bool = False, lora: bool = False) -> None:
    """Refuse what the planner cannot price. What a run cannot do (tp over the heads and sizes, resharding
    with nothing to shard) is :func:`hfpipe.parallel.rules.check_layout`'s, which ``plan_report`` calls too."""
    if reshard and lora:
        raise PlanError("--reshard-per-microbatch prices full fine-tuning; a LoRA run keeps its frozen "
                        "base as FSDP2 holds it per step: leave it out with --lora-rank")


def layer_bytes(per_layer: tuple[int, ...], tp: int, sp: bool) -> tuple[int, ...]:
    """Each layer's activation bytes per token on one tensor-parallel rank (module docstring)."""
    if tp == 1:
        return tuple(per_layer)
    share = 1 / tp if sp else _SPLIT_BY_TP / tp + (1 - _SPLIT_BY_TP)
    return tuple(int(b * share) for b in per_layer)


def price_ranks(ranks, plan, costs, tp: int, kept=None) -> tuple:
    """``ranks`` with weights, gradients, optimizer state and dequantized weights cut to the share
    of parameters one tensor-parallel rank keeps (the norms and routers stay whole). ``kept``: per rank,
    the (params, weight, grad, optimizer bytes) tp does not split, already priced (the routed experts
    under ep, :func:`hfpipe.plan.experts.whole_over_tp`)."""
    if tp == 1:
        return tuple(ranks)
    out = []
    for r, (n, w, g, o) in zip(ranks, kept or [(0, 0, 0, 0)] * len(ranks)):
        rest = r.params - n
        whole = _replicated_on(plan, r.rank, costs)
        params = (rest - whole) // tp + whole
        share = params / max(1, rest)
        out.append(dataclasses.replace(
            r, params=params + n, weight_bytes=int((r.weight_bytes - w) * share + w),
            grad_bytes=int((r.grad_bytes - g) * share + g), optimizer_bytes=int((r.optimizer_bytes - o) * share + o),
            transient_bytes=int(r.transient_bytes * share)))
    return tuple(out)


def _replicated_on(plan, rank: int, costs) -> int:
    rep = costs.layer_replicated_params
    return sum((rep[i] if rep else 0) for s in plan.stages_of_rank(rank) for i in s.layers) + sum(
        costs.head_replicated_params for s in plan.stages_of_rank(rank) if s.head)


def _held(costs, layer: int, tp: int, ep: int) -> tuple[float, float]:
    """(params FSDP shards over dp, routed-expert params it shards over dp / ep, x tp) of one layer on a
    rank. Under ep the experts are whole on each tp rank; without it tp splits them."""
    routed = costs.layer_routed_params[layer] if costs.layer_routed_params else 0
    whole = costs.layer_replicated_params[layer] if costs.layer_replicated_params else 0
    other = costs.layer_params[layer] - routed
    return (other - whole) / tp + whole, routed / ep / (1 if ep > 1 else tp)


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


def tp_traffic(plan, costs, hidden: int, tp: int, microbatches: int, tokens: int, dtype: str,
               ac: str, *, sequence_parallel: bool = True, readers: int = 5) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU moves in tensor-parallel collectives per schedule step.

    Args:
        hidden: Elements per token of the hidden states between layers (``h``; ``hc * h`` for streams).
        sequence_parallel: Whether the run splits activations by sequence (the runtime's default).
        readers: Column-split projections per layer that read its hidden states (module docstring).
    """
    if tp == 1:
        return (0,) * plan.pp
    one = 2 * (tp - 1) / tp * tokens * hidden * ACT_BYTES[dtype]  # one all-reduce (or AG + RS)
    loss = 3 * 2 * (tp - 1) / tp * tokens * 4  # max, sum of exp and the target logit, fp32 per token
    step = {"none": 0, "full": 1, "selective": 2}[ac]
    layer = 2 + readers + (1 if sequence_parallel else 0)
    out = []
    for rank in range(plan.pp):
        calls, extra = 0.0, 0.0
        for stage in plan.stages_of_rank(rank):
            recomputed = sum(1 for j, _ in enumerate(stage.layers) if j % step == 0) if step else 0
            calls += layer * len(stage.layers) + 2 * recomputed + stage.embed + stage.head
            if sequence_parallel and stage.layers:  # the gather after the last layer, the scatter before the first
                calls += 0.5 + (0 if stage.embed else 0.5)
            extra += loss if stage.head else 0
        out.append(int((calls * one + extra) * microbatches))
    return tuple(out)


def fsdp_traffic(plan, costs, dtype: str, dp: int, ep: int, tp: int, microbatches: int,
                 reshard: bool) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU moves in FSDP2's all-gathers and reduce-scatters per step."""
    if dp == 1:
        return (0,) * plan.pp
    _, compute, grad, _ = fsdp_bytes(dtype)
    rounds, gathers = (microbatches, 2) if reshard else (1, 1)
    edp = dp // ep * (tp if ep > 1 else 1)  # the ranks holding one expert (hfpipe.plan.experts.replicas)
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
             ep: int = 1) -> list[str]:
    """The lines ``hfpipe plan`` prints about tensor parallelism and FSDP's resharding."""
    lines = []
    if tp > 1:
        how = ("sequence parallel: activations / tp" if sp else
               "no sequence parallelism: norms' and residuals' activations whole")
        which = "every matrix but the routed experts'" if ep > 1 else "every matrix"
        lines.append(f"tensor parallel: tp {tp}, {which}, the embedding and the head split {tp} ways "
                     f"(norms and routers whole; rank params count the share); {how}; all-reduce "
                     f"{'(all-gather + reduce-scatter) ' if sp else ''}{size(max(tp_bytes))} per GPU per "
                     f"step on the busiest rank")
    if reshard:
        lines.append(f"FSDP2 resharded per microbatch: weights and grads / dp {dp} plus one gathered "
                     f"layer and stage root; all-gather + reduce-scatter {size(max(fsdp_now))} per GPU per "
                     f"step on the busiest rank (once per step: {size(max(fsdp_once))})")
    return lines
