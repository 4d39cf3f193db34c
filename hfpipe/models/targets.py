"""Which linear layers a quantized base keeps quantized: every one inside a decoder layer but a router.

A floor module shared by loading (:mod:`hfpipe.quant.linear`) and merging (:mod:`hfpipe.quant.merged`).
A MoE router stays in the run's dtype: its logits pick the experts, and a rounding there would
change which experts run, not just how precisely. So does a linear subclass with a forward of its own.
"""

from __future__ import annotations

from torch import nn

__all__ = ["ROUTERS", "quantized_linears", "plain_linear"]

#: Name endings of the linears that stay in the run's dtype: MoE routers.
ROUTERS = ("mlp.gate", "router")


def quantized_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Full-model name -> each ``nn.Linear`` of ``module``'s decoder layers that gets quantized."""
    out = {}
    for name, sub in module.named_modules():
        if plain_linear(sub) and ".layers." in f".{name}" and not name.endswith(ROUTERS):
            out[name] = sub
    return out


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` that multiplies as one: a subclass with its own forward (DeepSeek-V4's grouped
    ``o_a_proj``, block-diagonal over head groups) stays in the run's dtype, as the FP8 linear would drop
    its forward. A class that multiplies as ``nn.Linear`` does says so with ``plain_linear = True`` (the FP8
    linear: all-linear is resolved on stages that already hold it)."""
    return isinstance(module, nn.Linear) and getattr(module, "plain_linear", type(module).forward is nn.Linear.forward)
