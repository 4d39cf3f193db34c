"""The flags every command shares with ``finetune``: one per FinetuneConfig field, made from the field.

A field's flag is declared nowhere else: its name (``--batch-size``; ``--x/--no-x`` for a switch), its
type (the field's, ``None`` left out; a mapping is typed as its ``A=B,...`` text), its help (the field's
docstring) and its shown default (the field's) come from :class:`~hfpipe.config.run.FinetuneConfig`.
A command names the fields it takes with :func:`config_flags`; each flag defaults to None ("not
given"), so only the flags on the command line override a recipe.

``finetune`` and ``plan`` both build a :class:`~hfpipe.config.run.FinetuneConfig` from a recipe and
the flags given; that lives here so neither command imports the other.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from hfpipe.config.run import FinetuneConfig, field_help

__all__ = ["CONFIG_FIELDS", "FIELD_HELP", "build_config", "config_flags"]

#: Each FinetuneConfig field's docstring, as flag help (reST quotes dropped).
FIELD_HELP = {name: text.replace("``", "") for name, text in field_help().items()}
#: FinetuneConfig's fields, in its order.
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}
_TYPES = typing.get_type_hints(FinetuneConfig)


def _flag_type(field: str):
    """The flag's type: the field's without ``None``; a mapping (``columns``) is given as its ``A=B,...`` text."""
    hint = _TYPES[field]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return str if typing.get_origin(hint) is dict else hint


def _flag(field: str):
    """The flag of ``field``: help from its docstring, the shown default FinetuneConfig's own.

    The flag itself defaults to None (not given), so that a recipe's value stands unless it is given.
    """
    default = _DEFAULTS[field]
    if isinstance(default, tuple):
        default = " ".join(map(str, default))
    elif isinstance(default, bool):
        default = str(default).lower()
    shown = "" if default is None else f"  [default: {default}]"
    kind = _flag_type(field)
    names = (f"--{field.replace('_', '-')}/--no-{field.replace('_', '-')}",) if kind is bool else ()
    return Annotated[Optional[kind], typer.Option(*names, help=FIELD_HELP[field] + shown, show_default=False)]


def config_flags(*order: str):
    """Give a command one flag per FinetuneConfig field in ``order``; the given ones reach its ``**flags``.

    The command's signature (what typer reads) is its own parameters not named in ``order``, then
    ``order``: a field's generated flag, or the command's own parameter of that name (so a command's
    own options can stand among the shared ones, where its ``--help`` lists them).
    """
    def wrap(command):
        own = inspect.signature(command, eval_str=True).parameters
        first = [p for name, p in own.items() if name not in order and p.kind is not p.VAR_KEYWORD]
        keyword = inspect.Parameter.KEYWORD_ONLY  # typer passes every flag by name
        placed = [own[name].replace(kind=keyword) if name in own else
                  inspect.Parameter(name, keyword, default=None, annotation=_flag(name)) for name in order]
        command.__signature__ = inspect.Signature(first + placed)
        return command

    return wrap


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
