"""The Python API: pipeline parallelism for an existing transformers training script.

Inside ``torchrun --nproc-per-node 4 train.py``::

    from hfpipe import load_pipeline
    pm = load_pipeline("meta-llama/Llama-3.2-1B", pp=4, schedule="1f1b", microbatches=8)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=2e-5)   # your own optimizer
    trainer = pm.trainer(optimizer, max_grad_norm=1.0)
    for batch in loader:                      # input_ids / attention_mask / labels from a collator
        out = trainer.step(batch)             # out.loss, out.grad_norm: same on every rank
    pm.save_pretrained("out/hf")              # an HF folder from_pretrained loads

The machinery is :mod:`hfpipe.pipeline.build` and :mod:`hfpipe.pipeline.model`; this face adds ``trainer`` (:mod:`hfpipe.train.step`, which
stands on the pipeline) and ``save_pretrained``, the one method that exports.
"""

from __future__ import annotations

import functools

from hfpipe.pipeline import build as _build
from hfpipe.pipeline import model as _model
from hfpipe.pipeline.model import DTYPES

__all__ = ["PipelineModel", "load_pipeline", "DTYPES"]


class PipelineModel(_model.PipelineModel):
    """This rank's part of a pipelined model (see :class:`hfpipe.pipeline.model.PipelineModel`)."""

    def trainer(self, optimizer, *, scheduler=None, max_grad_norm: float | None = 1.0):
        """A :class:`hfpipe.train.step.PipelineTrainer` whose ``step(batch)`` returns loss and grad norm on
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

    def save_checkpoint(self, root: str, step: int, optimizer=None, *, keep: int | None = None,
                        extra: dict | None = None, async_save: bool = False):
        """Save a DCP checkpoint ``root/step-<step>`` (every rank calls this; see
        :func:`hfpipe.checkpoint.pipeline_state.save_pipeline_checkpoint`)."""
        from hfpipe.checkpoint.pipeline_state import save_pipeline_checkpoint

        return save_pipeline_checkpoint(self, root, step, optimizer, keep=keep, extra=extra, async_save=async_save)

    def save_pretrained(self, out: str, *, dtype: str = "auto", max_shard_size: str = "5GB",
                        force: bool = False):
        """Write an HF folder ``from_pretrained`` loads (every rank calls this; rank 0 writes)."""
        import shutil
        import tempfile
        from pathlib import Path

        import torch.distributed as dist

        from hfpipe.checkpoint.export import export_checkpoint

        tmp = [tempfile.mkdtemp(prefix=".hfpipe-save-", dir=Path(out).absolute().parent)
               if self.dist.rank == 0 else None]
        dist.broadcast_object_list(tmp, src=0)
        try:
            ckpt = self.save_checkpoint(tmp[0], 0)
            if self.dist.rank == 0:
                export_checkpoint(ckpt, out, dtype=dtype, max_shard_size=max_shard_size, force=force,
                                  progress=False)
            dist.barrier()
        finally:
            if self.dist.rank == 0:
                shutil.rmtree(tmp[0], ignore_errors=True)
        return Path(out)


@functools.wraps(_build.load_pipeline)
def load_pipeline(model: str, **options) -> PipelineModel:
    return _build.load_pipeline(model, model_class=PipelineModel, **options)
