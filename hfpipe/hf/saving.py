"""What a PipelineTrainer writes and reads: ``output_dir/checkpoint-N`` holds hfpipe's DCP checkpoint
(``step-N``: model and optimizer, resumable at any pp) beside the Trainer's own ``scheduler.pt``,
``rng_state_*.pth`` and ``trainer_state.json``; ``save_model()`` writes an HF folder.

Functions over the trainer (duck-typed: ``pipeline``, ``optimizer``, ``lr_scheduler``, ``args``, ``state``),
so that :mod:`hfpipe.hf.loop` stays the list of hooks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hfpipe.errors import ConfigError

__all__ = ["find_pipeline_checkpoint", "load_trainer_checkpoint", "save_step_checkpoint", "save_scheduler",
           "export_model"]

SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME


def find_pipeline_checkpoint(folder) -> Path:
    """hfpipe's checkpoint inside a Trainer ``checkpoint-N`` folder (or the ``step-N`` folder itself)."""
    from hfpipe.checkpoint.dcp import CheckpointError, resolve_resume

    try:
        found = resolve_resume(str(folder), folder)
    except CheckpointError as e:
        raise ConfigError(f"train(resume_from_checkpoint={str(folder)!r}): {e}") from None
    if found is None:
        raise ConfigError(f"train(resume_from_checkpoint={str(folder)!r}) holds no hfpipe checkpoint (step-N); "
                          "give a checkpoint-N folder a PipelineTrainer saved")
    return found


def load_trainer_checkpoint(trainer, folder) -> None:
    """Model and optimizer from hfpipe's checkpoint, the scheduler from ``scheduler.pt`` (every rank)."""
    from hfpipe.checkpoint.dcp import load_checkpoint

    load_checkpoint(find_pipeline_checkpoint(folder), trainer.pipeline.view(), trainer.optimizer)
    path = Path(folder) / SCHEDULER_NAME
    if trainer.lr_scheduler is not None and path.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_step_checkpoint(trainer, folder) -> None:
    """hfpipe's checkpoint of this step under ``folder`` (every rank writes its own stages)."""
    trainer.pipeline.save_checkpoint(str(folder), int(trainer.state.global_step), trainer.optimizer)


def save_scheduler(trainer, folder) -> None:
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), Path(folder) / SCHEDULER_NAME)


def export_model(trainer, out) -> None:
    """An HF folder (a PEFT adapter folder under LoRA) into ``out``, as ``Trainer.save_model`` writes it.

    ``out`` is often the run's ``output_dir`` and holds the checkpoints: the export goes to a hidden
    sibling first and its files are moved in, leaving every other file of ``out`` where it was.
    """
    out = Path(out).absolute()
    tmp = out.parent / f".{out.name}.hfpipe-export"
    trainer.pipeline.save_pretrained(str(tmp), force=True)
    if trainer.pipeline.dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(out))
        torch.save(trainer.args, out / "training_args.bin")  # as Trainer._save does
    dist.barrier()
