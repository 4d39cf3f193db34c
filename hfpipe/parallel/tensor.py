"""Tensor parallelism (``--tp``) on a stage: apply a plan, the vocab-parallel loss, a rank's slices.

:func:`apply_tp` runs torch's ``parallelize_module`` with each stage's plan from
:func:`hfpipe.parallel.tensor_plan.stage_tp_plan` on the stage modules, meta or materialised; afterwards
the split parameters are DTensors on the tp mesh and each stage still takes and returns plain, whole
tensors. Attention needs no change: transformers' attention reshapes its projections with ``-1``
heads (``view(*input_shape, -1, head_dim)``), so it runs on the heads its rank holds.

The head's logits stay split over the vocabulary; :func:`hfpipe.loss.vocab_parallel.vocab_parallel_loss_sum`
takes the cross entropy on them without gathering (B, T, V). :func:`shard_ranges`, :func:`local_slice` and
:func:`as_dtensor` (in :mod:`hfpipe.parallel.tensor_slices`, a floor below) let a loader read only
its rank's bytes and wrap them as the parameter's DTensor (``parallelize_module``'s own
``distribute_tensor`` needs the whole tensor on every rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import parallelize_module

from hfpipe.parallel.tensor_plan import TensorParallelError, stage_tp_plan

__all__ = ["apply_tp", "param_layouts"]


def apply_tp(modules: list[nn.Module], tp_mesh, *, sequence_parallel: bool = True, experts_whole: bool = False,
             restyle=None) -> None:
    """Split every matrix of each stage in ``modules`` over the 1-D ``tp_mesh``, in place, by its plan.

    On meta stages no data moves (each rank takes its own part, ``src_data_rank=None``): the loader
    then fills each DTensor's local tensor (:func:`shard_ranges`). On materialised stages every
    rank must hold the same whole weights. Weights tied inside a stage stay tied.

    Args:
        modules: This rank's stage modules.
        tp_mesh: The tp mesh.
        sequence_parallel: Also split the norms and the activations between layers by sequence.
        experts_whole: Leave the routed experts whole (``--ep`` shards them next, whole on each tp rank).
        restyle: ``(stage, plan) -> plan`` for a storage that splits by its own styles:
            :func:`hfpipe.quant.tensor.fp8_tp_plan` for an FP8 base, handed in by the builder since
            ``quant/`` stands on this package.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp takes the 1-D tp mesh, got a {tp_mesh.ndim}-D mesh")
    for stage in modules:
        names = [n for n, _ in stage.named_modules()]
        plan = stage_tp_plan(stage.config, names, sequence_parallel, tp_mesh.size(), experts_whole)
        _split_stage(stage, tp_mesh, restyle(stage, plan) if restyle else plan)


def _split_stage(stage: nn.Module, tp_mesh, plan: dict) -> None:
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
