"""``PipelineTrainer``: transformers' ``Trainer`` over hfpipe's pipeline, for an unchanged training script.

In the script, under ``torchrun --nproc-per-node 2 train.py``::

    from hfpipe.hf import PipelineTrainer                       # was: from transformers import Trainer
    trainer = PipelineTrainer("path/or/hub-id", args=TrainingArguments(...), pp=2,   # was: Trainer(model, ...)
                              train_dataset=ds, data_collator=collator)
    trainer.train()
    trainer.save_model()                                        # an HF folder from_pretrained loads

Everything else is the Trainer's: TrainingArguments, callbacks and loggers, the optimizer and scheduler
(or ``optimizer_cls_and_kwargs``), logging/eval/save steps, ``save_total_limit``, resuming.
"""

from __future__ import annotations

import logging

from transformers import Trainer

from hfpipe.errors import ConfigError
from hfpipe.hf.loop import PipelineLoop
from hfpipe.hf.options import PipelineOptions, load_kwargs, refuse_unsupported, see_the_world
from hfpipe.hf.stages import PipelineStages

__all__ = ["PipelineTrainer", "load_stages"]

log = logging.getLogger(__name__)


def load_stages(model, args, options: PipelineOptions, peft_config=None, trust_remote_code: bool = False):
    """This rank's stages of ``model`` (a folder or hub id): ``(PipelineModel, PipelineStages, steps)``."""
    from hfpipe.api import load_pipeline

    if not isinstance(model, (str, bytes)) and not hasattr(model, "__fspath__"):
        raise ConfigError(f"PipelineTrainer(model=<{type(model).__name__}>): give the model's folder or hub id; "
                          "each rank then loads only its own stages")
    pm = load_pipeline(str(model), **load_kwargs(options, args, peft_config, trust_remote_code))
    steps = pm.trainer(None, max_grad_norm=args.max_grad_norm)  # the Trainer steps its own optimizer
    return pm, PipelineStages(pm), steps


def check_optimizers(optimizers) -> None:
    import torch

    opt, sched = optimizers
    if isinstance(opt, torch.optim.Optimizer):
        raise ConfigError("PipelineTrainer(optimizers=(<optimizer>, ...)): an optimizer built before the stages "
                          "exist holds no parameters of this rank; pass a callable params -> optimizer (e.g. "
                          "functools.partial(torch.optim.AdamW, lr=1e-4)) or optimizer_cls_and_kwargs")
    if sched is not None and hasattr(sched, "state_dict"):
        raise ConfigError("PipelineTrainer(optimizers=(..., <scheduler>)): pass a callable optimizer -> scheduler "
                          "(its optimizer is built on this rank's stages)")


class PipelineTrainer(PipelineLoop, Trainer):
    """``transformers.Trainer`` whose model is split into pipeline stages over the launched processes.

    Args:
        model: The model's folder or hub id (each rank reads only its stages' bytes).
        args: ``TrainingArguments``: ``per_device_train_batch_size`` is each pipeline's batch,
            ``gradient_accumulation_steps``, the optimizer, scheduler, ``max_grad_norm``, ``bf16``,
            ``gradient_checkpointing``, logging, evaluation and saving keep their meaning.
        pp, dp, ep, tp, cp, schedule, microbatches, layout: The pipeline's layout
            (:class:`hfpipe.hf.options.PipelineOptions`).
        peft_config: A ``peft.LoraConfig``: PEFT's LoRA adapters on the stages (base frozen).
        trust_remote_code: Allow a config that needs remote code.
        optimizers: ``(params -> optimizer, optimizer -> scheduler)`` callables, either may be ``None``.
        **kwargs: The rest of ``Trainer``'s arguments (``train_dataset``, ``eval_dataset``,
            ``data_collator``, ``processing_class``, ``callbacks``, ``optimizer_cls_and_kwargs``).
    """

    def __init__(self, model, args=None, *, pp: int | None = None, dp: int = 1, ep: int = 1, tp: int = 1,
                 cp: int = 1, schedule: str = "1f1b", microbatches: int | None = None, layout: str | None = None,
                 peft_config=None, trust_remote_code: bool = False, optimizers=(None, None), model_init=None,
                 compute_loss_func=None, compute_metrics=None, preprocess_logits_for_metrics=None, **kwargs):
        if args is None:
            from transformers import TrainingArguments

            args = TrainingArguments(output_dir="tmp_trainer")
        refuse_unsupported(args, model_init=model_init, compute_loss_func=compute_loss_func,
                           compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        check_optimizers(optimizers)
        options = PipelineOptions(pp, dp, ep, tp, cp, schedule, microbatches, layout)
        self.pipeline, stages, self._steps = load_stages(model, args, options, peft_config, trust_remote_code)
        see_the_world(args)
        super().__init__(model=stages, args=args, optimizers=optimizers, **kwargs)
