"""``PipelineSFTTrainer``: TRL's ``SFTTrainer`` over hfpipe's pipeline (TRL is the optional extra ``trl``).

TRL still prepares the data (chat template, tokenisation, ``completion_only_loss`` and
``assistant_only_loss`` masks, truncation) and collates it; the stages train as in
:class:`hfpipe.hf.trainer.PipelineTrainer`. What TRL computes from the full logits on the side
(``entropy``, ``mean_token_accuracy``) is not logged: the logits live on the last stage only.
"""

from __future__ import annotations

from hfpipe.api import load_pipeline
from hfpipe.errors import ConfigError
from hfpipe.hf.loop import PipelineLoop
from hfpipe.hf.options import check_optimizers, refuse_unsupported
from hfpipe.pipeline.options import PipelineLayout

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as e:  # the optional extra
    raise ImportError("PipelineSFTTrainer needs TRL: pip install 'hfpipe[trl]'") from e

__all__ = ["PipelineSFTTrainer"]


def refuse_sft(args, quantization_config, formatting_func) -> None:
    """TRL options that change the model or its loss in ways the stages do not run."""
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") != "wrapped":
        raise ConfigError(f"SFTConfig(packing=True, packing_strategy={args.packing_strategy!r}) packs padding-free "
                          "rows, which the pipeline does not split; use packing_strategy='wrapped' or packing=False")
    if getattr(args, "loss_type", "nll") != "nll":
        raise ConfigError(f"SFTConfig(loss_type={args.loss_type!r}): the last stage computes the token loss "
                          "('nll') only; drop loss_type")
    template = getattr(args, "chat_template_path", None)
    if template and not str(template).endswith((".jinja", ".j2")):
        raise ConfigError(f"SFTConfig(chat_template_path={template!r}) clones another tokenizer's template and "
                          "resizes the embeddings; pass a .jinja file, or set the tokenizer's chat_template")
    if getattr(args, "model_init_kwargs", None):
        raise ConfigError("SFTConfig(model_init_kwargs=...): the stages are loaded by hfpipe (bf16=True for the "
                          "dtype); drop model_init_kwargs")
    if quantization_config is not None:
        raise ConfigError("PipelineSFTTrainer(quantization_config=...): drop it (hfpipe's --quantize-base is "
                          "not yet exposed here)")
    del formatting_func  # TRL's own: it turns records into text before tokenising, and runs unchanged


class PipelineSFTTrainer(PipelineLoop, SFTTrainer):
    """TRL's ``SFTTrainer`` whose model is split into pipeline stages over the launched processes.

    Takes ``SFTTrainer``'s arguments, with ``model`` a folder or hub id and the pipeline's keywords of
    :class:`hfpipe.hf.trainer.PipelineTrainer` (``pp``, ``dp``, ``tp``, ``ep``, ``cp``, ``schedule``, ...);
    under ``cp`` set ``SFTConfig(pad_to_multiple_of=2 * cp)``.
    ``peft_config`` gives PEFT's LoRA on the stages (through ``load_pipeline``, not ``get_peft_model``);
    ``fp8`` float8 training, as :class:`~hfpipe.hf.trainer.PipelineTrainer` takes it (needs ``bf16=True``).
    """

    def __init__(self, model, args=None, *, pp: int | None = None, dp: int = 1, ep: int = 1, tp: int = 1,
                 cp: int = 1, schedule: str = "1f1b", microbatches: int | None = None, layout: str | None = None,
                 peft_config=None, fp8: str | None = None, optimizers=(None, None), compute_loss_func=None,
                 compute_metrics=None, preprocess_logits_for_metrics=None, quantization_config=None,
                 formatting_func=None, processing_class=None, **kwargs):
        if args is None:
            args = SFTConfig(f"{str(model).rstrip('/').split('/')[-1]}-SFT")
        refuse_unsupported(args, compute_loss_func=compute_loss_func, compute_metrics=compute_metrics,
                           preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        refuse_sft(args, quantization_config, formatting_func)
        check_optimizers(optimizers)
        options = PipelineLayout(pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, schedule=schedule, microbatches=microbatches,
                                 layout=layout)
        trust = bool(getattr(args, "trust_remote_code", False))
        stages = self._start_pipeline(load_pipeline, model, args, options, peft_config, trust, fp8)
        if processing_class is None:  # as TRL loads it, from the model's folder
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust)
        super().__init__(model=stages, args=args, optimizers=optimizers, processing_class=processing_class,
                         formatting_func=formatting_func, **kwargs)
