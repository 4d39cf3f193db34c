"""``hfpipe finetune``: every FinetuneConfig field as a flag, over an optional recipe file.

Flags default to None, meaning "not given": only the flags on the command line override the
recipe, and FinetuneConfig's own defaults fill the rest. Each flag's help is its field's docstring.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hfpipe.cli.options import _FIELDS, _opt, build_config
from hfpipe.config.run import FinetuneConfig

__all__ = ["finetune", "resume_command"]

def finetune(
    model: Annotated[Optional[str], typer.Argument(
        help="Hub id or local folder with config.json and safetensors; optional when the "
             "recipe sets `model:`.", show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="A shipped recipe's name (hfpipe recipes lists them) or a YAML file of FinetuneConfig "
             "keys; flags given here override it.", show_default=False)] = None,
    pp: Annotated[Optional[int], _opt("pp")] = None,
    dp: Annotated[Optional[int], _opt("dp")] = None,
    ep: Annotated[Optional[int], _opt("ep")] = None,
    tp: Annotated[Optional[int], _opt("tp")] = None,
    cp: Annotated[Optional[int], _opt("cp")] = None,
    sequence_parallel: Annotated[Optional[bool], _opt(
        "sequence_parallel", "--sequence-parallel/--no-sequence-parallel")] = None,
    reshard_per_microbatch: Annotated[Optional[bool], _opt(
        "reshard_per_microbatch", "--reshard-per-microbatch/--no-reshard-per-microbatch")] = None,
    vpp: Annotated[Optional[int], _opt("vpp")] = None,
    schedule: Annotated[Optional[str], _opt("schedule")] = None,
    layout: Annotated[Optional[str], _opt("layout")] = None,
    plan_method: Annotated[Optional[str], _opt("plan_method")] = None,
    microbatches: Annotated[Optional[int], _opt("microbatches")] = None,
    dataset: Annotated[Optional[str], _opt("dataset")] = None,
    dataset_config: Annotated[Optional[str], _opt("dataset_config")] = None,
    split: Annotated[Optional[str], _opt("split")] = None,
    format: Annotated[Optional[str], _opt("format")] = None,  # noqa: A002 - the field's name
    seq_len: Annotated[Optional[int], _opt("seq_len")] = None,
    packing: Annotated[Optional[bool], _opt("packing", "--packing/--no-packing")] = None,
    batch_size: Annotated[Optional[int], _opt("batch_size")] = None,
    grad_accum: Annotated[Optional[int], _opt("grad_accum")] = None,
    lr: Annotated[Optional[float], _opt("lr")] = None,
    min_lr: Annotated[Optional[float], _opt("min_lr")] = None,
    weight_decay: Annotated[Optional[float], _opt("weight_decay")] = None,
    betas: Annotated[Optional[tuple[float, float]], _opt("betas")] = None,
    eps: Annotated[Optional[float], _opt("eps")] = None,
    warmup_steps: Annotated[Optional[int], _opt("warmup_steps")] = None,
    lr_schedule: Annotated[Optional[str], _opt("lr_schedule")] = None,
    max_grad_norm: Annotated[Optional[float], _opt("max_grad_norm")] = None,
    max_steps: Annotated[Optional[int], _opt("max_steps")] = None,
    epochs: Annotated[Optional[int], _opt("epochs")] = None,
    dtype: Annotated[Optional[str], _opt("dtype")] = None,
    activation_checkpointing: Annotated[Optional[str], _opt("activation_checkpointing")] = None,
    seed: Annotated[Optional[int], _opt("seed")] = None,
    output_dir: Annotated[Optional[str], _opt("output_dir")] = None,
    save_every: Annotated[Optional[int], _opt("save_every")] = None,
    keep: Annotated[Optional[int], _opt("keep")] = None,
    async_save: Annotated[Optional[bool], _opt("async_save", "--async-save/--no-async-save")] = None,
    resume: Annotated[Optional[str], _opt("resume")] = None,
    save_hf_at_end: Annotated[Optional[bool], _opt(
        "save_hf_at_end", "--save-hf-at-end/--no-save-hf-at-end")] = None,
    trust_remote_code: Annotated[Optional[bool], _opt(
        "trust_remote_code", "--trust-remote-code/--no-trust-remote-code")] = None,
    threads_per_rank: Annotated[Optional[int], _opt("threads_per_rank")] = None,
    log_every: Annotated[Optional[int], _opt("log_every")] = None,
    columns: Annotated[Optional[str], _opt("columns")] = None,
    roles: Annotated[Optional[str], _opt("roles")] = None,
    chat_template: Annotated[Optional[str], _opt("chat_template")] = None,
    train_on_prompt: Annotated[Optional[bool], _opt(
        "train_on_prompt", "--train-on-prompt/--no-train-on-prompt")] = None,
    allow_dropped_records: Annotated[Optional[bool], _opt(
        "allow_dropped_records", "--allow-dropped-records/--no-allow-dropped-records")] = None,
    eval_dataset: Annotated[Optional[str], _opt("eval_dataset")] = None,
    eval_split: Annotated[Optional[str], _opt("eval_split")] = None,
    eval_fraction: Annotated[Optional[float], _opt("eval_fraction")] = None,
    eval_every: Annotated[Optional[int], _opt("eval_every")] = None,
    eval_batches: Annotated[Optional[int], _opt("eval_batches")] = None,
    keep_best: Annotated[Optional[bool], _opt("keep_best", "--keep-best/--no-keep-best")] = None,
    report_to: Annotated[Optional[str], _opt("report_to")] = None,
    lora_rank: Annotated[Optional[int], _opt("lora_rank")] = None,
    lora_alpha: Annotated[Optional[float], _opt("lora_alpha")] = None,
    lora_dropout: Annotated[Optional[float], _opt("lora_dropout")] = None,
    lora_targets: Annotated[Optional[str], _opt("lora_targets")] = None,
    quantize_base: Annotated[Optional[str], _opt("quantize_base")] = None,
    quantize_block_size: Annotated[Optional[int], _opt("quantize_block_size")] = None,
    timeout: Annotated[Optional[float], _opt("timeout")] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes in the job; run the same command on each.")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's index, 0 .. nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(
        help="host:port every node can reach, for nnodes > 1.", show_default=False)] = None,
) -> None:
    """Fine-tune a model with pipeline (and data, tensor) parallelism: starts pp * dp * tp local processes,
    or joins the ones torchrun / srun started."""
    given = {k: v for k, v in locals().items() if k in _FIELDS and v is not None}
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
