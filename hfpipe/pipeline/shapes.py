"""Reuse torch pipeline stages when the batch shape changes, instead of building new ones.

torch's ``PipelineStage`` learns its tensor shapes on first use: a metadata pass that runs every
stage's forward (and backward) on empty tensors and passes the shapes along the pipeline, then
allocates receive buffers. Building new stages for every sequence length (unpacked data) pays
that pass again per shape. Every tensor that crosses hfpipe's stages is (batch, seq, ...) and
only those two sizes change (the 1-D router sums of MoE aux losses never change), so the shapes
of a new batch are known: this module gives the existing stages the new shapes as static
metadata (torch's own static mode, the one used when ``input_args``/``output_args`` are passed
to ``PipelineStage``) and lets the schedule set up its buffers again, with no metadata pass.

torch has no public call for this; the attributes touched are those of torch 2.13's
``PipelineStage`` and schedules. Where they are missing (another torch), :func:`resize_schedule`
says so by returning ``False`` and the caller builds new stages, as before.
"""

from __future__ import annotations

import torch

__all__ = ["resize_schedule"]

_FLAGS = (("_stage_forward_initialized", "_stage_backward_initialized"),  # one stage per rank
          ("_stages_forward_initialized", "_stages_backward_initialized"))  # several


def resize_schedule(schedule, microbatch: tuple[int, int]) -> bool:
    """Point ``schedule``'s stages at microbatches of shape ``microbatch`` = (rows, seq).

    Returns:
        ``True`` if the stages were resized (the next step sets up buffers without a metadata
        pass); ``False`` if they cannot be (never initialised, non-plain tensors, or an unknown
        torch), and the caller should build new stages.
    """
    from torch.distributed.pipelining import _utils

    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    flags = next((f for f in _FLAGS if hasattr(schedule, f[0])), None)
    if flags is None or not all(_resizable(s) for s in stages):
        return False
    for s in stages:
        meta = s._stage_meta
        s._user_meta = _utils._StageMeta(inputs=_resized(meta.inputs, microbatch),
                                         outputs=_resized(meta.outputs, microbatch))
    for flag in flags:  # the next step runs torch's own (static) set-up again
        setattr(schedule, flag, False)
    return True


def _resizable(stage) -> bool:
    from torch.distributed.pipelining import _utils

    meta = getattr(stage, "_stage_meta", None)
    if meta is None or not hasattr(stage, "_user_meta") or not meta.is_complete_for_forward():
        return False
    metas = meta.inputs + meta.outputs
    return all(type(m) is _utils._TensorMeta for m in metas)


def _resized(metas, microbatch: tuple[int, int]):
    """The same tensors with (batch, seq) replaced; contiguous, as torch allocates its buffers."""
    from torch.distributed.pipelining import _utils

    out = []
    for m in metas:
        if len(m.shape) < 2:  # the router sums (2E,) and the aux loss (): no batch axes
            out.append(m)
            continue
        t = torch.empty((*microbatch, *m.shape[2:]), dtype=m.dtype, device="meta")
        out.append(_utils._TensorMeta.from_tensor(t.requires_grad_(m.requires_grad)))
    return tuple(out)
