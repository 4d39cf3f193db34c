"""``PipelineDPOTrainer``: TRL's ``DPOTrainer`` over hfpipe's pipeline (TRL is the optional extra ``trl``).

TRL still prepares the preference data (prompt extraction, chat template, EOS, tokenisation, truncation),
collates it (``DataCollatorForPreference``: chosen rows, then rejected rows), validates ``DPOConfig`` and
averages and logs the metrics. The pipeline runs the rest:

- each batch's pairs are interleaved so every microbatch holds whole pairs
  (:func:`hfpipe.loss.preference.pair_batch`), and the last stage computes TRL's own loss of them
  (:class:`hfpipe.loss.preference.Preference`), scaled so that the step is TRL's;
- the reference log-probs are read before training by a forward-only pass of the same pipeline
  (:func:`hfpipe.train.reference.reference_logps`, TRL's ``precompute_ref_log_probs=True`` path), with PEFT's
  adapters off under ``peft_config``. With ``precompute_ref_log_probs=False`` (TRL's default) TRL reads the
  same numbers batch by batch from a frozen copy of the model (or with the adapters off): the pass before
  training stands in for it, and no second model is ever loaded;
- the reward metrics (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
  ``logps/chosen``, ``logps/rejected``) are each batch's mean over its pairs and dp replicas, as TRL logs them.
  What TRL computes from the whole logits on the side (entropy, mean logits, token accuracy) is not logged.
"""

from __future__ import annotations

from unittest import mock

import torch

from hfpipe.api import load_pipeline
from hfpipe.errors import ConfigError
from hfpipe.hf.loop import PipelineLoop
from hfpipe.hf.options import check_optimizers, refuse_unsupported
from hfpipe.loss.preference import Preference, PreferenceConfig, pair_batch
from hfpipe.pipeline.options import PipelineLayout
from hfpipe.train.preference import reward_means, shared_pair_sums
from hfpipe.train.reference import reference_logps

try:
    import trl.trainer.dpo_trainer as _trl_dpo
    from trl import DPOConfig, DPOTrainer
except ImportError as e:  # the optional extra
    raise ImportError("PipelineDPOTrainer needs TRL: pip install 'hfpipe[trl]'") from e

__all__ = ["PipelineDPOTrainer"]


def refuse_dpo(args, ref_model, quantization_config, cp: int) -> None:
    """DPOConfig settings and arguments the pipeline does not run, each refused in one line with its fix."""
    if ref_model is not None:
        raise ConfigError("PipelineDPOTrainer(ref_model=...): a second resident model is not loaded; drop ref_model "
                          "(the reference log-probs are read by a forward-only pass of the policy before training)")
    why = {"use_weighting": "WPO's weights need each token's sum of squared probabilities, which the last stage "
                            "does not compute; drop it",
           "sync_ref_model": "the reference is read once, before training; drop it",
           "model_init_kwargs": "the stages are loaded by hfpipe (bf16=True for the dtype); drop it",
           "router_aux_loss_coef": "the stages add the model config's router aux loss; drop it"}
    for name, reason in why.items():
        value = getattr(args, name, None)
        if value not in (None, False, 0, {}):
            raise ConfigError(f"DPOConfig({name}={value!r}) does not run under a pipeline: {reason}")
    if quantization_config is not None:
        raise ConfigError("PipelineDPOTrainer(quantization_config=...): drop it (hfpipe's --quantize-base is not yet "
                          "exposed here)")
    if cp > 1:
        raise ConfigError(f"PipelineDPOTrainer(cp={cp}): a pair's log-probs would be summed over cp ranks, which "
                          "the preference loss does not yet do; use cp=1")


class PipelineDPOTrainer(PipelineLoop, DPOTrainer):
    """TRL's ``DPOTrainer`` whose model is split into pipeline stages over the launched processes.

    Takes ``DPOTrainer``'s arguments, with ``model`` a folder or hub id and the pipeline's keywords of
    :class:`hfpipe.hf.trainer.PipelineTrainer` (``pp``, ``dp``, ``tp``, ``ep``, ``schedule``, ``microbatches``,
    ...). ``per_device_train_batch_size`` counts pairs, as in TRL: a multiple of the microbatches (each
    microbatch holds whole pairs). ``peft_config`` gives PEFT's LoRA on the stages; its reference is the base
    with the adapters off. ``fp8``: float8 training, as :class:`~hfpipe.hf.trainer.PipelineTrainer` takes it
    (needs ``bf16=True``); the reference pass runs the same float8 linears.
    """

    def __init__(self, model, ref_model=None, args=None, *, pp: int | None = None, dp: int = 1, ep: int = 1,
                 tp: int = 1, cp: int = 1, schedule: str = "1f1b", microbatches: int | None = None,
                 layout: str | None = None, peft_config=None, fp8: str | None = None, optimizers=(None, None),
                 compute_metrics=None, quantization_config=None, processing_class=None, **kwargs):
        if args is None:
            args = DPOConfig(f"{str(model).rstrip('/').split('/')[-1]}-DPO")
        refuse_unsupported(args, compute_metrics=compute_metrics)
        refuse_dpo(args, ref_model, quantization_config, cp)
        self._preference = Preference(PreferenceConfig.from_trl(args))
        check_optimizers(optimizers)
        options = PipelineLayout(pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, schedule=schedule, microbatches=microbatches,
                                 layout=layout)
        trust = bool(getattr(args, "trust_remote_code", False))
        stages = self._start_pipeline(load_pipeline, model, args, options, peft_config, trust, fp8)
        self.pipeline.pipe.use_objective(self._preference)
        if processing_class is None:  # as TRL loads it, from the model's folder
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust)
        # With precompute_ref_log_probs=False TRL reads the reference batch by batch, from a frozen copy of the
        # model (the adapters off under LoRA): the pass before training reads the same numbers once, with no
        # second model. TRL hashes the model for its cache of that pass, which this one replaces: every rank's
        # stages (DTensors under tp) would be hashed for nothing.
        args.precompute_ref_log_probs = True
        with mock.patch.object(_trl_dpo, "hash_module", lambda module: ""):
            super().__init__(model=stages, args=args, optimizers=optimizers, processing_class=processing_class,
                             **kwargs)

    # ---- the reference pass, in place of TRL's -------------------------------------------------------
    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """``dataset`` with the columns ``ref_chosen_logps`` / ``ref_rejected_logps``, as TRL adds them."""
        from datasets import Dataset
        from torch.utils.data import DataLoader

        if not isinstance(dataset, Dataset):
            raise ConfigError(f"PipelineDPOTrainer: the {name} dataset is not a map-style Dataset; the reference "
                              "pass reads it before training (pass a datasets.Dataset)")
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
        chosen, rejected = reference_logps(self.pipeline, loader, adapters_off=self.pipeline.lora is not None,
                                           over_dp=True)
        return (dataset.add_column("ref_chosen_logps", chosen.tolist())
                .add_column("ref_rejected_logps", rejected.tolist()))

    # ---- the step and evaluation -------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device) -> int | None:
        """The step's count: its batches over dp (a batch counts 1). TRL's batches carry no labels until
        ``pair_batch`` makes them, so they are checked in :meth:`training_step`, not here."""
        if not batch_samples:
            return None
        return self._steps.step_count([self._local(b) for b in batch_samples])

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One accumulation batch of pairs through the schedule; the loss returned is the same on every rank."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        batch = pair_batch(inputs, self.pipeline.pipe.microbatches)
        [batch] = self._steps.local_batches([batch], "PipelineDPOTrainer.train", self._local)
        count = self._steps.step_count([batch]) if num_items_in_batch is None else int(num_items_in_batch)
        part = self._steps.backward(batch, count, 1)  # a batch counts 1: the step divides by its batches x dp
        self._log_pairs("train", batch, int(inputs["attention_mask"].sum()))
        return torch.tensor(self._steps.share_loss(part), dtype=torch.float32, device=self.args.device)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Each batch's mean loss over its pairs, averaged weighted by pairs, as TRL's evaluation averages it."""
        from transformers.trainer_utils import EvalLoopOutput

        self.model.eval()
        total, pairs = 0.0, 0
        for inputs in dataloader:
            inputs = self._prepare_inputs(inputs)
            n = self._global_rows(inputs["input_ids"].shape[0] // 2)
            batch = pair_batch(inputs, self.pipeline.pipe.microbatches)
            total += self._steps.eval_loss(batch) * n
            pairs += n
            self._log_pairs("eval", batch, 0)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        metrics = {f"{metric_key_prefix}_loss": total / pairs} if pairs else {}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=pairs)

    def _log_pairs(self, mode: str, batch: dict, tokens: int) -> None:
        """The batch's reward metrics (over its pairs on every dp replica) and the input tokens trained
        (``tokens`` of this replica, summed: ``num_tokens``) for TRL's log, which averages them."""
        sums = shared_pair_sums(self.pipeline, batch["input_ids"].shape[0], extra=(tokens,))
        self._total_train_tokens += int(sums[-1])
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        for key, value in reward_means(sums).items():
            self._metrics[mode][key].append(value)
