"""``torch.compile`` on each decoder layer of a stage (``--compile``), as torchtitan compiles each
transformer block: after the axes that change a layer's parameters (tp, the quantized base, LoRA) and its
activation checkpointing, before FSDP2 wraps it (:mod:`hfpipe.pipeline.build` keeps the order).

A layer is compiled in place (``nn.Module.compile``): it stays the same module under the same name, so
``state_dict()``, DCP checkpoints, LoRA keys and exports keep the full model's names. ``torch.compile(layer)``
would wrap it in an ``OptimizedModule`` and put ``_orig_mod.`` into every key below it.

Shapes are dynamic the automatic way (``dynamic=None``): a layer compiles for the first sequence length it
sees, and once more, with the length (and the rows) symbolic, at the first other one; later lengths reuse that
graph. A batch with padding hands the layers a mask and one without none, which is one more graph each. So a
run compiles a handful of graphs, not one per step; every compile after a frame's first is logged
(:func:`watch_recompiles`) so a run that keeps recompiling says so. Identical layers share their graphs
(torch inlines the module and passes its parameters as inputs), so a deep stage compiles as fast as a shallow one.

The compiled forward is exact in the sense hfpipe tests: on CPU (inductor, fp32) a pipeline with compiled
layers matches eager transformers within 1e-5 (``tests/models/test_models_compile.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["COMPILE_MODES", "CompileSpec", "apply_compile", "watch_recompiles"]

log = logging.getLogger(__name__)

#: Graphs torch may compile per frame before it runs the frame eagerly (its default is 8).
_RECOMPILE_LIMIT = 64
#: ``torch.compile``'s modes (``None``: its default).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileSpec:
    """How the layers are compiled: torch's backend and mode (``None``: torch's default)."""

    backend: str = "inductor"
    mode: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the backend or mode torch does not know (before anything loads)."""
        from torch._dynamo import list_backends  # torch._dynamo takes seconds to import: only when compiling

        known = list_backends(exclude_tags=())
        if self.backend not in known:
            raise ValueError(f"torch.compile backend {self.backend!r} is unknown; choose one of {', '.join(known)}")
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"torch.compile mode {self.mode!r} is unknown; choose one of "
                             f"{', '.join(m for m in COMPILE_MODES if m)}")


def apply_compile(modules: list, spec: CompileSpec | None, sub_meshes: bool = False) -> int:
    """Compile every decoder layer of ``modules`` in place (nothing when ``spec`` is ``None``); return how many.

    ``sub_meshes``: DTensors on a part of the world's ranks (a tp or ep mesh) reach the layers; torch's
    AOTAutograd cache is then turned off in this process (:func:`_no_cache_across_groups`).
    Nothing is traced here: each layer compiles on its first call, so the first step is slow.
    """
    if spec is None:
        return 0
    import torch._dynamo  # takes seconds to import: only when compiling

    if sub_meshes:
        _no_cache_across_groups()

    # One frame serves every layer of a stage, and torch runs a frame eagerly, for good, after 8 graphs: a
    # family with two kinds of layer (DeepSeek-V3's dense and MoE) times mask or none, one length or a symbolic
    # one, already makes 8 in training (measured), before evaluation's graphs.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _RECOMPILE_LIMIT)
    watch_recompiles()
    count = 0
    for m in modules:
        for layer in m.model.layers.values():
            # fullgraph=False: a layer torch cannot trace whole (an axis's collective with data-dependent
            # splits, a library's Python) runs its untraceable pieces eagerly instead of failing the run.
            layer.compile(backend=spec.backend, mode=spec.mode, dynamic=None, fullgraph=False)
            count += 1
    return count


def _no_cache_across_groups() -> None:
    """Turn off torch's AOTAutograd cache (on disk, shared by every rank of a node and by later runs).

    A compiled graph names the process groups it calls by their registered names ("11": ranks 0 and 1, "12":
    ranks 2 and 3), but the cache keys a graph whose mesh comes only with a DTensor input by the mesh's
    ``_stable_hash``: the world's ranks and the sub-mesh's shape, the same for every tp group. So the ranks
    of one stage load the graph another stage's tp group compiled (a PrepareModuleOutput's gather, identical
    on every stage) and fail on its group ("Could not resolve the process group registered under the name
    12"; torch 2.13, tests/models/test_models_compile.py). Inductor's own FX graph cache stays on: its key is
    the graph after AOTAutograd, group names included, so each group keeps its kernels cached.
    """
    import torch._functorch.config as functorch_config

    if functorch_config.enable_autograd_cache:
        functorch_config.enable_autograd_cache = False
        log.info("torch.compile: AOTAutograd's cache is off in this process (its key does not tell apart "
                 "the tp groups whose process groups a compiled graph calls); inductor's cache stays on")


class _Recompiles:
    """Counts torch's compiles by frame and logs every one after a frame's first (torch's compile-start hook)."""

    def __init__(self):
        self.count = 0

    def __call__(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger is not CallbackTrigger.DYNAMO:
            return  # a deferred backward, autotuning: part of a compile already counted
        frame, _, attempt = str(args.compile_id).strip("[]").partition("/")
        if attempt.split("_")[0] not in ("", "0"):
            self.count += 1
            log.info("torch.compile: compiling frame %s again (compile %s; %d recompiles so far): new shapes or "
                     "inputs; TORCH_LOGS=recompiles names the guard that failed", frame, args.compile_id, self.count)


_WATCH: list[_Recompiles] = []  # torch's hooks are per process: one watcher per process, installed once


def watch_recompiles() -> _Recompiles:
    """The process's recompile watcher (installed into torch's compile-start hooks on first use): its ``count``
    is the recompiles seen since."""
    if not _WATCH:
        from torch._dynamo.callback import on_compile_start

        _WATCH.append(on_compile_start(_Recompiles()))
    return _WATCH[0]
