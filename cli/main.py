"""The ``hfpipe`` command: a thin Typer shell over the library.

Each command parses its options, builds a config and calls one library function. Heavy imports
(torch, transformers) happen inside the commands, so ``hfpipe --help`` answers at once.

Errors: a mistake the user can fix (any :class:`hfpipe.errors.HfpipeError`, or a bad command line)
prints one line, ``error: <message>``, on stderr and exits with 2. Anything
else exits with 1 and a one-line summary. ``--debug`` adds the traceback to both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from typer.core import TyperGroup

from hfpipe.errors import HfpipeError
from hfpipe.cli.options import FIELD_HELP as _HELP
from hfpipe.cli.finetune import finetune, resume_command
from hfpipe.cli.generate import chat, generate
from hfpipe.cli.plan import plan
from hfpipe.cli.recipes import recipes
from hfpipe.parallel.signals import Interrupted, StartupInterrupted, stop_at_once

try:  # typer >= 0.24 ships its own copy of click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click.exceptions import NoArgsIsHelpError, UsageError

__all__ = ["app"]

USAGE_EXIT = 2  # user errors, as for a bad command line
FAILURE_EXIT = 1  # anything unexpected

_SCHEDULE_HELP = ("gpipe | 1f1b | interleaved-1f1b | looped-bfs | interleaved-zb | zbv | "
                  "dualpipev; interleaved and V schedules put two stages on each rank.")


class _OneLineErrors(TyperGroup):
    """Turns every failure into one stderr line and an exit code (see the module docstring)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        console = args is None  # a real `hfpipe ...` process, not a test runner's call
        args = list(sys.argv[1:] if console else args)
        was_debug = os.environ.get("HFPIPE_DEBUG")
        if "--debug" in args:  # accepted after the subcommand too: it is a global option
            args = ["--debug"] + [a for a in args if a != "--debug"]
            os.environ["HFPIPE_DEBUG"] = "1"  # workers' failures then keep torch's full report
        try:
            return self._main(args, console, prog_name, complete_var, standalone_mode, **extra)
        finally:
            if not console and was_debug is None:  # a call in a process that goes on (a test, a script)
                os.environ.pop("HFPIPE_DEBUG", None)  # leaves its environment as it was

    def _main(self, args, console, prog_name, complete_var, standalone_mode, **extra):
        stdin = _no_stdin() if console else None
        extra.setdefault("obj", {"console": console, "stdin": stdin})
        try:
            # A console's SIGTERM/SIGHUP (and Ctrl-C) stop a command at once, in one line, after its
            # ``finally`` blocks removed what it had half-written; a run's launcher and its workers
            # take the signals over while training (hfpipe.parallel.signals).
            with stop_at_once() if console else contextlib.nullcontext():
                code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                    standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help())
            code = USAGE_EXIT
        except typer.Abort:
            typer.echo("aborted", err=True)
            code = FAILURE_EXIT
        except KeyboardInterrupt:  # Ctrl-C before any worker ran: nothing to save
            typer.echo("error: interrupted (Ctrl-C) before training started; nothing was written", err=True)
            code = 130
        except StartupInterrupted as e:
            typer.echo(f"error: stopped by {e}; nothing was written", err=True)
            code = e.code
        except Interrupted as e:
            then = f": {resume_command(args)}" if e.step is not None else ""
            typer.echo(f"interrupted: {e}{then}", err=True)
            code = e.code
        except Exception as e:  # noqa: BLE001 - this is the one place errors are reported
            code = _report(e, debug="--debug" in args)
        if not standalone_mode:
            return code
        sys.exit(code or 0)


def _no_stdin() -> int | None:
    """Point stdin at /dev/null: a library that would prompt (transformers' "run custom code?
    [y/N]") gets end-of-file and refuses instead of waiting for, or obeying, a keystroke.

    Returns a copy of the real stdin's descriptor (None if there was none), which only
    ``hfpipe chat`` takes back, once its model is loaded: its turns are what stdin is for.
    """
    try:
        saved = os.dup(0)
    except OSError:  # started with stdin closed
        saved = None
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    return saved


#: The long names other tools give the parallel axes (Megatron, torchtitan, vLLM), and hfpipe's flag for each.
_AXIS_NAMES = {f"--{long}{size}": f"--{short}" for short, long in (
    ("pp", "pipeline-parallel"), ("dp", "data-parallel"), ("tp", "tensor-parallel"), ("cp", "context-parallel"),
    ("ep", "expert-parallel")) for size in ("", "-size", "-degree")}
_AXIS_NAMES.update({f"--{short}-size": f"--{short}" for short in ("pp", "dp", "tp", "cp", "ep")})


def _axis_hint(e) -> str | None:
    """``--tensor-parallel 2`` is ``--tp 2``: click's own guess (by spelling) would point at
    ``--sequence-parallel``, so an axis's long name gets the flag the command really has."""
    name, ctx = getattr(e, "option_name", None), getattr(e, "ctx", None)
    flag = _AXIS_NAMES.get(name or "")
    if flag is None or ctx is None or not any(flag in getattr(p, "opts", ()) for p in ctx.command.params):
        return None
    return f"no such option {name}; did you mean {flag}? (see '{ctx.command_path} --help')"


def _report(e: Exception, debug: bool) -> int:
    """Print ``error: ...`` (and the traceback with --debug); return the exit code."""
    user = isinstance(e, (UsageError, HfpipeError))
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    if isinstance(e, UsageError):
        where = getattr(getattr(e, "ctx", None), "command_path", None)
        message = _axis_hint(e) or e.format_message() + (f" (see '{where} --help')" if where else "")
    elif user:
        message = str(e)
    else:
        hint = "" if debug else " (run with --debug for the traceback)"
        message = f"unexpected {type(e).__name__}: {e}{hint}"
    typer.echo("error: " + " ".join(message.split()), err=True)
    return USAGE_EXIT if user else FAILURE_EXIT


app = typer.Typer(
    cls=_OneLineErrors,
    name="hfpipe",
    help="Pipeline-parallel fine-tuning of Hugging Face decoder models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command(no_args_is_help=True)(finetune)
app.command(no_args_is_help=True)(plan)
app.command(no_args_is_help=True)(generate)
app.command(no_args_is_help=True)(chat)
app.command()(recipes)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(level: str) -> None:
    from hfpipe.progress.logs import log_formatter, quiet_import_noise

    quiet_import_noise(level)
    # The workers (hfpipe's launcher's, or each torchrun process) log at it too (hfpipe.train.runner).
    os.environ["HFPIPE_LOG_LEVEL"] = level.upper()
    logger = logging.getLogger("hfpipe")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(log_formatter())
        logger.addHandler(handler)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version  # not `hfpipe.__version__`: the package face sits a floor above

        typer.echo(f"hfpipe {version('hfpipe')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the hfpipe version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    log_level: Annotated[Literal["debug", "info", "warning", "error"], typer.Option(
        help="Lowest level of hfpipe log messages shown on stderr.")] = "info",
) -> None:
    """Pipeline-parallel fine-tuning of Hugging Face decoder models."""
    _setup_logging(log_level)


@app.command(no_args_is_help=True)
def export(
    ckpt: Annotated[Path, typer.Argument(
        help="Training checkpoint folder (DCP files + hfpipe.json), e.g. out/checkpoints/step-00000100, "
             "or a run folder (its newest checkpoint).", show_default=False)],
    out: Annotated[Path, typer.Argument(help="Hugging Face folder to create.", show_default=False)],
    dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32", "fp64", "fp8"], typer.Option(
        help="Tensor dtype; auto keeps the source checkpoint's (FP8 sources become bf16; an fp64 run's "
             "weights too: fp64 keeps them). With --merge of a LoRA run: auto (the base's dtypes; bf16 for a "
             "quantized base), fp8 (the linears requantized per block, as DeepSeek ships), or a float dtype, "
             "merged in it where wider than the base (fp64: PEFT's merge_and_unload in fp64).")] = "auto",
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 5GB or 500MB.")] = "5GB",
    force: Annotated[bool, typer.Option(
        help="Replace an earlier export at OUT (a folder holding hfpipe_export.json; anything else is "
             "refused), only once the new folder is complete.")] = False,
    source: Annotated[Optional[Path], typer.Option(
        help="The HF model folder the run started from, if it moved since training.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    merge: Annotated[bool, typer.Option(
        help="LoRA checkpoints: merge the adapters into the base weights (base dtype and layout) "
             "instead of writing a PEFT adapter folder.")] = False,
) -> None:
    """Export a training checkpoint to a Hugging Face folder (config + safetensors) that
    transformers' from_pretrained loads, whatever pipeline size it was trained with; a LoRA
    run's checkpoint to a PEFT adapter folder (PeftModel.from_pretrained), or merged with --merge."""
    # Transparent huge pages for torch's CPU tensors: about 1.5x faster on multi-GB layers. It is
    # read when torch loads, so set it before the import (no effect if torch is already loaded).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from hfpipe.checkpoint.find import find_checkpoint

    ckpt = find_checkpoint(ckpt, "checkpoint")  # torch-free: a wrong path is named at once
    from hfpipe.progress.ticker import Ticker

    # The ticker speaks until the export's own bar shows (the imports and the plan come first, seconds of
    # them); a log file gets no bar, only the ticker's lines.
    bar = progress and sys.stderr.isatty()
    with Ticker(lambda: None if bar and _a_bar_shows() else f"exporting {ckpt} to {out}"):
        from hfpipe.export.hf_folder import export_checkpoint

        written = export_checkpoint(ckpt, out, dtype=dtype, max_shard_size=max_shard_size, force=force,
                                    source=source, progress=progress, merge=merge)
    typer.echo(f"exported {ckpt} -> {written}")


def _a_bar_shows() -> bool:
    """Whether a tqdm bar is open in this process (tqdm keeps its open bars in ``tqdm._instances``)."""
    tqdm = sys.modules.get("tqdm")
    return bool(tqdm is not None and getattr(tqdm.tqdm, "_instances", None))


@app.command("verify", no_args_is_help=True)
def verify_command(
    hf_dir: Annotated[Path, typer.Argument(
        help="Hugging Face model folder (config.json + safetensors), or a PEFT LoRA adapter folder.",
        show_default=False)],
    pp: Annotated[int, typer.Option(help="Pipeline ranks: processes started on this machine.")] = 2,
    schedule: Annotated[str, typer.Option(help=_SCHEDULE_HELP)] = "1f1b",
    tolerance: Annotated[float, typer.Option(help="Largest allowed absolute logit difference.")] = 1e-5,
    seq_len: Annotated[Optional[int], typer.Option(
        help="Tokens per sample sequence; default 32, or the model's max_position_embeddings if smaller.",
        show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Sample sequences; default one per stage (at least 2).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help=_HELP["trust_remote_code"])] = False,
) -> None:
    """Check that hfpipe's pipeline gives transformers' logits on a model folder: loads it in
    transformers (fp32, one process) and in PP pipeline processes, compares the logits on a
    sample batch, prints the largest difference and the KL divergence; exits 1 on FAIL. A PEFT
    LoRA adapter folder runs its base with the adapters, against PeftModel.from_pretrained."""
    from hfpipe.errors import NoSuchPathError
    from hfpipe.files import did_you_mean

    if not hf_dir.expanduser().exists():  # before torch loads: a wrong path is named at once
        raise NoSuchPathError(f"HF_DIR {hf_dir}: no such folder{did_you_mean(hf_dir)}")
    from hfpipe.progress.ticker import Ticker

    with Ticker("loading torch and transformers"):
        import hfpipe.verify

    result = hfpipe.verify.verify(hf_dir, pp=pp, schedule=schedule, tolerance=tolerance,
                                  seq_len=seq_len, batch=batch_size,
                                  trust_remote_code=trust_remote_code)
    typer.echo(result.summary())
    if not result.passed:
        raise typer.Exit(FAILURE_EXIT)


@app.command("quickstart")
def quickstart_command(
    out: Annotated[Path, typer.Option(help="Working folder for the model, the run and the export.")]
    = Path("hfpipe-quickstart"),
    steps: Annotated[int, typer.Option(help="Optimizer steps of the fine-tune.")] = 120,
    pp: Annotated[int, typer.Option(help="Pipeline ranks: processes started on this machine.")] = 2,
    lora: Annotated[bool, typer.Option(
        help="Train rank-16 LoRA adapters on the frozen base instead; the export is a PEFT adapter "
             "folder, checked against PeftModel.")] = False,
) -> None:
    """Offline end-to-end demo: build a small Llama with a tokenizer, fine-tune it at --pp on the
    chat set shipped with hfpipe, export it, check the export against the pipeline with
    transformers, and print greedy answers to two prompts before and after. No hub access needed;
    a second run reuses the model and starts the fine-tune afresh."""
    from hfpipe.quickstart import quickstart as run

    result = run(out, steps=steps, pp=pp, echo=typer.echo, lora=lora)
    if not result["passed"]:
        raise typer.Exit(FAILURE_EXIT)


if __name__ == "__main__":
    app()
