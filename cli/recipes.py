"""``hfpipe recipes``: the recipes shipped with hfpipe, each with its one-line purpose."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["recipes"]


def recipes(
    paths: Annotated[bool, typer.Option(help="Also print each recipe's file, to copy and edit.")] = False,
) -> None:
    """List the shipped recipes with their purpose and the GPUs they fit; run one with
    `hfpipe finetune --recipe NAME`, check it with `hfpipe plan --recipe NAME --gpu-memory 80GB`."""
    from hfpipe.recipes import list_recipes

    shipped = list_recipes()
    width = max(len(r.name) for r in shipped)
    for r in shipped:
        fits = f"  [fits {r.gpus} x {r.gpu_memory} GPUs]" if r.gpus else ""
        typer.echo(f"{r.name:<{width}}  {r.purpose}{fits}")
        if paths:
            typer.echo(f"{'':<{width}}  {r.path}")
