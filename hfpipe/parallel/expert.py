"""Expert parallelism: each MoE layer's routed experts sharded over ``ep`` ranks of the dp group.

The pieces are transformers' own (``transformers.distributed.expert_parallel``): the config's
``base_model_ep_plan`` names the experts modules and their 3-D parameters; ``MoEParamShard`` makes each
parameter a DTensor ``Shard(0)`` on the ep mesh, so its *global* shape stays ``[E, ...]`` under the full
model's name (DCP checkpoints reshard to any other ep, dp or pp, and export sees whole tensors); and
``AllToAllEP`` sends every (token, expert) pair to the expert's rank with ``all_to_all_single`` (uneven
split sizes, differentiable through both exchanges) and brings the outputs back, weighted and summed in
the sender's top-k order.

Where hfpipe differs from ``transformers.distributed``, and why:

- transformers applies the plan to a whole model and derives its meshes from a ``DistributedConfig``.
  A pipeline stage holds only some layers, so the plan is expanded to the stage's own parameter names,
  and the meshes are hfpipe's expert view of its world (:mod:`hfpipe.parallel.dims`): an ep group is
  ``ep`` consecutive dp ranks at one pipeline rank, and the ``dp / ep`` ranks holding the same experts
  form the "edp" group.
- FSDP2 (:func:`shard_moe_layer`) wraps attention and the MoE block as separate units and the experts as a
  unit of their own over the ranks that hold them and see other tokens: edp, x cp under --cp, x tp under
  --tp. Their gradients are summed over it and divided by dp (x cp), as the dense parameters' are averaged
  over dp (x cp).

With ``--tp`` the routed experts are *not* split over tp (Megatron's expert tensor parallelism 1): each tp rank
holds its ep shard of whole experts (the tp plan leaves them out, :func:`hfpipe.parallel.tensor_plan.stage_tp_plan`).
``AllToAllEP`` is given the tp mesh: the ranks of a tp group share one batch, each dispatches a disjoint slice
of its tokens over ep, and the outputs are all-gathered back over tp, so no token is computed twice. Hence the
experts' gradient sum over tp above. The router runs whole on every tp rank, and the all-gather's backward
hands each the whole routing-weight gradient: its gradient is whole and equal on every tp rank, as
one-process transformers has it (tests/parallel/test_parallel_tensor_expert.py checks both against it).
"""

from __future__ import annotations

import logging
import re

from torch import nn

__all__ = ["apply_ep", "shard_moe_layer", "experts_of", "local_rows", "stage_ep_plan"]

log = logging.getLogger(__name__)


def _plan_patterns(config) -> list[tuple[re.Pattern, str]]:
    """``base_model_ep_plan`` as regexes over a stage's names (``model.layers.<i>.…``), in plan order."""
    out = []
    for key, style in config.base_model_ep_plan.items():
        regex = re.escape("model." + key).replace(r"\*", r"\d+")
        out.append((re.compile(f"^{regex}$"), style))
    return out


def apply_ep(modules, expert_mesh) -> int:
    """Shard the routed experts of meta-device stage ``modules`` over the ep dimension of ``expert_mesh``
    (:meth:`hfpipe.parallel.mesh.Dist.expert_mesh`), before loading.

    Runs transformers' own ``apply_expert_parallelism`` with the plan expanded to each stage's names:
    parameters first (which sets each experts module's local ``num_experts``), then the dispatch. Returns
    the number of experts modules sharded on this rank.
    """
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    count = 0
    for stage in modules:
        plan = stage_ep_plan(stage)
        count += sum(1 for s in plan.values() if s == "ep_dispatch_experts")
        # tp: the ranks that share a batch; each dispatches its slice of the tokens (size 1 without --tp)
        apply_expert_parallelism(stage, expert_mesh["ep"], expert_mesh["tp"], plan, ep_implementation="all_to_all")
    return count


def stage_ep_plan(stage: nn.Module) -> dict[str, str]:
    """The config's ``base_model_ep_plan`` expanded to ``stage``'s parameter and module names, in plan order (the
    parameters before their module): name -> style (``ep_dispatch_experts`` names the experts modules)."""
    names = [n for n, _ in stage.named_parameters()] + [n for n, _ in stage.named_modules()]
    plan = {}
    for regex, style in _plan_patterns(stage.config):
        plan.update({n: style for n in names if regex.match(n)})
    return plan


def experts_of(layer: nn.Module) -> list[nn.Module]:
    """The expert-parallel experts modules inside ``layer`` (empty for a dense layer)."""
    return [m for m in layer.modules() if getattr(m, "_is_expert_parallel", False)]


def shard_moe_layer(layer: nn.Module, fsdp_mesh, replica_mesh, mp, divide_factor: int) -> None:
    """FSDP2 for one decoder layer with sharded experts (called before the layer's own ``fully_shard``).

    The experts are a unit over ``replica_mesh`` (edp, x cp under --cp: the cp ranks route other tokens of
    the same rows through the same experts; x tp under --tp: each tp rank routes its slice of the tokens).
    Attention and the MoE block are units of their own over dp: then the layer's reduce-scatters never fire
    between the MoE block's two backward all-to-alls, which deadlocks when ranks of one ep group wait in
    different collectives. The experts shard on dim 1 (or the first later dim the replicas divide): dim 0
    is already split over ep, and a second split of it would need a strided placement. ``divide_factor`` is
    what the dense gradients are averaged over (:attr:`hfpipe.parallel.dims.ParallelDims.grad_divide_factor`).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    edp_mesh = replica_mesh  # Dist.expert_replica_mesh: edp, or edp x cp or edp x tp flattened
    edp = edp_mesh.size()
    for experts in experts_of(layer):
        if not _has_params(experts):
            continue  # FP8 stacks (--quantize-base fp8) are buffers: frozen, kept whole on their ranks
        fully_shard(experts, mesh=edp_mesh, mp_policy=mp, reshard_after_forward=False,
                    shard_placement_fn=lambda p: Shard(_fsdp_dim(p, edp)))
        # Summed over edp, divided by dp: the experts' share of the dp-averaged gradient. gloo has no
        # pre-multiplied sum, so with edp > 1 FSDP must sum and divide after. Not with edp == 1: torch
        # 2.13 then divides twice (once copying the unreduced gradient, once after), and without
        # force-sum it divides once and never issues the (absent) collective.
        experts.set_gradient_divide_factor(float(divide_factor))
        if edp > 1:
            experts.set_force_sum_reduction_for_comms(True)
    for name, child in layer.named_children():
        if experts_of(child) or ("attn" in name and _has_params(child)):
            fully_shard(child, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=False)


def _fsdp_dim(param, edp: int) -> int:
    """The dim FSDP shards an expert parameter on: FSDP2 shards dims other than 0 only evenly."""
    return next((d for d in range(1, param.dim()) if param.shape[d] % edp == 0), 0)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def local_rows(param) -> tuple[int, int] | None:
    """The rows ``[lo, hi)`` of dim 0 a DTensor parameter holds on this rank (``None``: a plain tensor, or a
    split that is not one run of rows)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return None
    if not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in param.placements):
        return None  # a column split or packed blocks: not one run of rows (the loader reads the whole)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]
