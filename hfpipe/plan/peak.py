"""A rank's peak of activations and gradients together, walked over its schedule.

Activations and gradients do not peak together: a step starts with no gradients (the optimizer sets
them to ``None``), a stage's gradients appear during its first backward, and that backward frees the
activations of each layer as it makes the layer's gradients. Summing the two columns' peaks priced a
full fine-tune of an 8-layer Llama-3-8B slice at 60.2 GiB where the run peaked at 52.0 (the gradients,
10.4 GiB, and the activations, 13.3 GiB, never all exist at once). So each rank's action list
(:func:`hfpipe.plan.actions.schedule_actions`) is replayed: a forward adds its microbatch's
activations; a stage's first backward walks its parts from the head down, each part's gradients
made while that part's activations are still held and the parts below it not yet freed; later
backwards find the stage's gradients whole. The microbatch a backward runs on is counted whole
until that backward ends, and under activation checkpointing one recomputed layer on top.
"""

from __future__ import annotations

__all__ = ["Part", "rank_peak"]

#: One part of a stage in backward order (head, last layer, ..., first layer, embedding): the bytes of
#: activations it keeps per microbatch, and the bytes of the gradients its backward makes.
Part = tuple[int, int]


def rank_peak(steps, parts: dict[int, list[Part]], recompute: int = 0) -> int:
    """The most bytes of activations and gradients a rank holds at once over its ``steps``.

    Args:
        steps: The rank's ``(kind, stage, microbatch)`` actions (``F``, ``B``, ``I``, ``W``).
        parts: Per stage the rank holds, its :data:`Part` list in backward order.
        recompute: What one recomputed layer adds during a backward (activation checkpointing).
    """
    alive: set[tuple[int, int]] = set()
    made: set[int] = set()  # stages whose gradients exist

    def held(skip=None) -> int:
        act = sum(sum(a for a, _ in parts[s]) for s, mb in alive if (s, mb) != skip)
        return act + sum(sum(g for _, g in parts[s]) for s in made)

    peak = 0
    for kind, stage, mb in steps:
        if kind == "F":
            alive.add((stage, mb))
            peak = max(peak, held())
        elif kind in ("B", "I") and stage not in made:
            peak = max(peak, held(skip=(stage, mb)) + _first_backward(parts[stage]) + recompute)
            made.add(stage)
        elif kind in ("B", "I"):
            peak = max(peak, held() + recompute)
        if kind in ("B", "W"):
            alive.discard((stage, mb))
    return max(peak, held())


def _first_backward(parts: list[Part]) -> int:
    """The most a stage's first backward holds of one microbatch's activations and its own gradients:
    at part ``j``, the activations of parts ``j`` and below and the gradients of parts ``j`` and above."""
    most, grads = 0, 0
    for j, (_, g) in enumerate(parts):
        grads += g
        most = max(most, sum(a for a, _ in parts[j:]) + grads)
    return most
