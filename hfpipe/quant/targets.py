"""Which linear layers a quantized base keeps quantized: every one inside a decoder layer but a router.

A floor module shared by loading (:mod:`hfpipe.quant.linear`) and merging (:mod:`hfpipe.quant.merged`).
A MoE router stays in the run's dtype: its logits pick the experts, and a rounding there would
change which experts run, not just how precisely.
"""

from __future__ import annotations

from torch import nn

__all__ = ["ROUTERS", "quantized_linears"]

#: Name endings of the linears that stay in the run's dtype: MoE routers.
ROUTERS = ("mlp.gate", "router")


def quantized_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """Full-model name -> each ``nn.Linear`` of ``module``'s decoder layers that gets quantized."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and ".layers." in f".{name}" and not name.endswith(ROUTERS):
            out[name] = sub
    return out
