"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` running hfpipe's pipeline (issue #26).

``from hfpipe.hf import PipelineTrainer`` in place of ``Trainer``, ``pp=2`` beside the usual arguments,
and the script runs under ``torchrun``. Lazy, like ``hfpipe/__init__.py``: importing the package loads
neither transformers' Trainer nor TRL.
"""

__all__ = ["PipelineTrainer", "PipelineSFTTrainer"]


def __getattr__(name):
    if name == "PipelineTrainer":
        from hfpipe.hf.trainer import PipelineTrainer

        return PipelineTrainer
    if name == "PipelineSFTTrainer":
        from hfpipe.hf.sft import PipelineSFTTrainer

        return PipelineSFTTrainer
    raise AttributeError(f"module 'hfpipe.hf' has no attribute {name!r}")
