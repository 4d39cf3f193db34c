"""The Python API: pipeline parallelism for an existing transformers training script.

Inside ``torchrun --nproc-per-node 4 train.py``::

    from hfpipe import load_pipeline
    pm = load_pipeline("meta-llama/Llama-3.2-1B", pp=4, schedule="1f1b", microbatches=8)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=2e-5)   # your own optimizer
    trainer = pm.trainer(optimizer, max_grad_norm=1.0)
    for batch in loader:                      # input_ids / attention_mask / labels from a collator
        out = trainer.step(batch)             # out.loss, out.grad_norm: same on every rank
    pm.save_checkpoint("out/checkpoints", step, optimizer, scheduler=scheduler)
    pm.save_pretrained("out/hf")              # an HF folder from_pretrained loads

and to resume: ``start = pm.load_checkpoint(path, optimizer=optimizer, scheduler=scheduler)``.

The machinery is :mod:`hfpipe.pipeline.build` and :mod:`hfpipe.pipeline.model`; this face adds ``trainer``
(:mod:`hfpipe.train.step`, which stands on the pipeline), the checkpoint methods and ``save_pretrained``.
Every error these raise names the argument to change (the checks below the face speak the CLI's flags;
:func:`_as_arguments` turns those into argument names) and is raised on every rank alike
(:mod:`hfpipe.parallel.agree`), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import inspect
import logging
import re
import textwrap

from hfpipe.errors import HfpipeError
from hfpipe.parallel.agree import agree, raise_together
from hfpipe.pipeline import build as _build
from hfpipe.pipeline import model as _model
from hfpipe.pipeline.options import PRECISIONS, from_keywords, keyword_docs, keyword_parameters

__all__ = ["PipelineModel", "load_pipeline", "PRECISIONS"]

log = logging.getLogger(__name__)


class PipelineModel(_model.RankPipeline):
    """This rank's part of a pipelined model (see :class:`hfpipe.pipeline.model.PipelineModel`)."""

    def trainer(self, optimizer, *, scheduler=None, max_grad_norm: float | None = 1.0):
        """A :class:`hfpipe.train.step.StepEngine` whose ``step(batch)`` returns loss and grad norm on
        every rank."""
        from hfpipe.train.step import trainer_for

        return trainer_for(self, optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm)

    def view(self):
        """One module holding this rank's parameters under their full-model names (for DCP)."""
        from hfpipe.checkpoint.pipeline_state import pipeline_view

        return pipeline_view(self)

    def model_state_dict(self):
        """This rank's tensors under full-model names (a tied head is stored as the embedding)."""
        from hfpipe.checkpoint.pipeline_state import pipeline_state_dict

        return pipeline_state_dict(self)

    def save_checkpoint(self, root: str, step: int, optimizer=None, *, scheduler=None, epoch: int = 0,
                        batch_in_epoch: int | None = None, keep: int | None = None,
                        extra: dict | None = None, async_save: bool = False):
        """Save a DCP checkpoint ``root/step-<step>`` (every rank calls this).

        Args:
            root: The checkpoints folder.
            step: Optimizer steps done.
            optimizer: Its state is saved with the weights (``None``: weights only).
            scheduler: An LR scheduler whose ``state_dict()`` is saved (as JSON, never pickled).
            epoch, batch_in_epoch: Where the data stands, for :meth:`load_checkpoint` to hand back:
                the epoch and the batches of it already trained (default ``step``: one batch a step).
            keep: Keep only the newest ``keep`` checkpoints.
            extra: More ``hfpipe.json`` fields.
            async_save: Write in the background; see
                :func:`hfpipe.checkpoint.pipeline_state.save_pipeline_checkpoint`.
        """
        from hfpipe.checkpoint.pipeline_state import save_pipeline_checkpoint

        return save_pipeline_checkpoint(self, root, step, optimizer, scheduler=scheduler, epoch=epoch,
                                        batch_in_epoch=batch_in_epoch, keep=keep, extra=extra,
                                        async_save=async_save)

    def load_checkpoint(self, path: str, *, optimizer=None, scheduler=None):
        """Resume from ``path`` (a ``step-XXXXXXXX`` folder, or a checkpoints folder: its newest).

        Restores this rank's weights, the optimizer's and the scheduler's state, and the RNG; returns
        a :class:`hfpipe.checkpoint.pipeline_state.Resumed` with ``step``, ``epoch`` and
        ``batch_in_epoch`` (where the data stands: skip that many batches of that epoch). Every rank
        calls it; an error is raised on every rank alike.
        """
        from hfpipe.checkpoint.pipeline_state import load_pipeline_checkpoint

        return load_pipeline_checkpoint(self, path, optimizer=optimizer, scheduler=scheduler)

    def save_pretrained(self, out: str, *, dtype: str = "auto", max_shard_size: str = "5GB",
                        overwrite: bool = False, force: bool = False):
        """Write an HF folder ``from_pretrained`` loads (every rank calls this; rank 0 writes).

        ``overwrite=True`` replaces an earlier export at ``out`` (``force`` is its older name).
        """
        out = self.write_hf_folder(out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite or force)
        if self.dist.rank == 0:
            log.info("save_pretrained: wrote an HF folder to %s", out)
        return out

    def write_hf_folder(self, out, *, dtype: str = "auto", max_shard_size: str = "5GB", overwrite: bool = False,
                        checkpoint=None, call: str = "save_pretrained"):
        """:meth:`save_pretrained` without its closing log line, for a caller that says what it wrote in its
        own words (``PipelineTrainer.save_model``); errors name ``call``'s arguments. With ``checkpoint`` (one
        :meth:`save_checkpoint` just wrote) the folder is exported from it, not from a temporary one. A failure
        leaves ``out`` as it was and removes the parents of ``out`` it made."""
        import contextlib
        from pathlib import Path

        from hfpipe.export.out_folder import new_parents_removed_on_failure

        rank0 = self.dist.rank == 0
        with new_parents_removed_on_failure(Path(out)) if rank0 else contextlib.nullcontext():
            return self._write_hf_folder(out, bool(overwrite), rank0, dtype, max_shard_size, checkpoint, call)

    def _write_hf_folder(self, out, overwrite: bool, rank0: bool, dtype, max_shard_size, checkpoint, call):
        import shutil
        import tempfile
        from pathlib import Path

        import torch.distributed as dist

        from hfpipe.export.hf_folder import export_checkpoint
        from hfpipe.export.out_folder import check_out

        # Rank 0 checks the folder before anything is written; every rank raises what it found.
        _in_python_words(lambda: agree(lambda: check_out(Path(out), overwrite, ()) if rank0 else None),
                         call, out=out)
        tmp = [None]
        if checkpoint is None:
            tmp = [tempfile.mkdtemp(prefix=".hfpipe-save-", dir=Path(out).absolute().parent) if rank0 else None]
            dist.broadcast_object_list(tmp, src=0)
        try:
            # a temporary checkpoint's step number is not the run's: the export says nothing of it (quiet)
            ckpt = checkpoint if checkpoint is not None else self.save_checkpoint(tmp[0], 0)

            def export() -> None:
                if rank0:
                    export_checkpoint(ckpt, out, dtype=dtype, max_shard_size=max_shard_size, force=overwrite,
                                      progress=False, quiet=True)

            _in_python_words(lambda: agree(export), call, out=out)
        finally:
            if rank0 and tmp[0] is not None:
                shutil.rmtree(tmp[0], ignore_errors=True)
        return Path(out)


def load_pipeline(model: str, *, trust_remote_code: bool = False, dist=None, **options) -> PipelineModel:
    """Load this rank's stages of ``model`` ready to train (every rank of a ``torchrun`` world calls it).

    The keywords are declared once, as the fields of :class:`hfpipe.pipeline.options.PipelineLayout`
    (how the model is split and scheduled) and :class:`~hfpipe.pipeline.options.StageOptions` (how the
    stages are built): this signature and the argument list below are made from them, and any other
    keyword is refused naming the closest field.

    Args:
        model: Local HF folder or hub id.
        trust_remote_code: Allow configs that need remote code.
        dist: An existing :class:`hfpipe.parallel.mesh.Dist` (default: join/create the process group).
{options}

    Returns:
        This rank's :class:`PipelineModel`.
    """
    import os

    from hfpipe.progress.logs import default_handler
    from hfpipe.progress.ticker import Ticker

    default_handler(int(os.environ.get("RANK", "0") or 0))
    error = None
    with Ticker("load_pipeline: loading this rank's stages"):
        try:
            pm = _in_python_words(lambda: _build.build_pipeline(
                model, *from_keywords("load_pipeline", options), trust_remote_code=trust_remote_code, dist=dist,
                model_class=PipelineModel), "load_pipeline", model=model)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank alike
            error, pm = e, None
    raise_together(error)  # a rank that failed after the process group started: all raise it
    return pm


def _face_signature(face):
    """``face``'s own parameters, its ``**options`` spelled out as the options' fields."""
    own = [p for p in inspect.signature(face, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
    return inspect.Signature(own + keyword_parameters(), return_annotation=PipelineModel)


load_pipeline.__signature__ = _face_signature(load_pipeline)
if load_pipeline.__doc__:  # (None under python -OO)
    load_pipeline.__doc__ = load_pipeline.__doc__.format(options=textwrap.indent(keyword_docs(), " " * 4))


# --- The checks below the face speak the CLI's flags; a Python caller reads its arguments -------------
#: Flags whose argument is not simply the flag's name with underscores.
_FLAGS = {"--force": "overwrite=True", "--lora-rank": "lora", "--fp8-recipe": "fp8", "--batch-size": "the batch's rows",
          "--out": "out", "--model": "model"}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _as_arguments(message: str, call: str, arguments: dict) -> str:
    """``message`` with each ``--flag`` as the argument of ``call`` it stands for, led by ``call``."""
    text = message.replace("--lora-rank R", "lora=LoraConfig(r=R)")  # the API's LoRA is PEFT's config
    text = _FLAG.sub(lambda m: _FLAGS.get(m.group(), m.group()[2:].replace("-", "_")), text)
    for upper, value in arguments.items():  # the CLI's OUT / MODEL arguments
        text = re.sub(rf"\b{upper.upper()}\b", upper, text)
    return text if text.startswith(f"{call}(") else f"{call}({', '.join(f'{k}={v!r}' for k, v in arguments.items())}): {text}"


def _in_python_words(fn, call: str, **arguments):
    """``fn()``, its :class:`HfpipeError` re-raised (same class) in ``call``'s argument names."""
    try:
        return fn()
    except HfpipeError as e:
        text = _as_arguments(str(e), call, arguments)
        try:
            again = type(e)(text)
        except TypeError:
            raise e from None
        raise again from None
