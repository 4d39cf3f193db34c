"""What a PipelineTrainer writes and reads: ``output_dir/checkpoint-N`` holds hfpipe's DCP checkpoint
(``step-N``: model and optimizer, resumable at any pp) beside the Trainer's own ``scheduler.pt``,
``rng_state_*.pth`` and ``trainer_state.json``, and the model's HF files (``config.json``, safetensors, the
tokenizer; adapter files under LoRA), so that ``from_pretrained("out/checkpoint-N")`` loads it as it loads a
plain Trainer's; ``save_model()`` writes an HF folder.

Functions over the trainer (duck-typed: ``pipeline``, ``optimizer``, ``lr_scheduler``, ``args``, ``state``),
so that :mod:`hfpipe.hf.loop` stays the list of hooks.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from hfpipe.errors import ConfigError
from hfpipe.parallel.agree import agree

__all__ = ["find_pipeline_checkpoint", "load_trainer_checkpoint", "save_step_checkpoint", "save_scheduler",
           "export_model"]

log = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


def find_pipeline_checkpoint(folder) -> Path:
    """hfpipe's checkpoint inside a Trainer ``checkpoint-N`` folder: what ``resume_from_checkpoint`` takes, as the
    plain Trainer does (it reads ``trainer_state.json`` there, so a ``step-N`` folder inside is refused, naming
    its ``checkpoint-N``)."""
    from hfpipe.checkpoint.dcp import CheckpointError, resolve_resume

    call = f"train(resume_from_checkpoint={str(folder)!r})"
    given = Path(folder)
    if not (given / TRAINER_STATE_NAME).is_file():
        if (given.parent / TRAINER_STATE_NAME).is_file():
            raise ConfigError(f"{call}: pass the Trainer's checkpoint folder {given.parent}, not hfpipe's step "
                              "folder inside it")
        raise ConfigError(f"{call} is not a checkpoint-N folder a PipelineTrainer saved (no {TRAINER_STATE_NAME}); "
                          "pass one, or True for the newest in output_dir")
    try:
        found = resolve_resume(str(folder), folder)
    except CheckpointError as e:
        raise ConfigError(f"{call}: {e}") from None
    if found is None:
        raise ConfigError(f"{call} holds no hfpipe checkpoint (step-N); give a checkpoint-N folder a PipelineTrainer "
                          "saved")
    return found


def load_trainer_checkpoint(trainer, folder) -> None:
    """Model and optimizer from hfpipe's checkpoint, the scheduler from ``scheduler.pt`` (every rank)."""
    from hfpipe.checkpoint.dcp import load_checkpoint

    load_checkpoint(find_pipeline_checkpoint(folder), trainer.pipeline.view(), trainer.optimizer)
    path = Path(folder) / SCHEDULER_NAME
    if trainer.lr_scheduler is not None and path.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_step_checkpoint(trainer, folder) -> None:
    """hfpipe's checkpoint of this step under ``folder`` (every rank writes its own stages), and beside it the
    model as ``from_pretrained`` loads it (a PEFT adapter folder under LoRA), as the plain Trainer's
    ``checkpoint-N`` holds it: exported from that checkpoint at export speed, one layer at a time."""
    pipeline = trainer.pipeline
    ckpt = pipeline.save_checkpoint(str(folder), int(trainer.state.global_step), trainer.optimizer)
    _write_beside(trainer, Path(folder), lambda tmp: pipeline.write_hf_folder(str(tmp), checkpoint=ckpt,
                                                                               call="save_model"))


def save_scheduler(trainer, folder) -> None:
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), Path(folder) / SCHEDULER_NAME)


def export_model(trainer, out) -> None:
    """An HF folder (a PEFT adapter folder under LoRA) into ``out``, as ``Trainer.save_model`` writes it.

    ``out`` is often the run's ``output_dir`` and holds the checkpoints: see :func:`_write_beside`.
    """
    out = Path(out).absolute()
    _write_beside(trainer, out, lambda tmp: trainer.pipeline.write_hf_folder(str(tmp), call="save_model"))
    if trainer.pipeline.dist.rank == 0:
        log.info("save_model: wrote the %s of step %d to %s", "adapters" if trainer.pipeline.lora else "model",
                 trainer.state.global_step, out)


def _write_beside(trainer, out: Path, write, call: str = "save_model") -> None:
    """``write(tmp)`` an HF folder, then the tokenizer and ``training_args.bin``, into a hidden sibling of ``out``,
    and move its files into ``out`` once every name they take there is checked, leaving every other file of
    ``out`` where it was. A target that cannot take them is one error on every rank, and nothing is left
    behind. ``write`` runs on every rank (it is :meth:`hfpipe.api.PipelineModel.write_hf_folder`)."""
    out = Path(out).absolute()
    rank0 = trainer.pipeline.dist.rank == 0
    tmp = out.parent / f".{out.name}.hfpipe-export"
    agree(lambda: _check_folder(out, tmp, call) if rank0 else None)
    try:
        write(tmp)

        def finish() -> None:
            if rank0:
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(str(tmp))
                torch.save(trainer.args, tmp / "training_args.bin")  # as Trainer._save does
                _move_in(tmp, out, call)
                shutil.rmtree(tmp)  # before the ranks part: none returns while it is still there

        agree(finish)
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_folder(out: Path, tmp: Path, call: str) -> None:
    """``out`` must be a folder (or not exist yet) in a writable parent; a leftover of an export that died
    (our own hidden sibling) is cleared."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{call}(output_dir={str(out)!r}): {out} is a file; pass a folder for the model's files")
    parent = out if out.is_dir() else out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{call}(output_dir={str(out)!r}): {parent} is not writable; pass a writable folder")
    shutil.rmtree(tmp, ignore_errors=True)


def _move_in(tmp: Path, out: Path, call: str) -> None:
    """Move every file of ``tmp`` into ``out``, once every name is known to be free for a file."""
    names = sorted(f.name for f in tmp.iterdir())
    taken = [n for n in names if (out / n).is_dir() or ((out / n).exists() and not (out / n).is_file())]
    if taken:
        raise ConfigError(f"{call}(output_dir={str(out)!r}): {out / taken[0]} is a folder where the model's "
                          f"file {taken[0]} goes; move it away or pass another folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.replace(tmp / name, out / name)
