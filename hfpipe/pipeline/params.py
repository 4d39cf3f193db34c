"""A rank's trainable parameters, each shared tensor once (a tied head on the embedding's rank is one)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["by_mesh", "unique_parameters"]


def unique_parameters(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters of ``modules`` by full-model name, each shared tensor once."""
    seen, out = set(), []
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def by_mesh(params: list) -> list[list]:
    """``params`` in runs that share a device mesh (plain tensors apart from DTensors), in first-seen order.

    torch's foreach optimizers refuse a list that mixes DTensors (``--tp``, FSDP2) with plain tensors
    (what tp leaves whole, such as norms without sequence parallelism): one parameter group per run
    keeps any optimizer's foreach path legal, and changes no update (AdamW is elementwise).
    """
    runs: dict = {}
    for p in params:
        runs.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    return list(runs.values())
