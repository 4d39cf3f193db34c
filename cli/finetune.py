"""``hfpipe finetune``: every FinetuneConfig field as a flag (:mod:`hfpipe.cli.options`), over an optional
recipe file.

Flags default to None, meaning "not given": only the flags on the command line override the
recipe, and FinetuneConfig's own defaults fill the rest. Each flag's help is its field's docstring.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hfpipe.cli.options import CONFIG_FIELDS, build_config, config_flags
from hfpipe.config.run import FinetuneConfig

__all__ = ["finetune", "resume_command"]

#: finetune's flags: every FinetuneConfig field but MODEL (its argument), in the config's order but for
#: output_dir, listed with the checkpoint flags.
_FLAGS = [name for name in CONFIG_FIELDS if name not in ("model", "output_dir")]
_FLAGS.insert(_FLAGS.index("save_every"), "output_dir")


@config_flags(*_FLAGS, "nnodes", "node_rank", "rdzv_endpoint")
def finetune(
    model: Annotated[Optional[str], typer.Argument(
        help="Hub id or local folder with config.json and safetensors; optional when the "
             "recipe sets `model:`.", show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="A shipped recipe's name (hfpipe recipes lists them) or a YAML file of FinetuneConfig "
             "keys; flags given here override it.", show_default=False)] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes in the job; run the same command on each.")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's index, 0 .. nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(
        help="host:port every node can reach, for nnodes > 1.", show_default=False)] = None,
    **flags,
) -> None:
    """Fine-tune a model with pipeline (and data, tensor) parallelism: starts pp * dp * tp local processes,
    or joins the ones torchrun / srun started."""
    given = {k: v for k, v in {"model": model, **flags}.items() if v is not None}
    config = build_config(recipe, given)
    from hfpipe.data.sources import check_exists
    from hfpipe.files import check_model_name

    check_model_name(config.model)  # before torch loads: a wrong path is named at once
    check_exists(config.dataset)
    if config.eval_dataset:
        check_exists(config.eval_dataset, "--eval-dataset")
    from hfpipe.progress.ticker import Ticker

    with Ticker("loading torch and transformers"):
        from hfpipe.train.runner import run_finetune as run

    result = run(config, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    if result:  # under torchrun/srun only the rank that reports the loss has a summary to print
        typer.echo(_summary(result))
        typer.echo(_next(result, config), err=True)


def _summary(result: dict) -> str:
    """One line from the runner's summary: the last logged step and the final checkpoint."""
    last = (result.get("history") or [{}])[-1]
    parts = [f"step {last['step']}"] if "step" in last else []
    parts += [f"loss {last['loss']:.4f}"] if isinstance(last.get("loss"), float) else []
    evals = result.get("evals") or [{}]
    parts += [f"eval_loss {evals[-1]['eval_loss']:.4f}"] if "eval_loss" in evals[-1] else []
    parts += [f"checkpoint {result['checkpoint']}"] if result.get("checkpoint") else []
    return "finished: " + (", ".join(parts) or "no summary from this node")


def _next(result: dict, config: FinetuneConfig) -> str:
    """The commands that usually follow a run (export, generate, resume)."""
    from hfpipe.cli.next_steps import next_commands  # here: it reads torch, which the CLI loads only after its checks

    lines = next_commands(config.output_dir, result.get("checkpoint", ""),
                          exported=config.save_hf_at_end, best=result.get("best"))
    return "next:\n" + "\n".join("  " + line for line in lines)


def resume_command(args: list[str]) -> str:
    """The command line that continues this run: the same, with ``--resume auto``."""
    import shlex

    out, skip = ["hfpipe"], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            out.append(arg)
    return shlex.join(out + ["--resume", "auto"])
