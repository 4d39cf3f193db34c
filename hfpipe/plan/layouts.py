"""How one tensor-parallel rank holds each activation a layer saves: whole, by sequence, or split.

Korthikanti et al. split a GPT block's ``34 h`` bytes per token into ``24 h`` that tensor
parallelism divides and ``10 h`` that only sequence parallelism does. hfpipe's layers are not GPT
blocks, and what torch's styles keep is not Megatron's: a column-split projection saves the input
its block gathered over the sequence, *whole* on every tp rank (Megatron re-gathers it in backward
instead), and a LoRA adapter on it keeps its own fp32 copy of that whole input (5 per Llama layer:
q, k, v, gate, up). Splitting the measured bytes by the ratio under-priced a tp2 LoRA run 14%.

So the measurement (:mod:`hfpipe.plan.activations`) runs the layer at tp 1 under :class:`Layouts`,
a dispatch mode that follows each tensor from the layer's input through every op and tags it with
how the runtime's tp plan (:func:`hfpipe.parallel.tensor_plan.stage_tp_plan`, the runtime's own,
and :mod:`hfpipe.lora.tensor`'s split of the adapters) leaves it on a rank:

- ``SEQ``: the residual stream and what the norms make of it; split by sequence under sequence
  parallelism, whole without.
- ``WHOLE``: replicated on every rank: a block's gathered input (what a matmul on a layer weight
  reads), what whole modules (a router, MLA's down-projections, ``lora_A`` on a column-split base)
  make of it, a row-split matmul's partial output before its sum (routed experts), rotary tables.
- ``SPLIT``: 1/tp on each rank: a column-split matmul's output (heads, the MLP's intermediate) and
  everything made from it (attention, activations), a row-split matmul's input.

An op's output takes the most split of its inputs' tags, except a matmul on a styled weight, whose
output is its style's. The saved bytes of each tag are then counted as the run keeps them.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Layouts", "SEQ", "SPLIT", "WHOLE", "share", "weight_styles"]

WHOLE, SEQ, SPLIT = 0, 1, 2

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def share(held: tuple[int, int, int], tp: int, sp: bool) -> float:
    """Bytes one tp rank keeps of ``held`` = (whole, by sequence, split) bytes measured at tp 1."""
    whole, seq, split = held
    return whole + seq / (tp if sp else 1) + split / tp


def weight_styles(stage: torch.nn.Module, config, experts_whole: bool = False) -> dict[int, int]:
    """Storage address of each weight the runtime splits -> the tag of the matmul output it makes.

    ``stage`` is the measured stage under the full model's module names (with PEFT's adapters if any:
    they follow their base layer's split, as :func:`hfpipe.lora.tensor.split_adapters` splits them).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hfpipe.parallel.tensor_plan import _Experts, stage_tp_plan

    modules = dict(stage.named_modules())
    names = [n.replace(".base_layer", "") for n in modules]  # the plan names a PEFT-wrapped linear as before
    # which module splits how does not depend on how many ranks (tp 1: no divisibility to check)
    plan = stage_tp_plan(config, names, True, 1, experts_whole=experts_whole)
    styles: dict[int, int] = {}

    def mark(module, tag: int) -> None:
        for p in module.parameters(recurse=False):
            styles[p.untyped_storage().data_ptr()] = tag

    for name, style in plan.items():
        module = modules.get(name)
        while hasattr(module, "base_layer"):  # PEFT's wrappers, nested on a stack of experts (one per parameter)
            module = module.base_layer
        if module is None:
            continue
        if isinstance(style, ColwiseParallel):
            mark(module, SPLIT)
        elif isinstance(style, RowwiseParallel):  # summed: reduce-scattered into the residual, or whole
            mark(module, SEQ if _to_sequence(style) else WHOLE)
        elif isinstance(style, _Experts):  # rows of gate_up, a partial (whole-sized) output of down
            styles[module.gate_up_proj.untyped_storage().data_ptr()] = SPLIT
            styles[module.down_proj.untyped_storage().data_ptr()] = WHOLE
        wrapper = modules.get(name)
        # colwise base: lora_B splits its output; rowwise: lora_A its input (--tp refuses adapters on the experts,
        # whose stacks have no single weight)
        if hasattr(wrapper, "lora_A") and hasattr(module, "weight"):
            colwise = isinstance(style, ColwiseParallel)
            for adapter in (wrapper.lora_B if colwise else wrapper.lora_A).values():
                mark(adapter, SPLIT if colwise else styles.get(module.weight.untyped_storage().data_ptr(), WHOLE))
    return styles


def _to_sequence(style) -> bool:
    from torch.distributed.tensor import Shard

    layouts = style.output_layouts
    return any(isinstance(p, Shard) for p in (layouts if isinstance(layouts, tuple) else (layouts,)))


class Layouts(TorchDispatchMode):
    """Tags every tensor made under it WHOLE, SEQ or SPLIT (module docstring); :meth:`tag` reads them.

    Args:
        styles: :func:`weight_styles`: a split weight's storage address -> its matmul output's tag.
        weights: Storage addresses of every parameter (a weight carries no tag of its own).
    """

    def __init__(self, styles: dict[int, int], weights: set[int]):
        super().__init__()
        self.styles, self.weights = styles, weights
        self.tags: dict[int, int] = {}

    def set(self, t: torch.Tensor, tag: int) -> None:
        self.tags[t.untyped_storage().data_ptr()] = tag

    def tag(self, t: torch.Tensor) -> int:
        """A tensor's tag; one made outside the layer's ops (a buffer, a constant) is whole."""
        return self.tags.get(t.untyped_storage().data_ptr(), WHOLE)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        acts = [t for t in inputs if t.untyped_storage().data_ptr() not in self.weights]
        weight = [t.untyped_storage().data_ptr() for t in inputs if t.untyped_storage().data_ptr() in self.weights]
        tag = max((self.tag(t) for t in acts), default=WHOLE)
        if weight and (func in _MATMULS or func.overloadpacket is torch.ops.aten._grouped_mm):
            for t in acts:  # a block reads its input gathered over the sequence: the saved copy is whole
                if self.tag(t) == SEQ:
                    self.set(t, WHOLE)
            tag = self.styles.get(weight[0], max((self.tag(t) for t in acts), default=WHOLE))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.set(t, tag)
        return out
