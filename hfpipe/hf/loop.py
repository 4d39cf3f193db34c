"""The Trainer hooks a pipeline changes, mixed in before ``transformers.Trainer`` (or TRL's ``SFTTrainer``).

The Trainer's own loop (``_run_epoch``) still runs: it fetches ``gradient_accumulation_steps`` batches,
calls ``training_step`` on each, clips, steps the optimizer and scheduler, logs, evaluates and saves.
What differs under a pipeline is answered here, each where the Trainer asks:

- the data: every rank of one pipeline sees the same batches, the dp replicas disjoint shards
  (accelerate's own sharding, over dp instead of over every process);
- the step: the order of :meth:`hfpipe.train.step.StepEngine.step`, run piece by piece where the Trainer
  asks. ``_get_num_items_in_batch`` is the step's count (``StepEngine.step_count``: loss tokens over every
  accumulation batch and dp replica, as transformers counts them for a causal LM); ``training_step`` is
  one accumulation batch's ``StepEngine.backward``, its loss returned equal on every rank; clipping is
  ``StepEngine.clip_gradients`` (the tied halves summed, the global norm over all stages). Under cp every
  rank of a replica is handed the same whole rows and keeps its own tokens of them (``Pipeline.local``,
  labels shifted before the split): the count is taken on those, so summed over dp x cp it is the plain
  Trainer's;
- the model is never wrapped (no DDP) and the optimizer never handed to accelerate;
- evaluation: the mean of each batch's loss (token mean, plus a MoE router aux loss over the whole batch, as
  transformers' model returns it) weighted by its rows, as ``evaluation_loop`` does
  (rows counted over dp: the cp ranks of a replica hold the same rows).
"""

from __future__ import annotations

import copy
import warnings
from functools import partial

import torch
import torch.distributed as dist

from hfpipe.errors import ConfigError, ParallelError
from hfpipe.hf.options import check_layout_args, load_kwargs, see_the_world
from hfpipe.hf.saving import (export_model, find_pipeline_checkpoint, load_trainer_checkpoint, save_step_checkpoint,
                               save_scheduler)
from hfpipe.hf.stages import PipelineStages
from hfpipe.models.meta import build_meta_model
from hfpipe.pipeline.options import PipelineLayout

__all__ = ["PipelineLoop"]


class PipelineLoop:
    """Trainer overrides for a :class:`hfpipe.api.PipelineModel` held as ``self.pipeline``.

    A face calls :meth:`_start_pipeline` before ``Trainer.__init__`` and hands the Trainer what it returns.
    """

    def _start_pipeline(self, load_pipeline, model, args, options: PipelineLayout, peft_config,
                        trust_remote_code: bool, fp8: str | None = None) -> PipelineStages:
        """Load this rank's stages of ``model`` (a folder or hub id) with ``load_pipeline`` (hfpipe.api's,
        passed in by the face so that this layer stays below it); returns the module the Trainer holds.
        ``fp8``: the face's float8 recipe keyword, the same for every face (:func:`hfpipe.hf.options.float8_recipe`)."""
        if not isinstance(model, (str, bytes)) and not hasattr(model, "__fspath__"):
            raise ConfigError(f"{type(self).__name__}(model=<{type(model).__name__}>): give the model's folder or "
                              "hub id; each rank then loads only its own stages")
        if options.microbatches:  # known before loading: refuse before any process group starts
            check_layout_args(args, options.microbatches, options.dp * options.cp)
        self.pipeline = load_pipeline(str(model), **load_kwargs(load_pipeline, options, args, peft_config,
                                                                trust_remote_code, fp8, type(self).__name__))
        check_layout_args(args, self.pipeline.pipe.microbatches, options.dp * options.cp)  # the default: one per stage
        self._steps = self.pipeline.trainer(None, max_grad_norm=args.max_grad_norm)  # the Trainer steps its optimizer
        see_the_world(args)
        return PipelineStages(self.pipeline)

    # ---- data: one order per pipeline, disjoint shards over dp -------------------------------------
    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        from torch.utils.data import DataLoader, IterableDataset
        from transformers.trainer_utils import seed_worker
        from transformers.utils import is_datasets_available

        collator = self.data_collator
        if is_datasets_available() and _is_hf_dataset(dataset):  # as the Trainer asks: datasets is optional there
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        args = self.args
        params = {"batch_size": batch_size, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
                  "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
                  "multiprocessing_context": args.dataloader_multiprocessing_context,
                  "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order}
        if not isinstance(dataset, IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = args.dataloader_drop_last
            if is_training:  # workers seeded as one process of a dp-replica world would be
                params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                   rank=self.pipeline.dist.dp_rank)
        return self._shard_over_dp(DataLoader(dataset, **params))

    def _shard_over_dp(self, loader):
        """accelerate's ``prepare_data_loader`` with the accelerator's settings, over the dp replicas only.

        The Trainer's ``accelerator.prepare`` shards over every process (it takes the world for data
        parallel); the same call with ``num_processes=dp`` gives each pipeline the batches a dp-sized
        world of single processes would see, in the single-process order when dp is 1.
        """
        from accelerate.data_loader import prepare_data_loader

        acc, d = self.accelerator, self.pipeline.dist
        return prepare_data_loader(
            loader, acc.device, num_processes=d.dp, process_index=d.dp_rank, split_batches=acc.split_batches,
            put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
            dispatch_batches=False,  # dispatching broadcasts from world rank 0 to every process
            even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader)

    def get_total_train_batch_size(self, args) -> int:
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.pipeline.dist.dp

    # ---- the step ---------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device) -> int | None:
        """The step's loss tokens over every accumulation batch and dp (x cp) shard (not over every process).

        The step's batches are checked here too, once, before the step queues any work on the device: the
        values read then (ids, the count) cost no wait that the batches' copy to the device did not. A
        Python int, so that no accumulation batch reads it again.
        """
        if not batch_samples:
            return None
        local = self._steps.local_batches(batch_samples, "PipelineTrainer.train", self._local)
        return self._steps.step_count(local)

    def _local(self, inputs: dict) -> dict:
        """This rank's tokens of a batch of whole rows under cp (labels shifted first); else the batch."""
        self._check_cp_length(inputs)
        return self.pipeline.pipe.local(inputs)

    def _check_cp_length(self, inputs: dict) -> None:
        """Under cp the sequence is cut into 2 cp chunks; told in the Trainer's terms (the collator pads the
        rows), where ``ContextParallel.split_batch`` speaks the CLI's (``--seq-len``)."""
        chunks, seq = 2 * self.pipeline.dist.dims.cp, inputs["input_ids"].shape[1]
        if chunks > 2 and seq % chunks:
            raise ParallelError(f"PipelineTrainer(cp={chunks // 2}): a batch of sequence length {seq} does not "
                                f"split into {chunks} equal chunks; pad rows to a multiple of {chunks} (e.g. "
                                f"the collator's pad_to_multiple_of={chunks})")

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One accumulation batch through the schedule; the loss returned is the same on every rank."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        if num_items_in_batch is None:  # not counted (nor checked) with the step's batches
            [inputs] = self._steps.local_batches([inputs], "PipelineTrainer.train", self._local)
            tokens = self._steps.step_count([inputs])
        else:
            inputs, tokens = self._local(inputs), int(num_items_in_batch)
        # A MoE router aux loss: transformers' model adds ``coef * aux`` of its whole batch to each forward's
        # loss and the Trainer sums those over the accumulation batches (it divides by num_items_in_batch
        # only). So one batch here counts as a step of its own for the router term (the mean over its
        # microbatches and dp shards, hfpipe.models.router_loss), summed over accumulation like the plain one.
        part = self._steps.backward(inputs, tokens, 1)
        # on the device, read by the Trainer only when it logs (as its own loss)
        return self._steps.shared_loss(part).to(self.args.device, torch.float32)

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        # accelerate sums over every process: each dp replica's batch was counted by all its pp (x tp) ranks
        copies = dist.get_world_size() // self.pipeline.dist.dp if dist.is_initialized() else 1
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // copies

    def floating_point_ops(self, inputs) -> float:
        """This process's share of the batch's 6 x tokens x parameters (the Trainer's ``total_flos``, as
        ``PreTrainedModel.floating_point_ops`` counts it: embeddings left out): the Trainer sums every
        process's count, and each dp replica's batch passes through all its pp x tp x cp ranks."""
        if getattr(self, "_flop_params", None) is None:
            self._flop_params = _counted_parameters(self.pipeline)
        copies = dist.get_world_size() // self.pipeline.dist.dp if dist.is_initialized() else 1
        return 6 * inputs["input_ids"].numel() * self._flop_params / copies

    def _clip_grad_norm(self, model):
        return self._steps.clip_gradients()  # a tensor on the device, as the Trainer's clip_grad_norm_ returns

    def _get_grad_norm(self, model, grad_norm=None):
        # max_grad_norm == 0: the Trainer asks for the norm alone (the tied halves still need summing)
        return self._steps.clip_gradients() if grad_norm is None else grad_norm

    # ---- optimizer, scheduler, resume: the stages are never wrapped --------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The optimizer and scheduler from TrainingArguments (or ``optimizers=``), and a resume; no
        ``accelerator.prepare``: it would wrap the stages in DDP over every process."""
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def create_optimizer(self, model=None):
        if callable(self.optimizer) and not isinstance(self.optimizer, torch.optim.Optimizer):
            self.optimizer = self.optimizer(self.pipeline.parameters())  # optimizers=(params -> optimizer, ...)
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if callable(self.lr_scheduler) and not hasattr(self.lr_scheduler, "state_dict"):
            self.lr_scheduler = self.lr_scheduler(optimizer or self.optimizer)  # (..., optimizer -> scheduler)
        return super().create_scheduler(num_training_steps, optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        find_pipeline_checkpoint(resume_from_checkpoint)  # the model loads with the optimizer, below

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:
            load_trainer_checkpoint(self, checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_scheduler(self, output_dir)  # the optimizer went into hfpipe's checkpoint with the model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An HF folder ``from_pretrained`` loads (a PEFT adapter folder under ``peft_config``); inside
        ``checkpoint-N`` (``_internal_call``), hfpipe's DCP checkpoint of model and optimizer instead."""
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            save_step_checkpoint(self, output_dir)
        else:
            export_model(self, output_dir)

    # ---- evaluation --------------------------------------------------------------------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Each batch's loss (over its dp shards: ``StepEngine.eval_loss``, the model's ``loss`` with a router aux
        loss), averaged weighted by rows, as transformers' ``evaluation_loop`` averages ``loss.repeat(batch_size)``."""
        from transformers.trainer_utils import EvalLoopOutput

        self.model.eval()
        total, rows = 0.0, 0
        for inputs in dataloader:
            inputs = self._prepare_inputs(inputs)
            n = self._global_rows(inputs["input_ids"].shape[0])
            self._check_cp_length(inputs)
            total += self._steps.eval_loss(inputs) * n  # whole rows: it takes this rank's tokens itself
            rows += n
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        metrics = {f"{metric_key_prefix}_loss": total / rows} if rows else {}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=rows)

    def _global_rows(self, rows: int) -> int:
        """Rows of a batch over the dp replicas (the batch group also holds the cp ranks, which share rows)."""
        d = self.pipeline.dist
        if d.batch_group is None:
            return rows
        t = torch.tensor(rows, device=d.device)
        dist.all_reduce(t, group=d.batch_group)
        return int(t) // d.dims.cp

    def predict(self, *args, **kwargs):
        raise ConfigError("PipelineTrainer.predict(): the logits live on the last stage only; use evaluate() for "
                          "the loss, or predict with the save_model() folder")

    def prediction_step(self, *args, **kwargs):
        raise ConfigError("PipelineTrainer.prediction_step(): the model runs only through the schedule; use "
                          "evaluate() for the loss")


def _counted_parameters(pipeline) -> int:
    """The parameters transformers' ``floating_point_ops`` counts for this model: the whole model's but the
    embeddings, with PEFT's adapters under LoRA (the plain Trainer counts them on its PeftModel), on the meta
    device."""
    meta = build_meta_model(pipeline.source.config)
    if pipeline.lora is not None:
        from peft import get_peft_model  # here: only LoRA runs need PEFT

        with warnings.catch_warnings():  # PEFT asks the meta model a deprecated question; nothing to tell
            warnings.simplefilter("ignore", FutureWarning)
            meta = get_peft_model(meta, copy.deepcopy(pipeline.lora))
    return meta.num_parameters(exclude_embeddings=True)


def _is_hf_dataset(dataset) -> bool:
    import datasets

    return isinstance(dataset, datasets.Dataset)
