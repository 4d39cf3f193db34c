"""``hfpipe plan``: what a finetune run would cost each rank, and whether it fits the GPUs.

The options are finetune's own (the same flags, made from the same FinetuneConfig fields by
:func:`hfpipe.cli.options.config_flags`, and the same recipe files), so a plan prices exactly the run
``hfpipe finetune`` with the same arguments would start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from hfpipe.cli.options import build_config, config_flags

__all__ = ["plan"]


@config_flags("pp", "dp", "ep", "tp", "cp", "sequence_parallel", "reshard_per_microbatch", "gpus_per_node", "vpp",
              "schedule", "layout", "plan_method", "microbatches", "seq_len", "batch_size", "dtype",
              "fp8", "fp8_recipe", "activation_checkpointing", "compile", "trust_remote_code", "lora_rank",
              "quantize_base", "quantize_block_size", "lora_targets", "method", "png")
def plan(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        help="Model folder, config.json path, bundled model id (e.g. deepseek-ai/DeepSeek-V3) or "
             "hub id; only config.json is read, no weights. Optional when the recipe sets `model:`.",
        show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="A shipped recipe's name (hfpipe recipes lists them) or a YAML file; flags given here "
             "override it.", show_default=False)] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(
        help="Memory of one GPU, e.g. 80GB or 141GB: say per rank whether the plan fits, and the "
             "nearest changes that would.", show_default=False)] = None,
    gpus_per_node: Annotated[int, typer.Option(
        help="GPUs in one node: the largest --tp the fit search proposes (tensor parallelism stays "
             "inside a node).", min=1)] = 8,
    png: Annotated[Optional[Path], typer.Option(
        help="Also draw the schedule timeline and each rank's memory into this PNG (needs "
             "matplotlib: pip install 'hfpipe[plot]').", show_default=False)] = None,
    **flags,
) -> None:
    """Plan the pipeline stages of a finetune run and print each rank's parameters, memory
    (weights, gradients, AdamW state, activations; dp and cp sharding counted), the balance and the
    schedule's bubble; with --gpu-memory, whether each rank fits and what would make it fit."""
    from hfpipe.progress.ticker import Ticker

    given = {k: v for k, v in {"model": model, **flags}.items() if v is not None}
    cfg = build_config(recipe, given)
    doing = [f"planning {cfg.model}: loading torch and transformers"]  # what the ticker says, stretch by stretch
    with Ticker(lambda: doing[0]):
        from hfpipe.plan.fit import format_fit, parse_memory, report_for, suggest
        from hfpipe.plan.report import format_report, load_model_config

        limit = parse_memory(gpu_memory) if gpu_memory is not None else None
        if png is not None:
            from hfpipe.cli.plot import require_matplotlib, save_png

            require_matplotlib()
        doing[0] = f"planning {cfg.model}: reading its config"
        config = load_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
        if given.get("seq_len") is not None:  # past the model's context: refused here as finetune refuses it
            from hfpipe.data.config import check_seq_len

            check_seq_len(given["seq_len"], config)
        doing[0] = f"planning {cfg.model}: measuring a layer's activations, pricing each rank"
        report = report_for(config, cfg)
        fits = limit is None or all(r.total_bytes <= limit for r in report.ranks)
        doing[0] = f"planning {cfg.model}: searching the layouts that fit {gpu_memory}"
        found = None if fits else suggest(config, cfg, limit, gpus_per_node=gpus_per_node)
    if png is not None:
        save_png(report, png, gpu_memory=limit)
    typer.echo(format_report(report))
    if limit is not None:
        typer.echo("\n" + format_fit(report, limit, found))
    if png is not None:
        typer.echo(f"wrote {png}")
    if (ctx.obj or {}).get("console"):
        _exit_now()


def _exit_now() -> None:
    """End a finished console run without interpreter teardown.

    Freeing the modules torch and transformers loaded takes 0.5-2 s, a third of a whole
    ``hfpipe plan``; plan holds no open files or threads, so nothing is lost by skipping it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
