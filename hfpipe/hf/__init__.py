"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` and ``DPOTrainer`` running hfpipe's pipeline.

``from hfpipe.hf import PipelineTrainer`` in place of ``Trainer`` (``PipelineSFTTrainer``, ``PipelineDPOTrainer``
for TRL's), ``pp=2`` beside the usual arguments, and the script runs under ``torchrun``. Lazy, like ``hfpipe/__init__.py``: importing the package loads
neither transformers' Trainer nor TRL. Importing it first (as the Trainer's import was) also keeps the
script's start quiet: see :func:`hfpipe.hf.process.prepare_process`.
"""

from hfpipe.hf.process import prepare_process as _prepare_process

__all__ = ["PipelineTrainer", "PipelineSFTTrainer", "PipelineDPOTrainer"]

_prepare_process()


def __getattr__(name):
    if name == "PipelineTrainer":
        from hfpipe.hf.trainer import PipelineTrainer

        return PipelineTrainer
    if name == "PipelineSFTTrainer":
        from hfpipe.hf.sft import PipelineSFTTrainer

        return PipelineSFTTrainer
    if name == "PipelineDPOTrainer":
        from hfpipe.hf.dpo import PipelineDPOTrainer

        return PipelineDPOTrainer
    raise AttributeError(f"module 'hfpipe.hf' has no attribute {name!r}")
