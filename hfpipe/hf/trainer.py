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

from transformers import Trainer

from hfpipe.api import load_pipeline
from hfpipe.hf.loop import PipelineLoop
from hfpipe.hf.options import check_optimizers, refuse_unsupported
from hfpipe.pipeline.options import PipelineLayout

__all__ = ["PipelineTrainer"]


class PipelineTrainer(PipelineLoop, Trainer):
    """``transformers.Trainer`` whose model is split into pipeline stages over the launched processes.

    Args:
        model: The model's folder or hub id (each rank reads only its stages' bytes).
        args: ``TrainingArguments``: ``per_device_train_batch_size`` is each pipeline's batch,
            ``gradient_accumulation_steps``, the optimizer, scheduler, ``max_grad_norm``, ``bf16``,
            ``gradient_checkpointing``, logging, evaluation and saving keep their meaning.
        pp, dp, ep, tp, cp, schedule, microbatches, layout: The pipeline's layout
            (fields of :class:`hfpipe.pipeline.options.PipelineLayout`); the world is pp x dp x cp x tp processes.
            Under ``cp`` the collator must pad rows to a multiple of ``2 * cp`` (``pad_to_multiple_of``).
        peft_config: A ``peft.LoraConfig``: PEFT's LoRA adapters on the stages (base frozen).
        fp8: Float8 training, ``"rowwise"`` or ``"tensorwise"`` (torchao's recipes, as ``--fp8-recipe``): the
            decoder layers' linears multiply in float8; needs ``bf16=True``. accelerate's
            ``mixed_precision="fp8"`` turns it on too (rowwise, in bf16).
        trust_remote_code: Allow a config that needs remote code.
        optimizers: ``(params -> optimizer, optimizer -> scheduler)`` callables, either may be ``None``.
        **kwargs: The rest of ``Trainer``'s arguments (``train_dataset``, ``eval_dataset``,
            ``data_collator``, ``processing_class``, ``callbacks``, ``optimizer_cls_and_kwargs``).
    """

    def __init__(self, model, args=None, *, pp: int | None = None, dp: int = 1, ep: int = 1, tp: int = 1,
                 cp: int = 1, schedule: str = "1f1b", microbatches: int | None = None, layout: str | None = None,
                 peft_config=None, fp8: str | None = None, trust_remote_code: bool = False, optimizers=(None, None),
                 model_init=None, compute_loss_func=None, compute_metrics=None, preprocess_logits_for_metrics=None,
                 **kwargs):
        if args is None:
            from transformers import TrainingArguments

            args = TrainingArguments(output_dir="tmp_trainer")
        refuse_unsupported(args, model_init=model_init, compute_loss_func=compute_loss_func,
                           compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        check_optimizers(optimizers)
        options = PipelineLayout(pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, schedule=schedule, microbatches=microbatches,
                                 layout=layout)
        stages = self._start_pipeline(load_pipeline, model, args, options, peft_config, trust_remote_code, fp8)
        super().__init__(model=stages, args=args, optimizers=optimizers, **kwargs)
