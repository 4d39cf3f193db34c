"""``hfpipe finetune``: check the run up front, start the processes, train, checkpoint, export.

The data path of one run: FinetuneConfig -> preflight (config, plan, schedule, data: every user
error before any process or folder exists) -> pp*dp workers (launched here, or torchrun/srun's) ->
load_pipeline -> data shards -> StepEngine steps -> DCP checkpoints -> optional HF export.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hfpipe.config.run import FinetuneConfig
from hfpipe.data.batches import model_inputs
from hfpipe.parallel.launch import say_phase

__all__ = ["preflight", "run_finetune", "run_worker"]

log = logging.getLogger(__name__)


def preflight(cfg: FinetuneConfig, *, check_data: bool = True) -> None:
    """Raise the user's errors before anything starts or is written.

    Checks the model config and architecture, the plan, the schedule's microbatch needs, the
    sequence length, the dataset's fields, and that there is at least one step to run.
    """
    from hfpipe.data.batches import batches_per_epoch
    from hfpipe.data.config import check_seq_len
    from hfpipe.models.support import get_adapter
    from hfpipe.parallel.rules import check_layout
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.config import check_vocab
    from hfpipe.source.folder import ModelSource
    from hfpipe.progress.logs import check_sinks

    check_sinks(cfg.report_to)
    source = ModelSource.open(cfg.model, trust_remote_code=cfg.trust_remote_code)
    get_adapter(source.config)
    layout = check_layout(cfg.dims, cfg.schedule, vpp=cfg.vpp, microbatches=cfg.microbatches,
                          reshard_per_microbatch=cfg.reshard_per_microbatch,
                          batch_size=cfg.batch_size, model_config=source.config, seq_len=cfg.seq_len)
    plan_pipeline(source.config, cfg.pp, vpp=layout.vpp, style=layout.style,
                  method=cfg.plan_method, layout=cfg.layout, seq_len=cfg.seq_len)
    check_seq_len(cfg.seq_len, source.config)
    if source.repo_id is None:  # local shards: check every header now (hub shards download later)
        for name in sorted(set(source.weight_map.values())):
            source.header(name)
    tokenizer = _tokenizer(source.folder, cfg)
    check_vocab(tokenizer, source.config, source.folder)
    _check_output(cfg, source)  # cheap, so before the (logged) dataset work
    examples = _load_splits(cfg, tokenizer)[0] if check_data else None
    if examples is not None and batches_per_epoch(examples, cfg.batch_size, cfg.dp) < cfg.grad_accum:
        from hfpipe.data.config import DataError

        raise DataError(f"--dataset {cfg.dataset} has {len(examples)} sequences of --seq-len {cfg.seq_len}: "
                        "fewer than one optimizer step; lower --batch-size/--grad-accum or add data")


def _check_output(cfg: FinetuneConfig, source) -> None:
    """The output folder can take this run, and what --resume names is this run's checkpoint."""
    from hfpipe.checkpoint.dcp import CheckpointError, read_meta, resolve_resume
    from hfpipe.train.lora_preflight import check_lora_run
    from hfpipe.train.resume_check import check_resume

    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--output-dir {out} is a file; choose a folder")
    ckpts = out / "checkpoints"
    if not cfg.resume and any(ckpts.glob("step-*")):
        raise CheckpointError(f"--output-dir {cfg.output_dir} already holds checkpoints; "
                              "pass --resume auto to continue, or choose another --output-dir")
    resumed = resolve_resume(cfg.resume, cfg.output_dir)
    if resumed is not None:  # a mismatch is a preflight error too, before any process starts
        check_resume(resumed, read_meta(resumed), cfg, source.tied)
    check_lora_run(cfg, source.config, resumed)
    _check_writable(out)


def _check_writable(out: Path) -> None:
    from hfpipe.checkpoint.dcp import CheckpointError

    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"--output-dir {out}: {parent} is not writable; choose another folder")


def _data_config(cfg: FinetuneConfig, *, held_out: bool = False):
    """The training data's options; with ``held_out``, the evaluation set's (None without one)."""
    from hfpipe.data.config import DataConfig

    source = dict(dataset=cfg.dataset, dataset_config=cfg.dataset_config, split=cfg.split)
    if held_out and not (cfg.eval_dataset or cfg.eval_split):
        return None
    if held_out and cfg.eval_dataset:  # another source: the training one's configuration is not its
        source.update(dataset=cfg.eval_dataset, dataset_config=None)
    if held_out and cfg.eval_split:
        source.update(split=cfg.eval_split)
    return DataConfig(**source, format=cfg.format, seq_len=cfg.seq_len, packing=cfg.packing,
                      seed=cfg.seed, columns=cfg.columns, roles=cfg.roles,
                      chat_template=cfg.chat_template, train_on_prompt=cfg.train_on_prompt,
                      allow_dropped_records=cfg.allow_dropped_records)


def _load_splits(cfg: FinetuneConfig, tok):
    """Training rows and evaluation rows (None without an evaluation set)."""
    from hfpipe.data.load import load_splits

    return load_splits(_data_config(cfg), tok, eval_cfg=_data_config(cfg, held_out=True),
                       eval_fraction=cfg.eval_fraction)


def _tokenizer(folder: Path, cfg: FinetuneConfig):
    from hfpipe.source.folder import load_tokenizer

    return load_tokenizer(folder, trust_remote_code=cfg.trust_remote_code)


def run_finetune(cfg: FinetuneConfig, *, nnodes: int = 1, node_rank: int = 0,
             rdzv_endpoint: str | None = None) -> dict:
    """Run a fine-tuning job; return the summary of the rank that reports the loss.

    Under torchrun/srun (RANK and WORLD_SIZE, or SLURM_PROCID set) this process is one worker;
    otherwise ``pp * dp * tp`` local workers are started through torch's elastic launcher.
    """
    from hfpipe.parallel.mesh import in_launched_env, launched_node
    from hfpipe.parallel.launch import check_launch, launch
    from hfpipe.parallel.lock import run_lock
    from hfpipe.progress.ticker import Ticker

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
    from hfpipe.parallel.signals import Interrupted

    if summary.get("interrupted"):
        raise Interrupted(summary["interrupted"], summary["step"], summary.get("checkpoint"))
    return summary


@dataclass
class _Position:
    """Where the data stream stands: exact resume needs all three."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def run_worker(cfg_dict: dict) -> dict:
    """One rank of a run (module level so the launcher can start it)."""
    from hfpipe.pipeline.build import build_pipeline
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.options import from_config
    from hfpipe.train.optim import build_optimizer, build_scheduler

    cfg = FinetuneConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    say_phase("joining the process group")
    dist_info = init_distributed(cfg.dims, timeout_s=cfg.timeout)
    _setup_logging(dist_info.rank)
    say_phase("loading this rank's stages")
    pm = build_pipeline(cfg.model, *from_config(cfg), trust_remote_code=cfg.trust_remote_code, dist=dist_info)
    say_phase("reading the tokenised data")
    examples, held = _load_data(cfg, pm, dist_info)
    total = _total_steps(cfg, examples)
    optimizer = build_optimizer(pm.modules, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=total,
                                schedule=cfg.lr_schedule, lr=cfg.lr, min_lr=cfg.min_lr)
    run = _Run(cfg, pm, optimizer, scheduler, examples, total, held=held)
    run.maybe_resume()
    say_phase("building the schedule and running the first step")
    summary = run.train()
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _setup_logging(rank: int) -> None:
    """Rank 0 logs at ``--log-level`` (``HFPIPE_LOG_LEVEL``), others warnings (all: DEBUG); one handler."""
    from hfpipe.progress.logs import log_formatter, quiet_import_noise, rank_level

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
    tok = _tokenizer(pm.source.folder, cfg)
    # The preflight (the launcher's, or rank 0's under torchrun) loaded these rows and said so.
    said = logging.getLogger("hfpipe.data.load")
    level = said.level
    said.setLevel(logging.WARNING)
    try:
        if dist_info.rank == 0:
            splits = _load_splits(cfg, tok)
        dist.barrier()
        if dist_info.rank != 0:
            splits = _load_splits(cfg, tok)
    finally:
        said.setLevel(level)
    return splits


def _total_steps(cfg, examples) -> int:
    from hfpipe.data.batches import batches_per_epoch

    per_epoch = batches_per_epoch(examples, cfg.batch_size, cfg.dp) // cfg.grad_accum
    return cfg.max_steps or cfg.epochs * per_epoch


class _Run:
    """The training loop of one rank: steps, metrics, checkpoints."""

    def __init__(self, cfg, pm, optimizer, scheduler, examples, total: int, *, held=None) -> None:
        self.cfg, self.pm, self.optimizer, self.scheduler = cfg, pm, optimizer, scheduler
        self.examples, self.total = examples, total
        self.held = held  # the evaluation rows, or None
        from hfpipe.train.step import trainer_for

        self.trainer = trainer_for(pm, optimizer, scheduler=scheduler, max_grad_norm=cfg.max_grad_norm)
        self.pos = _Position()
        self.out = Path(cfg.output_dir)
        coords = pm.dist.dims.coords(pm.dist.rank)  # one reporter: the loss rank of replica 0, cp and tp rank 0
        self.reporter = coords["pp"] == pm.loss_rank and coords["dp"] == coords["cp"] == coords["tp"] == 0
        self.history: list[dict] = []
        self.evals: list[dict] = []  # evaluation rows
        self.pending = None  # the async save still being written, if any
        self.start = 0  # the step this process started (or resumed) at
        self.last_saved: Path | None = None
        from hfpipe.parallel.signals import StopRequest

        self.stop = StopRequest(pm.dist.device).install()

    def maybe_resume(self) -> None:
        from hfpipe.checkpoint.dcp import load_checkpoint, read_meta, resolve_resume
        from hfpipe.checkpoint.pipeline_state import pipeline_view
        from hfpipe.train.optim import load_scheduler_state
        from hfpipe.train.resume_check import apply_schedule_changes, check_resume

        path = resolve_resume(self.cfg.resume, self.cfg.output_dir)
        if path is None:
            return
        changed = check_resume(path, read_meta(path), self.cfg, self.pm.tied)
        meta = load_checkpoint(path, pipeline_view(self.pm), self.optimizer)
        load_scheduler_state(self.scheduler, meta["train"]["scheduler"])  # groups may differ by layout
        self.pos = _Position(**meta["train"]["position"])
        self.start, self.last_saved = self.pos.step, path
        note = apply_schedule_changes(changed, meta, self.cfg, self.optimizer, self.scheduler, self.pos.step)
        log.info(note or "resumed from %s at step %d", *(() if note else (path, self.pos.step)))

    def _batches(self):
        """Yield this dp rank's batches forever, from the saved position, epoch after epoch."""
        from hfpipe.data.batches import batches_per_epoch, iterate_batches

        d = self.pm.dist
        while True:
            it = iterate_batches(self.examples, batch_size=self.cfg.batch_size, seed=self.cfg.seed,
                                 epoch=self.pos.epoch, dp_rank=d.dp_rank, dp_size=d.dp,
                                 start=self.pos.batch_in_epoch)
            for batch in it:
                self.pos.batch_in_epoch += 1
                yield model_inputs(batch, packed=self.cfg.packing)
            if self.pos.batch_in_epoch < batches_per_epoch(self.examples, self.cfg.batch_size, d.dp):
                raise RuntimeError("data iterator stopped early")
            self.pos.epoch += 1
            self.pos.batch_in_epoch = 0

    def train(self) -> dict:
        from hfpipe.train.evaluate import Evaluator
        from hfpipe.progress.reporter import Reporter

        stream = self._batches()
        report = Reporter(self.out, self.total, enabled=self.reporter, start=self.pos.step,
                          log_every=self.cfg.log_every, report_to=self.cfg.report_to,
                          config=self.cfg.to_dict())
        evaluator = Evaluator(self.cfg, self.trainer, self.held, self.pm.dist, self.out)
        while self.pos.step < self.total:
            batches = [next(stream) for _ in range(self.cfg.grad_accum)]
            result = self.trainer.step(batches)
            if self.pos.step == self.start:  # the first step's line follows: the launcher's ticker stops
                say_phase(None)
            self.pos.step += 1
            row = report.log(self.pos.step, result)
            self.history.append(row)
            self._stop_if_diverged(result, report)
            if evaluator.due(self.pos.step, final=self.pos.step == self.total):
                self._evaluate(evaluator, report)
            signum = self.stop.agreed()  # collective: every rank stops after the same step
            if signum or (self.cfg.save_every and self.pos.step % self.cfg.save_every == 0):
                self.save()
            if signum:
                return self._interrupted(signum, report)
        if evaluator.due(self.pos.step, final=True):  # a resumed run that had nothing left to do
            self._evaluate(evaluator, report)
        report.close()
        say_phase("saving the last checkpoint" + (", exporting" if self.cfg.save_hf_at_end else "") + " and stopping")
        if self.pos.step > self.start and self.last_saved != self._step_dir():
            self.save()  # never at a step already saved: a finished run resumed is not rewritten
        if self.pending is not None:
            self.pending.wait()
        final = self.out / "checkpoints" / f"step-{self.pos.step:08d}"
        if self.cfg.save_hf_at_end:
            self._export(final)
        if not self.reporter:
            return {}
        best = next(iter(sorted((self.out / "best").glob("step-*"))), None) if self.cfg.keep_best else None
        return {"history": self.history, "checkpoint": str(final), "evals": self.evals,
                "best": str(best) if best else None}

    def _evaluate(self, evaluator, report) -> None:
        """Evaluate, record the row, and with --keep-best save a new best model to out/best."""
        row = evaluator.run(self.pos.step)
        report.log_eval(row)
        self.evals.append(row)
        if self.cfg.keep_best and evaluator.improved:
            from hfpipe.checkpoint.pipeline_state import save_pipeline_checkpoint

            if self.pending is not None:  # one save in flight at a time
                self.pending.wait()
                self.pending = None
            save_pipeline_checkpoint(self.pm, self.out / "best", self.pos.step, None, keep=1,
                                    extra={"config": self.cfg.to_dict(), "eval": row})

    def _step_dir(self) -> Path:
        return self.out / "checkpoints" / f"step-{self.pos.step:08d}"

    def _stop_if_diverged(self, result, report) -> None:
        from hfpipe.train.finite import NonFiniteStep, check_finite

        try:
            check_finite(self.pos.step, result.loss, result.grad_norm, self.last_saved)
        except NonFiniteStep:
            report.close()
            if self.pending is not None:
                self.pending.wait()  # the save in flight is of a good step: let it finish
            raise

    def _interrupted(self, signum: int, report) -> dict:
        """After a stop request: the checkpoint is saved; finish it and say so (every rank)."""
        report.close()
        if self.pending is not None:
            self.pending.wait()
        self.stop.uninstall()
        return {"interrupted": signum, "step": self.pos.step, "checkpoint": str(self._step_dir()),
                "history": self.history}

    def save(self) -> None:
        from hfpipe.checkpoint.pipeline_state import save_pipeline_checkpoint
        from hfpipe.train.resume_check import template_digest

        extra = {"config": self.cfg.to_dict(),
                 "train": {"position": vars(self.pos).copy(), "scheduler": self.scheduler.state_dict()}}
        if self.cfg.chat_template:  # a resume must mask the data the same way: the file, not its name
            extra["data"] = {"chat_template_sha256": template_digest(self.cfg.chat_template)}
        if self.pending is not None:  # one save in flight at a time; finalise the previous first
            self.pending.wait()
        saved = save_pipeline_checkpoint(self.pm, self.out / "checkpoints", self.pos.step, self.optimizer,
                                        keep=self.cfg.keep, extra=extra, async_save=self.cfg.async_save)
        self.pending = saved if self.cfg.async_save else None
        self.last_saved = self._step_dir()

    def _export(self, ckpt: Path) -> None:
        from hfpipe.export.hf_folder import export_checkpoint

        if self.pm.dist.rank == 0:
            # chat as trained: transformers prefers chat_template.jinja to the tokenizer's template
            export_checkpoint(ckpt, self.out / "hf", force=True, progress=False, chat_template=self.cfg.chat_template)
        dist.barrier()
