"""Bytes a rank moves in collectives, counted at torch's dispatcher, by the group they run over.

A ``TorchDispatchMode`` sees every collective a step issues: DTensor's redistributions (the functional
collectives ``_c10d_functional.*``, which carry their group's name), and the ``c10d`` ops behind
``dist.all_reduce`` and FSDP2's all-gathers and reduce-scatters (which carry the process group), in
forward and in backward. Each is priced as a ring moves it, the model ``hfpipe.plan.tensor`` prices
with: an all-reduce of ``S`` bytes ``2 (n - 1) / n * S`` per rank, an all-gather ``(n - 1) / n`` of
its output, a reduce-scatter ``(n - 1) / n`` of its input. torch's own ``CommDebugMode`` counts the same
ops but only how often, not their bytes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommBytes"]

_F = torch.ops._c10d_functional
_C = torch.ops.c10d


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _functional(func, args) -> tuple[str, str, int] | None:
    """(kind, group name, bytes as a ring moves them per rank), or None for another op."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if func is _F.all_reduce.default:
        n = _resolve_process_group(args[2]).size()
        return "all_reduce", args[2], 2 * (n - 1) * _nbytes(args[0]) // n
    if func is _F.all_gather_into_tensor.default:  # (input, group_size, group_name)
        return "all_gather", args[2], (args[1] - 1) * _nbytes(args[0])
    if func is _F.reduce_scatter_tensor.default:  # (input, reduce_op, group_size, group_name)
        return "reduce_scatter", args[3], (args[2] - 1) * _nbytes(args[0]) // args[2]
    return None


def _c10d(func, args) -> tuple[str, str, int] | None:
    from torch.distributed import ProcessGroup

    if func is _C.allreduce_.default:  # (tensors, group, ...)
        g = ProcessGroup.unbox(args[1])  # the dispatcher hands the group over as a TorchScript object
        return "all_reduce", g.group_name, 2 * (g.size() - 1) * _nbytes(args[0]) // g.size()
    if func is _C._allgather_base_.default:  # (output, input, group, ...)
        g = ProcessGroup.unbox(args[2])
        return "all_gather", g.group_name, (g.size() - 1) * _nbytes(args[0]) // g.size()
    if func is _C._reduce_scatter_base_.default:  # (output, input, group, ...)
        g = ProcessGroup.unbox(args[2])
        return "reduce_scatter", g.group_name, (g.size() - 1) * _nbytes(args[1]) // g.size()
    if func is _C.broadcast_.default:  # (tensors, group, ...): the pipeline's loss, a scalar
        return "broadcast", ProcessGroup.unbox(args[1]).group_name, _nbytes(args[0])
    return None


_WATCHED = ("_c10d_functional", "c10d")


class CommBytes(TorchDispatchMode):
    """Count ``bytes[(group label, kind)]`` while active; ``labels`` maps group names to labels."""

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        self.labels = labels
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.unpriced: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _WATCHED:
            seen = _functional(func, args) if func.namespace == "_c10d_functional" else _c10d(func, args)
            if seen is not None:
                kind, group, moved = seen
                self.bytes[self.labels.get(group, "other"), kind] += moved
            elif not func.name().endswith(("wait_tensor", "_wrap_tensor_autograd", "barrier")):
                self.unpriced.add(func.name())  # a collective this counter does not price: said, not hidden
        return func(*args, **(kwargs or {}))

    def total(self, label: str) -> int:
        return sum(b for (lab, _), b in self.bytes.items() if lab == label)
