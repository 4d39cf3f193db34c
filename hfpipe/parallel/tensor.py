"""Tensor parallelism (``--tp``) on a stage: apply a plan, the vocab-parallel loss, a rank's slices.

:func:`apply_tp` runs torch's ``parallelize_module`` with a plan from
:func:`hfpipe.parallel.tensor_plan.stage_tp_plan` on a stage module, meta or materialised; afterwards
the split parameters are DTensors on the tp mesh and the stage still takes and returns plain, whole
tensors. Attention needs no change: transformers' attention reshapes its projections with ``-1``
heads (``view(*input_shape, -1, head_dim)``), so it runs on the heads its rank holds.

The head's logits stay split over the vocabulary; :func:`vocab_parallel_loss_sum` takes the cross
entropy on them without gathering (B, T, V). :func:`shard_ranges`, :func:`local_slice` and
:func:`as_dtensor` let a loader read only its rank's bytes and wrap them as the parameter's DTensor
(``parallelize_module``'s own ``distribute_tensor`` needs the whole tensor on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from hfpipe.parallel.tensor_plan import TensorParallelError

__all__ = ["apply_tp", "as_dtensor", "local_slice", "param_layouts", "shard_ranges", "vocab_parallel_loss_sum"]


def apply_tp(stage: nn.Module, tp_mesh, plan: dict) -> nn.Module:
    """Split ``stage`` over the 1-D ``tp_mesh`` by ``plan``, in place; returns ``stage``.

    On a meta stage no data moves (each rank takes its own part, ``src_data_rank=None``): the loader
    then fills each DTensor's local tensor (:func:`shard_ranges`). On a materialised stage every
    rank must hold the same whole weights. Weights tied inside the stage stay tied.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp takes the 1-D tp mesh, got a {tp_mesh.ndim}-D mesh")
    tied = _tied_names(stage)
    parallelize_module(stage, tp_mesh, plan, src_data_rank=None)
    for keep, alias in tied:
        param = stage.get_parameter(keep)
        other = stage.get_parameter(alias)
        if isinstance(param, DTensor) != isinstance(other, DTensor) or (
                isinstance(param, DTensor) and param.placements != other.placements):
            raise TensorParallelError(f"--tp: tied weights {keep} and {alias} are split differently")
        owner, _, leaf = alias.rpartition(".")
        setattr(stage.get_submodule(owner), leaf, param)
    stage.register_forward_hook(_plain_outputs)
    return stage


def _tied_names(module: nn.Module) -> list[tuple[str, str]]:
    """(first name, other name) of every parameter registered under two names."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], name))
        else:
            first[id(p)] = name
    return pairs


def _plain_outputs(_module, _args, out):
    """Whole plain tensors out of a stage: DTensors never cross a pipeline boundary.

    The plan already gathers after a stage's last layer; this also covers an edge stage with no
    layers and the head's vocabulary-split logits when a stage returns them (evaluation).
    """
    if isinstance(out, tuple):
        return tuple(_whole(o) for o in out)
    return _whole(out)


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def param_layouts(stage: nn.Module) -> dict[str, tuple[Placement, tuple[int, ...]]]:
    """Name -> (placement on the tp mesh, whole shape) of every tp-split parameter of ``stage``."""
    return {name: (p.placements[0], tuple(p.shape)) for name, p in stage.named_parameters()
            if isinstance(p, DTensor)}


def shard_ranges(shape, placement: Placement, tp_rank: int, tp_size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Which part of a whole tensor of ``shape`` rank ``tp_rank`` holds: ``(dim, [(start, stop), ...])``.

    The local tensor is the ranges along ``dim`` concatenated in order (one range for ``Shard``;
    one per packed block for ``_StridedShard``, e.g. the gate and the up half of ``gate_up_proj``).
    ``None`` for a replicated tensor (the whole of it). Sizes split as ``torch.chunk`` does.
    """
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, (Shard, _StridedShard)):
        raise ValueError(f"no local slice for placement {placement}")
    dim = placement.dim % len(shape)
    blocks = placement.split_factor if isinstance(placement, _StridedShard) else 1
    if shape[dim] % blocks:
        raise ValueError(f"dim {dim} of {tuple(shape)} is not {blocks} packed blocks")
    block = shape[dim] // blocks
    part = -(-block // tp_size)  # ceil, as torch.chunk
    lo, hi = min(tp_rank * part, block), min((tp_rank + 1) * part, block)
    return dim, [(b * block + lo, b * block + hi) for b in range(blocks)]


def local_slice(full: torch.Tensor, placement: Placement, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s local tensor of ``full`` (what ``DTensor.to_local()`` holds there)."""
    where = shard_ranges(full.shape, placement, tp_rank, tp_size)
    if where is None:
        return full
    dim, ranges = where
    parts = [full.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def as_dtensor(local: torch.Tensor, tp_mesh, placement: Placement, shape) -> DTensor:
    """Wrap this rank's ``local`` part of a whole tensor of ``shape`` as a DTensor, without communication."""
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, tp_mesh, [placement], run_check=False, shape=shape, stride=stride)


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(logits, targets, reduction="sum")`` on vocabulary-split logits, never gathered.

    Args:
        logits: (..., V) as the tp head returns them: a DTensor sharded on its last dim (a plain
            tensor is taken as whole logits).
        targets: (...) token ids, ``ignore_index`` where no loss is taken.

    Returns:
        A float32 scalar, the same on every tp rank: the summed (not averaged) loss, so the
        pipeline's division by the global token count stays as it is. Each rank's gradient goes
        to its own slice of the logits.
    """
    targets = targets.flatten().to(logits.device)
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.float().flatten(0, -2), targets, ignore_index=ignore_index, reduction="sum")
    (placement,) = logits.placements
    if not isinstance(placement, Shard) or placement.dim % logits.ndim != logits.ndim - 1:
        raise ValueError(f"vocab-parallel loss needs logits split on the vocabulary, got {placement}")
    mesh = logits.device_mesh
    local = logits.to_local().float().flatten(0, -2)  # (N, V/tp)
    start = shard_ranges(logits.shape, placement, mesh.get_local_rank(), mesh.size())[1][0][0]
    return _VocabParallelCrossEntropy.apply(local, targets, start, ignore_index, mesh.get_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy: max and sum of exp all-reduced over tp, the target
    logit taken on the rank that holds it; the backward is local (softmax - one-hot, on this slice)."""

    @staticmethod
    def forward(ctx, local, targets, start, ignore_index, group):
        valid = targets != ignore_index
        idx = targets - start
        mine = valid & (idx >= 0) & (idx < local.shape[-1])
        idx = torch.where(mine, idx, torch.zeros_like(idx))
        top = local.detach().amax(-1) if local.shape[0] else local.new_zeros(0)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = local - top.unsqueeze(-1)  # (N, V/tp), <= 0: exp cannot overflow
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        picked = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(total))
        dist.all_reduce(picked, group=group)
        loss = torch.where(valid, total.log() - picked, torch.zeros_like(total)).sum()
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        out.mul_(valid.to(out.dtype).unsqueeze(-1) * grad)
        return out, None, None, None, None
