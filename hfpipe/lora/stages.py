"""``apply_lora``: PEFT's adapters on a rank's loaded stages, the build step of ``--lora-rank``.

PEFT injects and initialises them (:mod:`hfpipe.lora.adapters`) after the stages are loaded, since it
initialises from the seed on real tensors; quantized or ep-sharded experts get theirs through hfpipe's
experts forward (:mod:`hfpipe.lora.experts`); under ``--tp`` each adapter is then split as its base layer
is (:mod:`hfpipe.lora.tensor`).
"""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.lora.adapters import add_adapters, resolve_config
from hfpipe.lora.experts import attach_expert_adapters, stacks_as_parameters
from hfpipe.lora.tensor import check_tp_lora, split_adapters
from hfpipe.parallel.tensor_plan import stage_tp_plan

__all__ = ["apply_lora"]


def apply_lora(modules: list[nn.Module], lora, *, seed: int, dtype: torch.dtype, tp_mesh=None,
               sequence_parallel: bool = True, experts_whole: bool = False):
    """PEFT's LoRA adapters on the loaded stage ``modules`` (base frozen); returns the resolved ``LoraConfig``.

    Args:
        modules: This rank's loaded stage modules.
        lora: A ``peft.LoraConfig``, or ``None`` (nothing to do).
        seed: Seeds each adapter's initialisation.
        dtype: The run's parameter dtype (the adapters' masters; quantized expert stacks are adapted as
            parameters of it).
        tp_mesh: The tp mesh the bases are split over, or ``None``.
        sequence_parallel, experts_whole: As the bases were split (:func:`hfpipe.parallel.tensor.apply_tp`).
    """
    if lora is None:
        return None
    lora = resolve_config(lora, modules[0]._hf_model)
    plans = _tp_plans(modules, tp_mesh, lora, sequence_parallel, experts_whole)  # by the names PEFT is about to wrap
    with stacks_as_parameters(modules, dtype):  # quantized expert stacks: PEFT adapts parameters
        add_adapters(modules, lora, seed=seed, master_dtype=dtype)
    attach_expert_adapters(modules)  # quantized or ep-split experts: hfpipe's experts forward adapts them
    if tp_mesh is not None:
        split_adapters(modules, plans, tp_mesh)
    return lora


def _tp_plans(modules: list[nn.Module], tp_mesh, lora, sequence_parallel: bool, experts_whole: bool) -> list | None:
    """Each stage's tp plan, as :func:`hfpipe.parallel.tensor.apply_tp` split its bases."""
    if tp_mesh is None:
        return None
    check_tp_lora(lora, tp_mesh.size())
    return [stage_tp_plan(m.config, [n for n, _ in m.named_modules()], sequence_parallel, tp_mesh.size(),
                          experts_whole) for m in modules]
