"""bf16-mixed at one replica (``--dp 1 --cp 1``) without FSDP2: fp32 masters, bf16 compute copies.

FSDP2 on a one-rank mesh does what bf16-mixed needs, with copies nothing needs: it casts each master
into an all-gather input and copies that again into the unsharded parameter, and at the step's end
concatenates every gradient into one fp32 buffer and copies it again into the sharded gradient (torch
2.13, ``_fsdp_param_group.py`` and ``_fsdp_collectives.py``). This module keeps FSDP2's numerics and
lifecycle, one stage at a time, without those copies:

- the stage's first forward of a step registers, under every name a master had, a bf16 leaf parameter
  cast from it (one cast kernel): forward, activation checkpointing's recompute, the chunked head loss
  and split-backward schedules (which look the stage's parameters up) all see it until the step ends,
  as FSDP2's unsharded parameters under ``reshard_after_forward=False``;
- within one microbatch's backward a weight's gradient sums in bf16 on that leaf (autograd); after each
  microbatch's backward (full or input-only, where FSDP2's post-backward runs) it is upcast to fp32 and
  added into an fp32 sum (FSDP2's ``to_accumulated_grad_if_needed`` / ``accumulate_unsharded_grad_if_needed``);
- at the step's end (the schedule's ``perform_reduce_grad``) that sum becomes the master's ``.grad``, or is
  added into it (gradient accumulation over several ``train_step`` calls, as FSDP2 adds into the sharded
  gradient); the masters are registered again and the bf16 copies dropped.

Each decoder layer's float inputs are cast to the compute dtype first, as FSDP2's per-layer policy does.
The swap runs in the stage module's pre-forward hook, outside the layers ``--compile`` compiles in place:
they see a bf16 leaf of the same shape every step, so nothing recompiles. A weight-only backward (the
zero-bubble schedules' W) leaves its gradient in bf16 on the copy until the next backward's upcast, as FSDP2's.
The stage's pipeline class (:mod:`hfpipe.pipeline.accumulating_stage`) calls :meth:`OneReplicaMixed.post_backward`,
:meth:`~OneReplicaMixed.reshard` and :meth:`~OneReplicaMixed.discard` at the points FSDP2 is called.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["OneReplicaMixed", "apply_one_replica", "one_replica_of", "release"]

_ATTR = "_hfpipe_one_replica"


def apply_one_replica(modules: list, compute_dtype: torch.dtype, left_out) -> None:
    """bf16-mixed for each stage of ``modules`` (see the module docstring); ``left_out(module)``: the
    parameters that stay as they are (frozen, already in the compute dtype, or a self-gathering tensor class)."""
    for m in modules:
        for layer in m.model.layers.values():
            layer.register_forward_pre_hook(_input_caster(compute_dtype), with_kwargs=True)
        setattr(m, _ATTR, OneReplicaMixed(m, compute_dtype, left_out(m) or set()))


def one_replica_of(module: nn.Module) -> OneReplicaMixed | None:
    """The :class:`OneReplicaMixed` of a stage module, or ``None``."""
    return getattr(module, _ATTR, None)


def release(modules: list) -> None:
    """After a forward-only pass (evaluation, logits): the masters registered again, the copies dropped.

    Not at the stage's own post-forward: the chunked head loss runs the last stage's head after it, on the
    copies (FSDP2 keeps them gathered after a forward without backward too)."""
    for m in modules:
        if mixed := one_replica_of(m):
            mixed.discard()


def _settled(grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``grad`` on ``master``'s DTensor placements (a partial sum reduced); a plain tensor as it is."""
    placements = getattr(master, "placements", None)
    if placements is None or grad.placements == placements:
        return grad
    return grad.redistribute(placements=placements)


def _input_caster(dtype: torch.dtype):
    """A forward pre-hook casting a layer's float tensor inputs to ``dtype`` (FSDP2's ``cast_forward_inputs``)."""
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)
    return hook


class OneReplicaMixed:
    """One stage's fp32 masters, their bf16 compute copies while a step runs, and the fp32 gradient sums."""

    def __init__(self, stage: nn.Module, compute_dtype: torch.dtype, left_out: set):
        self.dtype = compute_dtype
        # every (module, name) a master is registered under: a tied weight is one master under two names
        self.slots = [(owner, name, p) for owner in stage.modules() for name, p in owner._parameters.items()
                      if p is not None and p not in left_out]
        self.masters = {id(p): p for _, _, p in self.slots}
        self.copies: dict[int, nn.Parameter] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.cast_at: dict[int, int] = {}  # each master's version counter when its copy was cast
        stage.register_forward_pre_hook(lambda *_: self.unshard())

    def unshard(self) -> None:
        """Register the bf16 copies: cast from the masters at a step's first forward, kept for the step.

        A copy is cast anew only where its master changed since (its version counter, which the optimizer's
        in-place step and a checkpoint's load bump): a forward-only pass left unreleased is not reused stale.
        """
        if not self.masters or (self.copies and self._fresh()):
            return
        if self.sums or any(c.grad is not None for c in self.copies.values()):
            raise RuntimeError("bf16-mixed: the fp32 masters changed between a forward and its step's end")
        with torch.no_grad():
            self.copies = {id(p): nn.Parameter(p.to(self.dtype), requires_grad=p.requires_grad)
                           for p in self.masters.values()}
        self.cast_at = {key: p._version for key, p in self.masters.items()}
        self._register(self.copies)

    def _fresh(self) -> bool:
        return all(p._version == self.cast_at[key] for key, p in self.masters.items())

    def post_backward(self) -> None:
        """One microbatch's bf16 gradients, upcast and added into the fp32 sums (FSDP2's order)."""
        with torch.no_grad():
            for key, copy in self.copies.items():
                grad = copy.grad
                if grad is None:
                    continue
                copy.grad = None
                if key in self.sums:
                    self.sums[key] += grad
                else:
                    self.sums[key] = grad.to(self.masters[key].dtype)  # FSDP2's reduce dtype: fp32

    def reshard(self) -> None:
        """The step's end: each step sum into its master's ``.grad``, the masters registered again.

        As FSDP2's last post-backward and reduce: gradients still on a copy (a weight-only backward's) join
        the fp32 sum, or stand alone in bf16; a tp DTensor's is then settled on its master's placements (a
        norm weight's partial sums all-reduced: once a step, as FSDP2 does, not once an optimizer step),
        upcast, and set as ``.grad`` or added into it (an earlier accumulation batch's)."""
        with torch.no_grad():
            for key, copy in self.copies.items():
                total, grad, master = self.sums.pop(key, None), copy.grad, self.masters[key]
                copy.grad = None
                if grad is not None:
                    total = grad if total is None else total.add_(grad)
                if total is None:
                    continue
                total = _settled(total, master).to(master.dtype)
                if master.grad is None:
                    master.grad = total
                else:
                    master.grad += total
        self.discard()

    def discard(self) -> None:
        """Drop the copies and sums (a forward-only pass, torch's set-up pass) and register the masters."""
        self.copies, self.sums = {}, {}
        self._register({})

    def _register(self, copies: dict) -> None:
        for owner, name, master in self.slots:
            owner._parameters[name] = copies.get(id(master), master)
