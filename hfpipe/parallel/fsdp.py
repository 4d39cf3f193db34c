"""FSDP2 over the data-parallel ranks of a pipeline (``--dp``, and ``--cp``'s ranks of one replica).

Each decoder layer is a unit, then the stage; with sharded experts a MoE layer's experts, attention
and MoE block are units of their own first (:func:`hfpipe.parallel.expert.shard_moe_layer`). FSDP2
also carries bf16-mixed: fp32 sharded masters (and so fp32 optimizer state), bf16 compute, fp32
gradient reduction (fp64 for an fp64 run). At one replica bf16-mixed runs without FSDP2, with the same
numerics (:mod:`hfpipe.parallel.one_replica`).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hfpipe.parallel.expert import experts_of, shard_moe_layer
from hfpipe.parallel.one_replica import apply_one_replica

__all__ = ["apply_fsdp"]

#: bf16-mixed at one replica through FSDP2 (its one-rank path) instead of :mod:`hfpipe.parallel.one_replica`:
#: the oracle tests compare the two (tests/parallel/test_parallel_one_replica.py); no option reaches it.
_FSDP2_AT_ONE_REPLICA = False


def apply_fsdp(modules: list, dist, *, param_dtype: torch.dtype, compute_dtype: torch.dtype,
               reshard_per_microbatch: bool = False) -> None:
    """FSDP2 over ``dist``'s fsdp mesh: each decoder layer, then the stage (and bf16-mixed's casts).

    No reshard after forward: under pipelining a stage runs forward for several microbatches before
    their backward; unless ``reshard_per_microbatch``, which trades an all-gather per microbatch for
    weights divided by dp. Nothing to do with one replica and one dtype; one replica and bf16-mixed:
    :func:`~hfpipe.parallel.one_replica.apply_one_replica`.
    """
    dims = dist.dims
    if dims.grad_divide_factor == 1 and compute_dtype == param_dtype:
        return
    if dims.grad_divide_factor == 1 and not _FSDP2_AT_ONE_REPLICA:
        # bf16-mixed at one replica (no ep either: ep ranks are carved out of dp): FSDP2's numerics without
        # its one-rank copies
        apply_one_replica(modules, compute_dtype, lambda m: _left_out_on_one_rank(m, 1, compute_dtype))
        return
    mesh, again = dist.fsdp_mesh, reshard_per_microbatch
    # Gradients reduce in fp32 (bf16-mixed's and bf16's), or in fp64 for an fp64 run: an fp32 reduction
    # there would round every cp/dp-summed gradient to fp32 (1e-7 off where fp64 is exact to 1e-15).
    reduce = torch.promote_types(param_dtype, torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce)
    # A stage's float inputs are hidden states, already in the compute dtype, and the fp32 router
    # sums of MoE aux losses (hfpipe.models.router_loss), which must stay fp32: bf16 counts
    # tokens exactly only up to 256.
    stage_mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce, cast_forward_inputs=False)
    for m in modules:
        for layer in m.model.layers.values():
            if dims.ep > 1 and experts_of(layer):
                shard_moe_layer(layer, mesh, dist.expert_replica_mesh(), mp, dims.grad_divide_factor)
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=again,
                        ignored_params=_left_out_on_one_rank(layer, dims.grad_divide_factor, compute_dtype))
        fully_shard(m, mesh=mesh, mp_policy=stage_mp, reshard_after_forward=again,
                    ignored_params=_left_out_on_one_rank(m, dims.grad_divide_factor, compute_dtype))


def _left_out_on_one_rank(module, ranks: int, compute_dtype: torch.dtype) -> set | None:
    """Frozen parameters FSDP2 has nothing to do for when its mesh is one rank (bf16-mixed at ``--dp 1``, which
    :mod:`hfpipe.parallel.one_replica` also leaves as they are; FSDP2 there only under the oracle switch above):

    - those already in the compute dtype (a LoRA run's base, :func:`hfpipe.pipeline.build`): FSDP2's one-rank
      shortcut would copy every one of them at every step (a 16 GB copy per step for an 8B base; measured on
      an H200, its copies of weights and gradients are ~15% of a bf16-mixed step), to the same values;
    - those whose tensor class gathers itself (``fsdp_pre_all_gather``: torchao's NF4 base): torch 2.13's
      shortcut takes one tensor per parameter, where such a class hands several (``ValueError: not enough
      values to unpack``); left out, the base dequantizes to the compute dtype of its input as without FSDP2.
    """
    if ranks != 1:
        return None
    return {p for p in module.parameters() if not p.requires_grad
            and (hasattr(p, "fsdp_pre_all_gather") or p.dtype == compute_dtype)} or None
