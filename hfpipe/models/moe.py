"""How each MoE family's config names its routed experts: the one table every layer reads.

A floor module (no hfpipe imports): the layout rules (``--ep`` must divide the experts), the cost
model and the planner all count experts through :func:`routed_experts`.
"""

from __future__ import annotations

__all__ = ["EP_KEYS", "routed_experts"]

#: config keys of the routed-expert count and of the experts each token goes to, by family.
EP_KEYS = (("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"),
           ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k"))


def routed_experts(config) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token); (0, 0) for a dense model."""
    count, top_k = (next((int(getattr(config, k)) for k in keys if getattr(config, k, None)), 0)
                    for keys in EP_KEYS)
    return count, top_k
