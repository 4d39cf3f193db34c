"""Every user error of a run, raised before any process starts or any folder is written.

:func:`preflight` checks the model, the layout and its plan, the sequence length, the tokenizer, the output
folder and what ``--resume`` names, the LoRA settings, and that the data makes at least one optimizer step.
The run's data options live here too (:func:`data_config`, :func:`load_run_splits`, :func:`run_tokenizer`):
the workers read the data as the preflight checked it.

``cfg`` is a :class:`hfpipe.config.run.FinetuneConfig` throughout, read by its fields and not imported: this
module sits a floor below the config, so that the runner which imports both stays within the package's floors.
"""

from __future__ import annotations

import os
from pathlib import Path

from hfpipe.checkpoint.dcp import CheckpointError, read_meta, resolve_resume
from hfpipe.data.batches import batches_per_epoch
from hfpipe.data.config import DataConfig, DataError, check_seq_len
from hfpipe.data.load import load_pairs, load_splits
from hfpipe.data.preference import REFERENCE_FILE
from hfpipe.files import read_side_json
from hfpipe.lora.adapters import LoraError, from_finetune_config, resolve_config
from hfpipe.lora.tensor import check_tp_lora
from hfpipe.models.meta import build_meta_model, model_config as hf_config
from hfpipe.models.router_loss import router_loss_on
from hfpipe.models.support import get_adapter
from hfpipe.parallel.rules import check_layout
from hfpipe.plan.split import plan_pipeline
from hfpipe.progress.logs import check_sinks
from hfpipe.quant.linear import check_quantize
from hfpipe.source.config import check_vocab
from hfpipe.source.folder import ModelSource, load_tokenizer
from hfpipe.train.resume_check import check_resume

__all__ = ["check_lora_run", "data_config", "load_run_splits", "preflight", "run_tokenizer"]


def preflight(cfg, *, check_data: bool = True) -> None:
    """Raise the user's errors before anything starts or is written.

    Checks the model config and architecture, the plan, the schedule's microbatch needs, the
    sequence length, the dataset's fields, and that there is at least one step to run.
    """
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
    tokenizer = run_tokenizer(source.folder, cfg)
    check_vocab(tokenizer, source.config, source.folder)
    _check_output(cfg, source)  # cheap, so before the (logged) dataset work
    examples = load_run_splits(cfg, tokenizer)[0] if check_data else None
    if examples is not None and batches_per_epoch(examples, cfg.batch_size, cfg.dp) < cfg.grad_accum:
        raise DataError(f"--dataset {cfg.dataset} has {len(examples)} sequences of --seq-len {cfg.seq_len}: "
                        "fewer than one optimizer step; lower --batch-size/--grad-accum or add data")


def _check_output(cfg, source) -> None:
    """The output folder can take this run, and what --resume names is this run's checkpoint."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--output-dir {out} is a file; choose a folder")
    ckpts = out / "checkpoints"
    if not cfg.resume and any(ckpts.glob("step-*")):
        raise CheckpointError(f"--output-dir {cfg.output_dir} already holds checkpoints; "
                              "pass --resume auto to continue, or choose another --output-dir")
    resumed = resolve_resume(cfg.resume, cfg.output_dir)
    if resumed is not None:  # a mismatch is a preflight error too, before any process starts
        check_resume(resumed, read_meta(resumed), cfg, source.tied, per_microbatch=router_loss_on(source.config))
        if cfg.method == "dpo" and not (out / REFERENCE_FILE).is_file():  # read back, never recomputed
            raise CheckpointError(f"--resume {resumed}: {out / REFERENCE_FILE} is missing, the reference log-probs "
                                  "the run stored at its start; start the run afresh in another --output-dir")
    check_lora_run(cfg, source.config, resumed)
    _check_writable(out)


def _check_writable(out: Path) -> None:
    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"--output-dir {out}: {parent} is not writable; choose another folder")


def check_lora_run(cfg, model_config, resume: str | None = None) -> None:
    """Check a run's LoRA settings on the meta model, and that a resumed checkpoint is of the same kind.

    Raises:
        LoraError: targets matching nothing, or a LoRA/full checkpoint resumed by the other kind of run.
        QuantError: a ``--quantize-base`` block size that does not fit the model, or torchao missing.
    """
    config = from_finetune_config(cfg)
    if config is not None:
        full = build_meta_model(hf_config(model_config))
        resolved = resolve_config(config, full)
        if cfg.tp > 1:
            check_tp_lora(resolved, cfg.tp)
        if getattr(cfg, "quantize_base", None) is not None:  # block sizes and torchao, before any process starts
            check_quantize(model_config, cfg.quantize_base, cfg.quantize_block_size, tp=cfg.tp)  # plan calls it too
    if resume is None:
        return
    meta = read_side_json(resume / "hfpipe.json")  # checked whole by the resume preflight before this
    saved = meta.get("lora")
    if (saved is None) != (config is None):
        kind = "a LoRA" if saved is not None else "a full fine-tuning"
        fix = "add --lora-rank" if saved is not None else "drop --lora-rank"
        raise LoraError(f"--resume {resume} is {kind} checkpoint; {fix} to resume it, or start afresh")
    if saved is not None and saved.get("r") != config.r:
        raise LoraError(f"--resume {resume} holds rank-{saved.get('r')} adapters; pass --lora-rank {saved.get('r')}")
    was = (meta.get("quantize_base") or {}).get("kind")
    if saved is not None and was != getattr(cfg, "quantize_base", None):
        fix = f"pass --quantize-base {was}" if was else "drop --quantize-base"
        raise LoraError(f"--resume {resume} trained its adapters on a {was or 'full-precision'} base; {fix}")


def data_config(cfg, *, held_out: bool = False) -> DataConfig | None:
    """The training data's options; with ``held_out``, the evaluation set's (None without one)."""
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


def load_run_splits(cfg, tok):
    """Training rows and evaluation rows (None without an evaluation set); under --method dpo the preference
    pairs (:func:`hfpipe.data.load.load_pairs`) and no evaluation set."""
    if cfg.method == "dpo":
        return load_pairs(data_config(cfg), tok), None
    return load_splits(data_config(cfg), tok, eval_cfg=data_config(cfg, held_out=True),
                       eval_fraction=cfg.eval_fraction)


def run_tokenizer(folder: Path, cfg):
    """The run's tokenizer, from the model's folder."""
    return load_tokenizer(folder, trust_remote_code=cfg.trust_remote_code)
