"""What a pipelined model saves: this rank's view under full-model names, and the run record beside it.

Functions over a :class:`hfpipe.pipeline.model.PipelineModel` (duck-typed: its modules, source, dist,
LoRA and quantization), so that the pipeline layer stays below the checkpoint it is saved into; the
API's model and the run loop call them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hfpipe.checkpoint.dcp import CheckpointError, rank_view, save_checkpoint

__all__ = ["pipeline_view", "save_pipeline_checkpoint", "pipeline_state_dict"]


def pipeline_view(pm):
    """One module holding this rank's parameters under their full-model names (for DCP).

    Under LoRA it holds the adapters only: they are all a checkpoint needs besides the base.
    """
    if pm.lora is not None:
        from hfpipe.lora.adapters import adapter_view

        return adapter_view(pm.modules)
    return rank_view(pm.modules, pm.tied)


def pipeline_state_dict(pm) -> dict[str, torch.Tensor]:
    """This rank's tensors under full-model names (a tied head is stored as the embedding)."""
    return dict(pipeline_view(pm).state_dict())


def save_pipeline_checkpoint(pm, root: str, step: int, optimizer=None, *, keep: int | None = None,
                             extra: dict | None = None, async_save: bool = False):
    """Save a DCP checkpoint ``root/step-<step>`` (every rank calls this).

    The checkpoint resumes at any pipeline size and exports with ``hfpipe export``.
    ``extra`` adds to (or replaces) the ``hfpipe.json`` fields. Returns the path, or with
    ``async_save`` a pending save whose ``wait()`` every rank must call.
    """
    if Path(root).exists() and not Path(root).is_dir():
        raise CheckpointError(f"save_checkpoint(root={str(root)!r}): it is a file; give a folder "
                              "(checkpoints go to root/step-XXXXXXXX)")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"save_checkpoint(step={step!r}): step must be an integer >= 0")
    config = pm.source.config
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    world = {"pp": pm.dist.pp, "dp": pm.dist.dp, "ep": pm.ep, "tp": pm.dist.dims.tp, "cp": pm.dist.dims.cp}
    meta = {"format": 1, "source": str(pm.source.folder), "tied": pm.tied,
            "source_dtype": str(dtype).replace("torch.", ""),
            "config": {"model": pm.source.name, **world}, "world": world, "train": {}, **(extra or {})}
    if pm.lora is not None:
        from hfpipe.lora.adapters import config_to_dict

        meta["lora"] = config_to_dict(pm.lora)  # the base is meta["source"]
    if pm.quantize is not None:
        meta["quantize_base"] = pm.quantize.to_dict()  # how the base was quantized (for --merge)
    return save_checkpoint(Path(root), step, pipeline_view(pm), optimizer, meta, keep=keep,
                           async_save=async_save)
