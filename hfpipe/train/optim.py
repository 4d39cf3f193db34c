"""AdamW with the usual no-decay groups, and the LR schedule (warmup then cosine/linear/constant)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from hfpipe.errors import ConfigError
from hfpipe.pipeline.params import by_mesh, unique_parameters

__all__ = ["unique_parameters", "param_groups", "build_optimizer", "lr_lambda", "build_scheduler"]


def param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases (1-D tensors) get no weight decay. Each group holds tensors of
    one device mesh (:func:`hfpipe.pipeline.params.by_mesh`)."""
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [{"params": run, "weight_decay": wd} for params, wd in ((decay, weight_decay), (no_decay, 0.0))
              for run in by_mesh(params) or [[]]]
    # A rank whose stages are all empty (a layout like ``E||t*30|L``) keeps one empty group: torch
    # optimizers refuse an empty parameter list but accept a group without parameters.
    return [g for g in groups if g["params"]] or groups[:1]


def build_optimizer(modules, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over ``modules``' parameters; fused on CUDA, foreach elsewhere."""
    named = unique_parameters(modules)
    on_cuda = all(p.is_cuda for _, p in named)
    kwargs = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(param_groups(named, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **kwargs)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ConfigError(f"--lr-schedule {schedule!r} is unknown; choose cosine, linear or constant")
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer, *, warmup_steps: int, total_steps: int, schedule: str = "cosine",
                    lr: float, min_lr: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following :func:`lr_lambda` (its state dict checkpoints the step)."""
    fn = partial(lr_lambda, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule,
                 min_ratio=(min_lr / lr) if lr else 0.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def load_scheduler_state(scheduler, state: dict) -> None:
    """``scheduler.load_state_dict(state)`` for a state saved under another layout.

    The optimizer's parameter groups follow the layout (one per device mesh under --tp and FSDP2,
    :func:`hfpipe.pipeline.params.by_mesh`), so a run resumed at another tp, pp or dp can have another
    number of groups than the saved one. Every group follows the one schedule of
    :func:`build_scheduler` from the same lr, so the saved per-group entries are one value repeated:
    it is given to each of this run's groups.
    """
    groups = len(scheduler.optimizer.param_groups)
    state = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        entries = state.get(key)
        if isinstance(entries, list) and entries and len(entries) != groups:
            if any(e != entries[0] for e in entries):
                raise ValueError(f"scheduler state: {key} differs between parameter groups; cannot map it "
                                 f"onto {groups} groups")
            state[key] = [entries[0]] * groups
    scheduler.load_state_dict(state)
