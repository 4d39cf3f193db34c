"""What a pipelined model saves: this rank's view under full-model names, and the run record beside it.

Functions over a :class:`hfpipe.pipeline.model.PipelineModel` (duck-typed: its modules, source, dist,
LoRA and quantization), so that the pipeline layer stays below the checkpoint it is saved into; the
API's model and the run loop call them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hfpipe.checkpoint.dcp import CheckpointError, latest_checkpoint, load_checkpoint, rank_view, save_checkpoint
from hfpipe.parallel.agree import agree

__all__ = ["Resumed", "load_pipeline_checkpoint", "pipeline_view", "save_pipeline_checkpoint",
           "pipeline_state_dict"]


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


def save_pipeline_checkpoint(pm, root: str, step: int, optimizer=None, *, scheduler=None, epoch: int = 0,
                             batch_in_epoch: int | None = None, keep: int | None = None,
                             extra: dict | None = None, async_save: bool = False):
    """Save a DCP checkpoint ``root/step-<step>`` (every rank calls this).

    The checkpoint resumes at any pipeline size (:func:`load_pipeline_checkpoint`, or ``--resume``)
    and exports with ``hfpipe export``. ``hfpipe.json`` records the scheduler's state (JSON, never
    pickled) and the data position (``epoch``, ``batch_in_epoch``, default ``step``); ``extra`` adds
    to (or replaces) its fields. Returns the path, or with ``async_save`` a pending save whose
    ``wait()`` every rank must call. An argument refused on one rank is refused on every rank.
    """
    train = agree(lambda: _train_record(root, step, scheduler, epoch, batch_in_epoch, keep, extra))
    config = pm.source.config
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    world = {"pp": pm.dist.pp, "dp": pm.dist.dp, "ep": pm.ep, "tp": pm.dist.dims.tp, "cp": pm.dist.dims.cp}
    meta = {"format": 1, "source": str(pm.source.folder), "tied": pm.tied,
            "source_dtype": str(dtype).replace("torch.", ""),
            "config": {"model": pm.source.name, **world}, "world": world, "train": train, **(extra or {})}
    if pm.lora is not None:
        from hfpipe.lora.adapters import config_to_dict

        from hfpipe.checkpoint.base_record import base_record

        meta["lora"] = config_to_dict(pm.lora)  # the base is meta["source"]
        meta["base"] = base_record(pm.source.folder)  # what it was, for --merge (checkpoint/base_record.py)
    if pm.quantize is not None:
        meta["quantize_base"] = pm.quantize.to_dict()  # how the base was quantized (for --merge)
    return save_checkpoint(Path(root), step, pipeline_view(pm), optimizer, meta, keep=keep,
                           async_save=async_save)


def _count(name: str, value, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointError(f"save_checkpoint({name}={value!r}): {name} must be an integer >= {low}"
                              + (" (or None)" if optional else ""))


def _train_record(root, step, scheduler, epoch, batch_in_epoch, keep, extra) -> dict:
    """The arguments checked, and what a resume needs: the data position and the scheduler's state."""
    if Path(root).exists() and not Path(root).is_dir():
        raise CheckpointError(f"save_checkpoint(root={str(root)!r}): it is a file; give a folder "
                              "(checkpoints go to root/step-XXXXXXXX)")
    _count("step", step, 0)
    _count("epoch", epoch, 0)
    _count("batch_in_epoch", batch_in_epoch, 0, optional=True)
    _count("keep", keep, 1, optional=True)
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"save_checkpoint(extra=...): extra must be a dict, got {type(extra).__name__}")
    position = {"step": step, "epoch": epoch, "batch_in_epoch": step if batch_in_epoch is None else batch_in_epoch}
    record = {"position": position}
    if scheduler is not None:
        state = getattr(scheduler, "state_dict", None)
        if state is None:
            raise CheckpointError("save_checkpoint(scheduler=...): it has no state_dict(); pass a torch LR scheduler")
        try:  # hfpipe.json is JSON: a scheduler's state is stored as data, never pickled
            record["scheduler"] = json.loads(json.dumps(state()))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"save_checkpoint(scheduler=...): its state_dict() is not plain data ({e}); "
                                  "save it yourself beside the checkpoint") from None
    return record


@dataclass(frozen=True)
class Resumed:
    """Where a run resumed by :func:`load_pipeline_checkpoint` stands.

    Attributes:
        path: The checkpoint loaded.
        step: Optimizer steps done.
        epoch: The epoch the data stands in.
        batch_in_epoch: Batches of that epoch already trained: skip them.
        meta: The whole ``hfpipe.json``.
    """

    path: Path
    step: int
    epoch: int
    batch_in_epoch: int
    meta: dict


def load_pipeline_checkpoint(pm, path: str, *, optimizer=None, scheduler=None) -> Resumed:
    """Load ``path`` (or the newest checkpoint in it) into ``pm``, ``optimizer`` and ``scheduler``.

    Every rank calls it; an error (no such checkpoint, another model, no scheduler state, an optimizer
    or scheduler that the saved state does not fit) is raised on every rank alike, before any state is
    applied. The RNG state is restored too where the world size is the same.
    """
    found = agree(lambda: _find(path, optimizer, scheduler))
    meta = load_checkpoint(found, pipeline_view(pm), optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(meta["train"]["scheduler"])
    position = meta["train"].get("position") or {}
    step = int(position.get("step", meta.get("step", 0)))
    return Resumed(found, step, int(position.get("epoch", 0)), int(position.get("batch_in_epoch", step)), meta)


def _find(path, optimizer, scheduler) -> Path:
    from hfpipe.checkpoint.dcp import read_meta

    _check_kinds(optimizer, scheduler)
    given = Path(path)
    found = given if (given / ".metadata").is_file() else latest_checkpoint(given)
    if found is None:
        raise CheckpointError(f"load_checkpoint(path={str(path)!r}): "
                              + ("no such folder" if not given.exists() else "no checkpoint in it")
                              + "; give a step-XXXXXXXX folder or the folder save_checkpoint wrote into")
    meta = read_meta(found)
    if scheduler is not None and "scheduler" not in (meta.get("train") or {}):
        raise CheckpointError(f"load_checkpoint(scheduler=...): {found} holds no scheduler state (it was saved "
                              "without save_checkpoint(scheduler=...)); leave scheduler out or resume another")
    if scheduler is not None:
        _check_scheduler_fits(scheduler, meta["train"]["scheduler"], found)
    return found


def _check_kinds(optimizer, scheduler) -> None:
    """An optimizer and a scheduler are torch's objects (a name such as ``"adamw"`` is not one)."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"load_checkpoint(optimizer={optimizer!r}): pass the torch optimizer built over "
                              "pm.parameters() (or None to load the weights only)")
    if scheduler is not None and not all(callable(getattr(scheduler, m, None)) for m in ("state_dict", "load_state_dict")):
        raise CheckpointError(f"load_checkpoint(scheduler={scheduler!r}): pass a torch LR scheduler (it has "
                              "state_dict() and load_state_dict()), or None")


def _check_scheduler_fits(scheduler, saved: dict, found: Path) -> None:
    """The saved schedule has one entry per parameter group in each of its lists (``base_lrs``, LambdaLR's
    ``lr_lambdas``): a scheduler over another number of groups would fail in torch's own load, after the
    weights and the optimizer were already loaded."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"load_checkpoint(scheduler=...): {found}'s scheduler state is not an object; "
                              "resume another checkpoint")
    mine = scheduler.state_dict()
    for key, value in saved.items():
        if isinstance(value, list) and isinstance(mine.get(key), list) and len(value) != len(mine[key]):
            raise CheckpointError(f"load_checkpoint(scheduler=...): the checkpoint's scheduler ran over {len(value)} "
                                  f"parameter groups ({key}), this one over {len(mine[key])}; build the scheduler over "
                                  "an optimizer with the same groups as the saved run's")
