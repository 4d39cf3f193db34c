"""Every check a :class:`~hfpipe.config.run.FinetuneConfig` passes when it is built.

Kept apart from the dataclass so that the fields (and their help) read as one list. Each check
raises :class:`~hfpipe.config.run.ConfigError` naming the flag to change; :func:`check` runs them
all, in order: types first (a YAML ``"4"`` for an int is refused, not guessed), then choices,
finiteness, ranges, the parallel layout (:func:`hfpipe.parallel.rules.check_layout`: the vpp a schedule
implies, microbatches), evaluation/reporting, LoRA.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import yaml

from hfpipe.config.names import FP8_RECIPES, QUANTIZE_BASE, SCHEDULES, ConfigError, check_fp8
from hfpipe.config.preference import check_method
from hfpipe.parallel.dims import ParallelDims
from hfpipe.parallel.rules import check_layout

__all__ = ["REPORTS", "check", "check_keys", "load_yaml", "yaml_problem"]

_CHOICES = {
    "schedule": SCHEDULES,
    "plan_method": ("even", "weighted", "balanced"),
    "lr_schedule": ("cosine", "linear", "constant"),
    "dtype": ("fp32", "bf16-mixed", "bf16", "fp64"),
    "activation_checkpointing": ("none", "full", "selective"),
    "fp8_recipe": FP8_RECIPES,
}
_AT_LEAST_ONE = ("seq_len", "batch_size", "grad_accum", "epochs", "keep", "log_every")
_NONE_OR_AT_LEAST_ONE = ("microbatches", "max_steps", "save_every", "threads_per_rank")
_AT_LEAST_ZERO = ("warmup_steps", "seed", "min_lr", "weight_decay")


def check(c: "FinetuneConfig") -> None:
    """Coerce every field to its declared type, then run every check (``__post_init__``)."""
    hints = typing.get_type_hints(type(c))
    for f in dataclasses.fields(c):
        setattr(c, f.name, _coerce(f.name, getattr(c, f.name), hints[f.name]))
    _check_choices(c)
    _check_finite(c)
    _check_ranges(c)
    _check_bounds(c)
    _check_layout(c)
    _check_eval_and_reports(c)
    _check_lora(c)
    if c.fp8_recipe != FP8_RECIPES[0] and not c.fp8:
        raise ConfigError(f"--fp8-recipe {c.fp8_recipe} applies with --fp8; add --fp8")
    check_fp8(c.fp8_recipe if c.fp8 else None, c.dtype, c.quantize_base)
    check_method(c)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` as the field's declared type, or a ConfigError naming the flag."""
    args = typing.get_args(hint)
    if type(None) in args:  # `X | None`
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    flag, is_number = _flag(name), isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and is_number:
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-5` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{flag} must not be empty")
        return value
    if typing.get_origin(hint) is dict and isinstance(value, (str, dict)):
        from hfpipe.data.config import parse_mapping

        try:
            return parse_mapping(flag, value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):
        if len(value) == len(typing.get_args(hint)):
            return tuple(_coerce(name, v, t) for v, t in zip(value, typing.get_args(hint)))
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    want = kind.get(hint, f"a list of {len(typing.get_args(hint))} numbers")
    want = "NAME=NEW pairs" if typing.get_origin(hint) is dict else want
    raise ConfigError(f"{flag} must be {want}, got {value!r}")


def check_keys(d: Mapping[str, Any], source: str, names: list[str]) -> None:
    """Refuse a key of `d` that is not one of the config's field `names`, suggesting the closest."""
    for key in d:
        if key in names:
            continue
        close = difflib.get_close_matches(str(key).replace("-", "_"), names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(names)}"
        raise ConfigError(f"{source}: unknown key {str(key)!r} ({hint})")


def _check_choices(c: "FinetuneConfig") -> None:
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        if value not in choices:
            close = difflib.get_close_matches(value.lower(), choices, n=1)
            if name == "dtype" and value.lower() in ("fp16", "float16", "half"):  # spelt nearer fp64; means bf16
                close = ["bf16"]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{_flag(name)} must be one of {', '.join(choices)}; got {value!r}{hint}")


def _check_finite(c: "FinetuneConfig") -> None:
    """nan passes every ``<`` check and inf trains into NaN weights: refuse both by name."""
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{_flag(f.name)} must be a finite number, got {v}")
    if c.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {c.timeout}")


def _check_ranges(c: "FinetuneConfig") -> None:
    ParallelDims(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp, ep=c.ep)  # the degrees, checked where every layout is
    for name in _AT_LEAST_ONE + _NONE_OR_AT_LEAST_ONE:
        value = getattr(c, name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)} must be >= 1, got {value}")
    for name in _AT_LEAST_ZERO:
        if getattr(c, name) < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0, got {getattr(c, name)}")
    if c.lr < 0:  # 0 is allowed: a run that must leave the weights as they are checks a round trip
        raise ConfigError(f"--lr must be >= 0, got {c.lr}")
    for name in ("eps", "max_grad_norm"):
        value = getattr(c, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{_flag(name)} must be > 0, got {value}")
    if c.min_lr > c.lr:
        raise ConfigError(f"--min-lr ({c.min_lr}) must be <= --lr ({c.lr})")
    if not all(0.0 <= b < 1.0 for b in c.betas):
        raise ConfigError(f"--betas must both be in [0, 1), got {list(c.betas)}")


#: Largest values the workers can hold: ints go into int64 tensors, the seed into numpy and torch
#: generators, the timeout into C++ chrono milliseconds (gloo overflows beyond ~1e10 s).
_INT_MAX = 2**63 - 1
_SEED_MAX = 2**32 - 1
_TIMEOUT_MAX = 365 * 24 * 3600.0


def _check_bounds(c: "FinetuneConfig") -> None:
    """Refuse values that would overflow in a worker, minutes later and as a crash of one rank."""
    if c.seed > _SEED_MAX:
        raise ConfigError(f"--seed must be < 2**32 (4294967296), got {c.seed}")
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value > _INT_MAX:
            raise ConfigError(f"{_flag(f.name)} {value} is too large (at most 2**63 - 1)")
    if c.timeout > _TIMEOUT_MAX:
        raise ConfigError(f"--timeout must be at most {_TIMEOUT_MAX:.0f} seconds (a year), got {c.timeout:g}")


def _check_layout(c: "FinetuneConfig") -> None:
    """The parallel layout's rules (hfpipe.parallel.rules, as the API and plan check them); vpp left at 1
    becomes the 2 a multi-stage schedule needs."""
    layout = check_layout(c.dims, c.schedule, vpp=c.vpp, microbatches=c.microbatches, batch_size=c.batch_size,
                          reshard_per_microbatch=c.reshard_per_microbatch, lora=c.lora_rank is not None,
                          quantize_base=c.quantize_base, seq_len=c.seq_len, compile=c.compile,
                          sequence_parallel=c.sequence_parallel)
    c.vpp = layout.vpp


REPORTS = ("jsonl", "tensorboard", "wandb", "none")


def _check_eval_and_reports(c: "FinetuneConfig") -> None:
    if c.eval_fraction is not None and not 0.0 < c.eval_fraction < 1.0:
        raise ConfigError(f"--eval-fraction must be between 0 and 1, got {c.eval_fraction}")
    if c.eval_fraction is not None and (c.eval_dataset or c.eval_split):
        raise ConfigError("--eval-fraction holds out part of --dataset; leave out --eval-dataset "
                          "and --eval-split, or --eval-fraction")
    for name in ("eval_every", "eval_batches"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(c, name)}")
    if not c.evaluates:
        used = [n for n in ("eval_every", "eval_batches", "keep_best") if getattr(c, n)]
        if used:
            raise ConfigError(f"{_flag(used[0])} needs an evaluation set: pass --eval-dataset, "
                              "--eval-split or --eval-fraction")
    names = [n.strip() for n in c.report_to.split(",") if n.strip()]
    for name in names:
        if name not in REPORTS:
            close = difflib.get_close_matches(name, REPORTS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"--report-to {name!r} is unknown; choose from {', '.join(REPORTS)}{hint}")
    if "none" in names and len(names) > 1:
        raise ConfigError(f"--report-to none cannot be combined with {c.report_to!r}")
def _check_lora(c: "FinetuneConfig") -> None:
    import re

    if c.quantize_base is not None and c.quantize_base not in QUANTIZE_BASE:
        raise ConfigError(f"--quantize-base must be one of {', '.join(QUANTIZE_BASE)}; got {c.quantize_base!r}")
    if c.quantize_block_size is not None and (c.quantize_base is None or c.quantize_block_size < 1):
        raise ConfigError("--quantize-block-size takes a positive size and applies with --quantize-base only")
    if c.lora_rank is None:
        for name, default in (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_targets", "all-linear"),
                              ("quantize_base", None), ("quantize_block_size", None)):
            if getattr(c, name) != default:
                raise ConfigError(f"{_flag(name)} applies to LoRA runs only; add --lora-rank R (e.g. 16)")
        return
    if c.lora_rank < 1:
        raise ConfigError(f"--lora-rank must be >= 1, got {c.lora_rank}")
    if c.lora_alpha is not None and c.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha must be > 0, got {c.lora_alpha}")
    if not 0.0 <= c.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {c.lora_dropout}")
    names = [t.strip() for t in c.lora_targets.split(",")]
    if c.lora_targets != "all-linear" and not all(re.fullmatch(r"[A-Za-z0-9_.]+", t) for t in names):
        raise ConfigError(f"--lora-targets must be all-linear or a comma list of module names like "
                          f"q_proj,v_proj; got {c.lora_targets!r}")


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> Any:
    """A recipe file's data: a regular file (a FIFO would block), valid YAML, no doubled keys."""
    from hfpipe.files import check_regular

    try:
        check_regular(path, "recipe ")
        return yaml.load(path.read_text(), Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the recipe as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(e)}") from None


def yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}" if mark else problem
