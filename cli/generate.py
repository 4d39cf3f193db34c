"""``hfpipe generate`` and ``hfpipe chat``: talk to a model folder or a training checkpoint.

Answers stream to stdout as they are produced; loading messages go to the log (stderr).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from hfpipe.progress.ticker import Ticker

__all__ = ["chat", "generate"]

_MODEL = typer.Argument(
    help="Hugging Face folder or hub id, or a training checkpoint: a run folder (its newest "
         "checkpoint) or a step folder like OUT/checkpoints/step-00000100.", show_default=False)
_MAX_NEW = typer.Option(help="Most tokens to generate per answer.")
_TEMPERATURE = typer.Option(help="0 is greedy (the default); above 0 samples at this temperature.")
_TOP_P = typer.Option(help="Nucleus sampling: keep the likeliest tokens up to this probability "
                           "(only when sampling).")
_SEED = typer.Option(help="Random seed for sampling.")
_DTYPE = typer.Option(help="auto keeps the stored dtype (a checkpoint's training dtype).")
_SOURCE = typer.Option(help="For a checkpoint: the HF model folder the run started from, if it "
                            "moved since training.", show_default=False)
_REMOTE = typer.Option(help="Allow transformers to run code from the model repository.")


def generate(
    model: Annotated[str, _MODEL],
    prompt: Annotated[str, typer.Option(help="The prompt (one user turn).", show_default=False)],
    chat_template: Annotated[bool, typer.Option(
        help="Wrap the prompt in the tokenizer's chat template as a user turn (when it has one); "
             "--no-chat-template continues the raw text.")] = True,
    max_new_tokens: Annotated[int, _MAX_NEW] = 128,
    temperature: Annotated[float, _TEMPERATURE] = 0.0,
    top_p: Annotated[float, _TOP_P] = 1.0,
    seed: Annotated[int, _SEED] = 0,
    dtype: Annotated[Literal["auto", "fp32", "bf16", "fp16"], _DTYPE] = "auto",
    source: Annotated[Optional[Path], _SOURCE] = None,
    trust_remote_code: Annotated[bool, _REMOTE] = False,
) -> None:
    """Answer one prompt with a model folder or a training checkpoint (greedy by default), in one
    process with transformers' generate; the answer streams to stdout."""
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    gen = _load(model, sampling, dtype=dtype, source=source, trust_remote_code=trust_remote_code)
    ids = gen.encode(prompt, chat_template=chat_template)
    gen.generate(ids, **sampling, stream=_write)
    typer.echo("")


def chat(
    ctx: typer.Context,
    model: Annotated[str, _MODEL],
    system: Annotated[Optional[str], typer.Option(help="A system message opening the conversation.",
                                                  show_default=False)] = None,
    max_new_tokens: Annotated[int, _MAX_NEW] = 256,
    temperature: Annotated[float, _TEMPERATURE] = 0.0,
    top_p: Annotated[float, _TOP_P] = 1.0,
    seed: Annotated[int, _SEED] = 0,
    dtype: Annotated[Literal["auto", "fp32", "bf16", "fp16"], _DTYPE] = "auto",
    source: Annotated[Optional[Path], _SOURCE] = None,
    trust_remote_code: Annotated[bool, _REMOTE] = False,
) -> None:
    """Talk with a model folder or a training checkpoint through its chat template: type a turn,
    the answer streams back. /reset forgets the conversation; /exit or Ctrl-D ends it."""
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    gen = _load(model, sampling, dtype=dtype, source=source, trust_remote_code=trust_remote_code)
    gen.check_can_chat()  # the refusal alone, without a banner above it
    _take_back_stdin((ctx.obj or {}).get("stdin"))
    typer.echo("chatting with " + str(model) + " (/reset forgets, /exit or Ctrl-D ends)", err=True)
    gen.chat(_read, _write, system=system, **sampling)


def _load(model: str, sampling: dict, **load):
    """The generator of ``model``, once its path and the ``sampling`` options are checked (each before the
    slower step: the path before torch loads, the options before the weights)."""
    _check_model(model)
    with Ticker("loading torch and transformers"):
        from hfpipe.generate import check_options, load_generator

    check_options(**sampling)
    return load_generator(model, **load)


def _check_model(model: str) -> None:
    """Name a wrong path before torch and transformers load (seconds on a busy machine)."""
    from hfpipe.checkpoint.find import find_checkpoint, is_checkpoint_like
    from hfpipe.files import check_model_name

    if is_checkpoint_like(model):
        find_checkpoint(model, "MODEL")
    else:
        check_model_name(model)


def _take_back_stdin(saved: int | None) -> None:
    """Give chat the stdin the CLI set aside (it reads /dev/null while the model loads, so no
    library can prompt on it): a terminal or a pipe of turns, whichever it was started with."""
    if saved is None:  # in-process runs (tests) keep the stdin they were given
        return
    os.dup2(saved, 0)
    os.close(saved)
    sys.stdin = sys.__stdin__


def _read(prompt: str) -> str:
    # The user's turns come from the terminal: reading them is what chat is for.
    line = input(prompt)
    if not sys.stdin.isatty():  # a terminal shows what was typed; a piped turn would not show at all
        typer.echo(line)
    return line


def _write(text: str) -> None:
    typer.echo(text, nl=False)
