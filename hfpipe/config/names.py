"""The names every layer of the config shares: the schedule spellings and the config error.

They sit below both :mod:`hfpipe.config.run` (the dataclass) and :mod:`hfpipe.config.checks` (its
checks), so the checks need not import the dataclass they check.
"""

from hfpipe.errors import ConfigError
from hfpipe.parallel.rules import INTERLEAVED_SCHEDULES, SCHEDULES, V_SCHEDULES

__all__ = ["ConfigError", "SCHEDULES", "INTERLEAVED_SCHEDULES", "V_SCHEDULES", "QUANTIZE_BASE", "OTHER_NAMES",
           "FP8_RECIPES", "TORCHAO_FP8_RECIPES", "check_fp8", "check_other_names"]

#: Formats a LoRA run's frozen base can be kept in on the device (``--quantize-base``).
QUANTIZE_BASE = ("nf4", "fp8")
#: torchao's float8 training recipes, rowwise (torchtitan's default) first: what a bf16 base takes.
TORCHAO_FP8_RECIPES = ("rowwise", "tensorwise")
#: Float8 training's recipes (``--fp8-recipe``): torchao's, then DeepSeek-V3's tiles, which a ``--quantize-base
#: fp8`` base multiplies its own codes by (hfpipe.quant.fp8_matmul).
FP8_RECIPES = (*TORCHAO_FP8_RECIPES, "blockwise")


def check_fp8(recipe: str | None, dtype: str, quantize_base: str | None) -> None:
    """Refuse float8 training (``recipe``, or ``None``: off) with what it cannot run with, in one line."""
    if recipe is None:
        return
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}; got {recipe!r}")
    if quantize_base == "nf4":
        raise ConfigError("--fp8 with --quantize-base nf4: an NF4 base dequantizes each weight for its matmul "
                          "(NF4 codes are not float8); drop one of the two, or use --quantize-base fp8")
    if quantize_base == "fp8" and recipe != "blockwise":
        raise ConfigError(f"--fp8-recipe {recipe} casts a full-precision weight; a --quantize-base fp8 base keeps "
                          "its FP8 codes in tiles: use --fp8-recipe blockwise")
    if quantize_base is None and recipe == "blockwise":
        raise ConfigError("--fp8-recipe blockwise multiplies a block-FP8 base's own tiles: add --quantize-base fp8 "
                          "(a LoRA run), or use rowwise or tensorwise")
    if quantize_base is None and dtype == "fp32":  # torchao casts the bf16 compute copies; fp32 has none
        raise ConfigError("--fp8 multiplies bf16 activations in float8; use --dtype bf16-mixed (or bf16), not fp32")


#: Keys users bring from transformers' TrainingArguments, TRL, PEFT and torchtune recipes, and the
#: field each one is here: too far from the field's name for a spelling match to find it.
OTHER_NAMES = {
    "learning_rate": "lr", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "max_seq_length": "seq_len", "max_length": "seq_len",
    "max_seq_len": "seq_len", "seq_length": "seq_len", "model_name_or_path": "model",
    "lr_scheduler_type": "lr_schedule", "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps",
    "gradient_checkpointing": "activation_checkpointing", "enable_activation_checkpointing":
    "activation_checkpointing", "save_steps": "save_every", "logging_steps": "log_every",
    "eval_steps": "eval_every", "save_total_limit": "keep", "r": "lora_rank", "lora_r": "lora_rank",
    "target_modules": "lora_targets", "lora_target_modules": "lora_targets", "adam_epsilon": "eps",
    "adam_beta1": "betas", "adam_beta2": "betas",
    "bf16": "dtype", "fp16": "dtype", "dataset_name": "dataset", "dataset_text_field": "format",
    "resume_from_checkpoint": "resume", "output": "output_dir",
}


def check_other_names(d, source: str) -> None:
    """Refuse a key that is another library's name for a field, naming the field (``did you mean lr?``)."""
    for key in d:
        if key in OTHER_NAMES:
            raise ConfigError(f"{source}: unknown key {key!r} (did you mean {OTHER_NAMES[key]}? "
                              f"hfpipe's name for {key})")
