"""``hfpipe finetune``: start the run's processes, and what each of them does around its training loop.

The data path of one run: FinetuneConfig -> preflight (:mod:`hfpipe.train.preflight`: every user error before any
process or folder exists) -> pp*dp workers (launched here, or torchrun/srun's) -> build_pipeline -> data shards ->
the training loop (:mod:`hfpipe.train.loop`: StepEngine steps, DCP checkpoints) -> optional HF export.

The launcher and the worker share this module: the launcher starts :func:`run_worker` by its name here, and
under torchrun/srun this process is the worker. Kept together, they also keep the CLI, which stands on
:func:`run_finetune`, within the package's nine floors (a worker module of its own would add one).
"""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from hfpipe.checkpoint.dcp import load_checkpoint, read_meta, resolve_resume
from hfpipe.checkpoint.pipeline_state import pipeline_view, save_pipeline_checkpoint
from hfpipe.config.run import FinetuneConfig
from hfpipe.data.batches import batches_per_epoch
from hfpipe.export.hf_folder import export_checkpoint
from hfpipe.models.router_loss import router_loss_on
from hfpipe.parallel.launch import check_launch, launch, say_phase
from hfpipe.parallel.lock import run_lock
from hfpipe.parallel.mesh import in_launched_env, init_distributed, launched_node
from hfpipe.parallel.signals import Interrupted
from hfpipe.pipeline.build import build_pipeline
from hfpipe.pipeline.options import from_config
from hfpipe.progress.logs import log_formatter, quiet_import_noise, rank_level
from hfpipe.progress.ticker import Ticker
from hfpipe.train.loop import RunPosition, TrainLoop
from hfpipe.train.optim import build_optimizer, build_scheduler, load_scheduler_state
from hfpipe.train.preference import pair_metrics, preference_batches, prepare_preference, trl_pad_id
from hfpipe.train.preflight import load_run_splits, preflight, run_tokenizer
from hfpipe.train.resume_check import apply_schedule_changes, check_resume

__all__ = ["run_finetune", "run_worker"]

log = logging.getLogger(__name__)


def run_finetune(cfg: FinetuneConfig, *, nnodes: int = 1, node_rank: int = 0,
             rdzv_endpoint: str | None = None) -> dict:
    """Run a fine-tuning job; return the summary of the rank that reports the loss.

    Under torchrun/srun (RANK and WORLD_SIZE, or SLURM_PROCID set) this process is one worker;
    otherwise ``pp * dp * tp`` local workers are started through torch's elastic launcher.
    """
    if in_launched_env():
        # Every rank checks the cheap things; only global rank 0 tokenises the dataset here, so
        # ranks do not write datasets' cache at the same time (the others read it later). Local
        # rank 0 holds the node's lock on the folder, as hfpipe's own launcher does.
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        nodes, node, local_rank = launched_node()
        lock = run_lock(cfg.output_dir, nodes, node) if local_rank == 0 else contextlib.nullcontext()
        if local_rank == 0:
            lock.check()
        preflight(cfg, check_data=rank == "0")
        with lock:
            return _finish(run_worker(cfg.to_dict()))
    check_launch(cfg.dims.world, nnodes, node_rank, rdzv_endpoint, cfg.threads_per_rank)
    lock = run_lock(cfg.output_dir, nnodes, node_rank)
    lock.check()  # a busy folder is named before any other work
    with Ticker("checking the model, the plan and the data"):
        preflight(cfg)
    nprocs = cfg.dims.world // nnodes
    with lock:
        results = launch(run_worker, nprocs, cfg.to_dict(), nnodes=nnodes, node_rank=node_rank,
                         rdzv_endpoint=rdzv_endpoint, threads_per_rank=cfg.threads_per_rank,
                         worker_timeout_s=cfg.timeout, ticker=Ticker)
    return _finish(next((r for r in results.values() if r), {}))


def _finish(summary: dict) -> dict:
    """The run's summary; a run stopped by a signal (after saving) raises :class:`Interrupted`."""
    if summary.get("interrupted"):
        raise Interrupted(summary["interrupted"], summary["step"], summary.get("checkpoint"))
    return summary


def run_worker(cfg_dict: dict) -> dict:
    """One rank of a run (module level so the launcher can start it)."""
    cfg = FinetuneConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    say_phase("joining the process group")
    dist_info = init_distributed(cfg.dims, timeout_s=cfg.timeout)
    _setup_logging(dist_info.rank)
    say_phase("loading this rank's stages")
    pm = build_pipeline(cfg.model, *from_config(cfg), trust_remote_code=cfg.trust_remote_code, dist=dist_info)
    say_phase("reading the tokenised data")
    examples, held = _load_data(cfg, pm, dist_info)
    examples, method = _method(cfg, pm, examples)
    total = _total_steps(cfg, examples)
    optimizer = build_optimizer(pm.modules, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=total,
                                schedule=cfg.lr_schedule, lr=cfg.lr, min_lr=cfg.min_lr)
    run = TrainLoop(cfg, pm, optimizer, scheduler, examples, total, held=held,
                    save_checkpoint=partial(save_pipeline_checkpoint, pm), **method)
    _resume(run)
    say_phase("building the schedule and running the first step")
    summary = run.train()
    if cfg.save_hf_at_end and "interrupted" not in summary:  # a run stopped by a signal is saved, not exported
        _export(cfg, pm, run.step_dir())
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _setup_logging(rank: int) -> None:
    """Rank 0 logs at ``--log-level`` (``HFPIPE_LOG_LEVEL``), others warnings (all: DEBUG); one handler."""
    level = rank_level(rank)
    quiet_import_noise(level)
    logger = logging.getLogger("hfpipe")
    logger.setLevel(level)
    fmt = log_formatter(rank)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    for handler in logger.handlers:
        handler.setFormatter(fmt)
    logger.propagate = False


def _load_data(cfg, pm, dist_info):
    """Tokenise on rank 0 first (datasets caches it), then let the others read the cache."""
    tok = run_tokenizer(pm.source.folder, cfg)
    # The preflight (the launcher's, or rank 0's under torchrun) loaded these rows and said so.
    said = logging.getLogger("hfpipe.data.load")
    level = said.level
    said.setLevel(logging.WARNING)
    try:
        if dist_info.rank == 0:
            splits = load_run_splits(cfg, tok)
        dist.barrier()
        if dist_info.rank != 0:
            splits = load_run_splits(cfg, tok)
    finally:
        said.setLevel(level)
    return splits


def _method(cfg, pm, examples):
    """The rows and the loop's options of ``--method``: SFT's as they are; under dpo the pairs with their
    reference log-probs (computed by the reference pass, or read back on resume) and TRL's DPO loss."""
    if cfg.method != "dpo":
        return examples, {}
    say_phase("reference pass: the reference log-probs of every pair")
    pad = trl_pad_id(run_tokenizer(pm.source.folder, cfg))
    pairs, record = prepare_preference(cfg, pm, examples, pad)
    return pairs, dict(epoch_batches=preference_batches(cfg, pm, pairs, pad), step_metrics=partial(pair_metrics, pm),
                       record={"reference": record})


def _total_steps(cfg, examples) -> int:
    per_epoch = batches_per_epoch(examples, cfg.batch_size, cfg.dp) // cfg.grad_accum
    return cfg.max_steps or cfg.epochs * per_epoch


def _resume(run: TrainLoop) -> None:
    """With --resume: its checkpoint into this rank's pipeline, optimizer and schedule; the loop continues there."""
    cfg, pm = run.cfg, run.pm
    path = resolve_resume(cfg.resume, cfg.output_dir)
    if path is None:
        return
    changed = check_resume(path, read_meta(path), cfg, pm.tied, per_microbatch=router_loss_on(pm.source.config))
    meta = load_checkpoint(path, pipeline_view(pm), run.optimizer)
    load_scheduler_state(run.scheduler, meta["train"]["scheduler"])  # groups may differ by layout
    pos = RunPosition(**meta["train"]["position"])
    run.resume_at(pos, path)
    note = apply_schedule_changes(changed, meta, cfg, run.optimizer, run.scheduler, pos.step)
    log.info(note or "resumed from %s at step %d", *(() if note else (path, pos.step)))


def _export(cfg: FinetuneConfig, pm, ckpt: Path) -> None:
    """The last checkpoint as a Hugging Face folder, ``output_dir/hf`` (rank 0 writes it, every rank waits)."""
    if pm.dist.rank == 0:
        # chat as trained: transformers prefers chat_template.jinja to the tokenizer's template
        export_checkpoint(ckpt, Path(cfg.output_dir) / "hf", force=True, progress=False,
                          chat_template=cfg.chat_template)
    dist.barrier()
