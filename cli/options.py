"""The flags every command shares with ``finetune``: one per FinetuneConfig field, help from its docstring.

``finetune`` and ``plan`` both build a :class:`~hfpipe.config.run.FinetuneConfig` from a recipe and
the flags given; that lives here so neither command imports the other.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from hfpipe.config.run import FinetuneConfig, field_help

__all__ = ["FIELD_HELP", "build_config"]

#: Each FinetuneConfig field's docstring, as flag help (reST quotes dropped).
FIELD_HELP = {name: text.replace("``", "") for name, text in field_help().items()}
_FIELDS = {f.name for f in dataclasses.fields(FinetuneConfig)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}


def _opt(field: str, flag: str | None = None):
    """A flag whose help is the FinetuneConfig field's docstring and default.

    The flag itself defaults to None (not given), so the shown default is FinetuneConfig's.
    """
    default = _DEFAULTS[field]
    if isinstance(default, tuple):
        default = " ".join(map(str, default))
    elif isinstance(default, bool):
        default = str(default).lower()
    shown = "" if default is None else f"  [default: {default}]"
    names = (flag,) if flag else ()
    return typer.Option(*names, help=FIELD_HELP[field] + shown, show_default=False)


def build_config(recipe: str | Path | None, given: dict) -> FinetuneConfig:
    """The run's config: the recipe (if any) with the given flags on top.

    Raises:
        ConfigError: an unknown key, a bad value, or no model anywhere.
        typer.BadParameter: neither MODEL nor --recipe was given.
    """
    if recipe is not None:
        from hfpipe.recipes import find_recipe

        return FinetuneConfig.from_yaml(find_recipe(recipe), **given)
    if "model" not in given:
        raise typer.BadParameter("give a model folder or hub id, or --recipe FILE with a `model:` key",
                                 param_hint="MODEL")
    return FinetuneConfig.from_dict(given, source="command line")
