"""A rank's trainable parameters, each shared tensor once (a tied head on the embedding's rank is one)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["unique_parameters"]


def unique_parameters(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters of ``modules`` by full-model name, each shared tensor once."""
    seen, out = set(), []
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out
