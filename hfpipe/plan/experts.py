"""What expert parallelism (``--ep N``) costs each pipeline rank, for ``hfpipe plan``.

Each MoE layer's routed experts are sharded over ``ep`` ranks of the data-parallel group (ep
divides dp): a rank holds ``E / ep`` of the ``E`` routed experts of each of its MoE layers.
Everything else (attention, norms, the router, shared experts, dense layers, embedding, head) is
replicated over the group and FSDP2-sharded over all ``dp`` ranks, as without ep. The experts a
rank holds are FSDP2-sharded over the ``dp / ep`` ranks that hold the same experts (the expert
helper's design, as in NeMo AutoModel and DeepSpeed-MoE: an (edp, ep) mesh over the dp ranks); at
``ep == dp`` they are not sharded further. So per expert parameter a rank keeps
:func:`~hfpipe.plan.memory.param_bytes` at ``dp / ep`` instead of ``dp``, on ``1 / ep`` of them.
With ``--tp`` the experts are not split over tp: each tp rank holds its ``E / ep`` experts whole and
dispatches ``1 / tp`` of the tokens its tp group shares, so the experts are FSDP2-sharded over
``dp / ep * tp`` ranks and the all-to-alls move ``1 / tp`` of the bytes (:mod:`hfpipe.parallel.expert`).

Tokens reach their experts by all-to-all and come back the same way. Per MoE layer and microbatch,
each rank sends (and receives) ``tokens * top_k * hidden * bytes * (ep - 1) / ep`` in each of four
all-to-alls: dispatch and combine, in forward and again (their gradients) in backward. A layer that
activation checkpointing recomputes runs its forward pair once more in backward (``full``: every
layer; ``selective``: every other layer). Activations per token are the measured layer's
(:mod:`hfpipe.plan.activations`), run through the all-to-all dispatch as the run reaches its experts
(:mod:`hfpipe.plan.dispatch`): on average a rank's experts receive as many token copies as without ep
(``tokens * top_k``), only from every rank of the group.
"""

from __future__ import annotations

import dataclasses

from hfpipe.models.moe import routed_experts
from hfpipe.plan.memory import ACT_BYTES, param_bytes

__all__ = ["all_to_all_bytes", "describe_ep", "price_ranks", "replicas"]

def price_ranks(ranks, plan, costs, dtype: str, dp: int, ep: int, reshard: bool = False, tp: int = 1) -> tuple:
    """``ranks`` (full-run :class:`~hfpipe.plan.report.RankReport`) with each rank's experts cut to
    ``1 / ep`` and priced as FSDP2 shards over ``dp / ep * tp`` (the module docstring); ``reshard``: FSDP2
    reshards every microbatch (:func:`hfpipe.plan.memory.param_bytes`)."""
    if ep == 1:
        return tuple(ranks)
    out = []
    for r in ranks:
        routed = _routed_on(plan, r.rank, costs)
        other, held = r.params - routed, routed // ep
        w, g, o = (a * other + b * held for a, b in zip(param_bytes(dtype, dp, reshard),
                                                          param_bytes(dtype, replicas(dp, ep, tp), reshard)))
        out.append(dataclasses.replace(r, params=other + held, weight_bytes=int(w), grad_bytes=int(g),
                                       optimizer_bytes=int(o)))
    return tuple(out)


def replicas(dp: int, ep: int, tp: int = 1) -> int:
    """The ranks holding one routed expert (or, without ep, one tp rank's split of it), which FSDP2 shards it
    over: ``dp / ep``, times ``tp`` under ep, where the experts stay whole on each tp rank."""
    return dp // ep * (tp if ep > 1 else 1)


def expert_params_held(plan, rank: int, costs, ep: int) -> tuple[int, int]:
    """(routed-expert parameters a pipeline rank's layers have, the share it holds at ``ep``)."""
    routed = _routed_on(plan, rank, costs)
    return routed, routed // ep


def _routed_on(plan, rank: int, costs) -> int:
    if not costs.layer_routed_params:
        return 0
    return sum(costs.layer_routed_params[i] for s in plan.stages_of_rank(rank) for i in s.layers)


def all_to_all_bytes(plan, costs, config, ep: int, microbatches: int, tokens: int, dtype: str,
                     ac: str, tp: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the bytes one GPU sends in all-to-alls per schedule step (and receives); a tp
    rank dispatches ``1 / tp`` of its replica's ``tokens``."""
    if ep == 1:
        return (0,) * plan.pp
    _, top_k = routed_experts(config)
    one = tokens / tp * top_k * config.hidden_size * ACT_BYTES[dtype] * (ep - 1) / ep  # one all-to-all
    step = max(1, {"none": 0, "full": 1, "selective": 2}[ac])
    out = []
    for rank in range(plan.pp):
        calls = 0
        for stage in plan.stages_of_rank(rank):
            moe = [i for i in stage.layers if costs.is_moe[i]]
            # dispatch + combine, forward and backward; a recomputed layer's forward pair again
            recomputed = sum(1 for j, i in enumerate(stage.layers) if costs.is_moe[i] and j % step == 0) \
                if ac != "none" else 0
            calls += 4 * len(moe) + 2 * recomputed
        out.append(int(calls * one * microbatches))
    return tuple(out)


def describe_ep(config, ep: int, dp: int, a2a: tuple[int, ...], size, dtype: str, frozen: bool = False,
                tp: int = 1) -> str:
    """The line ``hfpipe plan`` prints about the experts' sharding and their all-to-all traffic
    (``frozen``: a LoRA run's, whose experts have no gradients or optimizer state)."""
    count, top_k = routed_experts(config)
    edp = replicas(dp, ep, tp)
    w, g, o = (f"{b:g}" for b in param_bytes(dtype, edp))
    fsdp = f"FSDP2 over the {edp} ranks holding the same experts" if edp > 1 else "not sharded further"
    if tp > 1:
        fsdp = f"whole on each of the {tp} tp ranks, each dispatching its share of the tokens; " + fsdp
    cost = "frozen: weights only" if frozen else f"weights {w} B, grads {g} B, AdamW {o} B per expert parameter"
    return (f"experts: ep {ep}, {count // ep} of {count} routed experts per rank per MoE layer ({fsdp}; "
            f"{cost}; rank params count these); "
            f"shared experts and the rest FSDP2 over dp {dp}; all-to-all (top {top_k}, dispatch + "
            f"combine, forward + backward) {size(max(a2a))} per GPU per step on the busiest rank, "
            f"{size(sum(a2a) * dp * tp)} across all {dp * tp * len(a2a)} GPUs")
