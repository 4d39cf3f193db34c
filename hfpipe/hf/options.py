"""What the Trainer faces hand ``load_pipeline`` (their layout keywords, fields of
:class:`~hfpipe.pipeline.options.PipelineLayout`, and the :class:`~hfpipe.pipeline.options.StageOptions` of
TrainingArguments), and the Trainer features a pipeline cannot run, refused by name before anything loads."""

from __future__ import annotations

import dataclasses

from hfpipe.config.names import TORCHAO_FP8_RECIPES
from hfpipe.errors import ConfigError
from hfpipe.pipeline.options import PipelineLayout, StageOptions

__all__ = ["refuse_unsupported", "check_optimizers", "check_layout_args", "float8_recipe", "load_kwargs",
           "see_the_world"]


#: TrainingArguments that cannot work under a pipeline: (name, is it set?, why and what to do).
_REFUSED_ARGS = (
    ("deepspeed", bool, "hfpipe shards the model itself (pp, dp, tp); drop the DeepSpeed config"),
    ("fsdp", bool, "dp=N gives FSDP2 over the data-parallel replicas; drop fsdp and pass dp=N"),
    ("fsdp_config", bool, "dp=N gives FSDP2 over the data-parallel replicas; drop fsdp_config"),
    ("parallelism_config", bool, "pass pp/dp/tp to PipelineTrainer instead"),
    ("predict_with_generate", bool, "generation needs the whole model: evaluate the save_model() folder"),
    ("fp16", bool, "fp16 needs a loss scaler the pipeline does not run; use bf16=True"),
    ("fp16_full_eval", bool, "use bf16=True"),
    ("bf16_full_eval", bool, "evaluation runs in the training dtype; drop it"),
    ("use_liger_kernel", bool, "Liger replaces the model's forward, which the stages do not call; drop it"),
    ("neftune_noise_alpha", lambda v: v is not None, "drop it"),
    ("label_smoothing_factor", bool, "the last stage computes the plain token loss; drop it"),
    ("load_best_model_at_end", bool, "drop it and export the best checkpoint-N with `hfpipe export`"),
    ("auto_find_batch_size", bool, "set per_device_train_batch_size yourself"),
    ("push_to_hub", bool, "push the save_model() folder yourself"),
    ("padding_free", bool, "a padding-free batch has no rows for the pipeline's microbatches; drop it"),
    ("activation_offloading", bool, "drop it"),
)
_REFUSED_SAMPLING = ("batch_rebalance",)  # its sampler shards over every rank, not over the dp replicas
_LAST_STAGE = "the loss is computed on the last stage only, from its logits and the labels; drop it"
#: A loss of the whole model's outputs has nowhere to run: the pipeline's objective is hfpipe.loss.objective's.
_WHY_REFUSED = {"compute_loss_func": "the last stage computes the pipeline's objective (the token mean) one "
                                     "microbatch at a time, never from the whole model's outputs; drop it"}


def refuse_unsupported(args, **callables) -> None:
    """Raise ConfigError naming the first TrainingArguments field or constructor argument a pipeline cannot run.

    ``callables``: the constructor's ``compute_loss_func``, ``compute_metrics``, ``model_init``, ... (set = refused).
    """
    for name, is_set, why in _REFUSED_ARGS:
        if hasattr(args, name) and is_set(getattr(args, name)):
            raise ConfigError(f"TrainingArguments({name}={getattr(args, name)!r}) does not run under a pipeline: {why}")
    if getattr(args, "train_sampling_strategy", None) in _REFUSED_SAMPLING:
        raise ConfigError(f"TrainingArguments(train_sampling_strategy={args.train_sampling_strategy!r}) shards over "
                          "every rank, not over the dp replicas; use 'random', 'sequential' or 'group_by_length'")
    for name, value in callables.items():
        if value is not None:
            raise ConfigError(f"PipelineTrainer({name}=...) is not supported: {_WHY_REFUSED.get(name, _LAST_STAGE)}")


def check_optimizers(optimizers) -> None:
    """``optimizers=``: callables that build on this rank's stages, never objects built before them."""
    import torch

    opt, sched = optimizers
    if isinstance(opt, torch.optim.Optimizer):
        raise ConfigError("PipelineTrainer(optimizers=(<optimizer>, ...)): an optimizer built before the stages "
                          "exist holds no parameters of this rank; pass a callable params -> optimizer (e.g. "
                          "functools.partial(torch.optim.AdamW, lr=1e-4)) or optimizer_cls_and_kwargs")
    if sched is not None and hasattr(sched, "state_dict"):
        raise ConfigError("PipelineTrainer(optimizers=(..., <scheduler>)): pass a callable optimizer -> scheduler "
                          "(its optimizer is built on this rank's stages)")


def check_layout_args(args, microbatches: int, shards: int = 1) -> None:
    """Each batch is cut into ``microbatches`` rows-wise: the Trainer's batch sizes must be multiples of it.
    Over ``shards`` (dp x cp) the loss is divided by the tokens of all of them, as ``average_tokens_across_devices``."""
    if shards > 1 and not getattr(args, "average_tokens_across_devices", True):
        raise ConfigError("TrainingArguments(average_tokens_across_devices=False): the pipeline divides the loss by "
                          "the tokens of every dp (and cp) shard; drop it (True is the default)")
    names = ["per_device_train_batch_size"]
    if str(getattr(args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO"):
        names.append("per_device_eval_batch_size")
    for name in names:
        size = getattr(args, name)
        if size % microbatches:
            raise ConfigError(f"TrainingArguments({name}={size}) does not divide into the pipeline's {microbatches} "
                              f"microbatches; use a multiple of {microbatches}, or pass microbatches= that divides it")


def float8_recipe(args, fp8: str | None, face: str = "PipelineTrainer") -> str | None:
    """The float8 training recipe of a Trainer run (``None``: off): the ``face``'s ``fp8=``, or hfpipe's default when
    accelerate's ``mixed_precision`` is ``"fp8"`` (``accelerate launch --mixed_precision fp8``, or
    ``ACCELERATE_MIXED_PRECISION=fp8``, which TrainingArguments reads unless ``bf16``/``fp16`` is set).

    accelerate would convert the model it prepares to torchao's float8 linears; the stages are never prepared
    (:mod:`hfpipe.hf.loop`), so hfpipe converts them itself (:mod:`hfpipe.quant.float8`: the decoder layers'
    linears, the head in bf16), computing in bf16 around the float8 matmuls as accelerate's fp8 autocasts.
    """
    accelerate_fp8 = getattr(args, "mixed_precision", "no") == "fp8"
    recipe = fp8 or (TORCHAO_FP8_RECIPES[0] if accelerate_fp8 else None)
    if recipe is None:
        return None
    if recipe not in TORCHAO_FP8_RECIPES:  # (blockwise needs a quantized base, which no Trainer face takes)
        raise ConfigError(f"{face}(fp8={recipe!r}): choose one of {', '.join(map(repr, TORCHAO_FP8_RECIPES))}")
    if not (args.bf16 or accelerate_fp8):
        raise ConfigError(f"{face}(fp8={recipe!r}) multiplies bf16 activations in float8; set "
                          f"{type(args).__name__}(bf16=True)")
    return recipe


def load_kwargs(load_pipeline, layout: PipelineLayout, args, peft_config, trust_remote_code: bool,
                fp8: str | None = None, face: str = "PipelineTrainer") -> dict:
    """``load_pipeline``'s keywords: ``layout``'s fields and the :class:`StageOptions` of TrainingArguments
    (``fp8``: the keyword of the ``face`` class, see :func:`float8_recipe`)."""
    fp8 = float8_recipe(args, fp8, face)
    checkpointing = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    # torch_compile: each decoder layer compiled in place (hfpipe.models.compile), never the Trainer's whole
    # model, which accelerate would compile in prepare() (the stages are never prepared: hf/loop.py)
    compiled = bool(getattr(args, "torch_compile", False))
    stages = StageOptions(dtype="bf16-mixed" if args.bf16 or fp8 else "fp32", lora=peft_config, seed=args.seed, fp8=fp8,
                          activation_checkpointing="full" if checkpointing else "none", compile=compiled,
                          compile_backend=args.torch_compile_backend if compiled else None,
                          compile_mode=args.torch_compile_mode if compiled else None)
    fields = {f.name: getattr(options, f.name) for options in (layout, stages) for f in dataclasses.fields(options)}
    return {**fields, "trust_remote_code": trust_remote_code}


def see_the_world(args) -> None:
    """Make ``args`` see the launched world, as the ranks of one job.

    accelerate takes a torchrun world on CPUs for single processes unless ``use_cpu`` is set: every
    rank would then believe it is rank 0, and each would log, write ``trainer_state.json`` and rotate
    checkpoints. On accelerators (and with ``use_cpu``) it sees the world already; this changes nothing.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if not torch.accelerator.is_available():
        args.dataloader_pin_memory = False  # nothing to pin for: torch would warn so once per rank
    if args.world_size > 1:
        return
    if args.device.type != "cpu":
        raise ConfigError(f"TrainingArguments sees one process on {args.device} while {dist.get_world_size()} "
                          "were launched; launch with torchrun/srun, as for DDP")
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)  # a cached_property: run the device setup again, distributed,
    args._setup_devices  # now, before the Trainer builds its Accelerator (it resets accelerate's state)
    if args.world_size != dist.get_world_size():
        raise ConfigError(f"TrainingArguments sees {args.world_size} processes of the {dist.get_world_size()} "
                          "launched; launch with torchrun/srun, as for DDP")
