"""What one pipeline stage holds: the plan's output, the stage module's input.

A floor module (no hfpipe imports), so that the stage module, the load-time proof and the planner
all speak of stages without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageSpec"]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a contiguous run of decoder layers, plus embedding/head/MTP."""

    index: int  # global stage index, 0 .. num_stages - 1
    layers: tuple[int, ...]  # HF decoder layer indices (contiguous, increasing)
    embed: bool  # holds model.embed_tokens
    head: bool  # holds model.norm, lm_head and the loss
    mtp: tuple[int, ...] = ()  # MTP layers, numbered num_hidden_layers, num_hidden_layers + 1, ...
    cost: float = 0.0  # forward FLOPs per token under layer_costs (for reporting)
