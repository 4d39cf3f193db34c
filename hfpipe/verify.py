"""Check a model folder end to end: hfpipe's pipelined logits against transformers' own.

``hfpipe verify DIR --pp 2`` answers "will this checkpoint train correctly here?" before a long run:
transformers computes reference logits in this process (fp32, the whole model), then ``pp`` real
processes each load only their stages through hfpipe's loader and run the same batch through the
pipeline schedule. The logits must agree to ``tolerance``; the KL divergence says how much a
difference would matter to a probability.

Everything that can be checked without weights (config, index, shard headers and sizes, the plan,
the microbatch rules) is checked here first, so a broken folder fails in a second with one line.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["VerifyResult", "verify"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class VerifyResult:
    """How far the pipelined logits are from transformers', over the real (unpadded) tokens."""

    max_abs_diff: float
    kl: float  # mean over tokens of KL(transformers || pipeline), nats
    tolerance: float
    tokens: int
    pp: int
    schedule: str

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def summary(self) -> str:
        """One line: the numbers and PASS or FAIL."""
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: max |logits - transformers| = {self.max_abs_diff:.3e} (tolerance "
                f"{self.tolerance:.0e}), KL(transformers || pipeline) = {self.kl:.3e} nats/token, "
                f"{self.tokens} tokens, pp {self.pp}, {self.schedule}")


_SEQ_LEN = 32  # the default sample's length


def verify(hf_dir: str | Path, pp: int = 2, schedule: str = "1f1b", tolerance: float = 1e-5,
           seq_len: int | None = None, batch: int | None = None, *,
           trust_remote_code: bool = False) -> VerifyResult:
    """Run ``hf_dir`` through a ``pp``-rank pipeline and compare its logits with transformers'.

    Args:
        hf_dir: A Hugging Face model folder (config.json + safetensors), or a PEFT LoRA adapter
            folder: then its base runs with the adapters, against ``PeftModel.from_pretrained``.
        pp: Pipeline ranks (processes started on this machine).
        schedule: Pipeline schedule; interleaved and V schedules put two stages on each rank.
        tolerance: Largest allowed absolute logit difference.
        seq_len: Tokens per sample sequence; default 32, or the model's context if shorter.
        batch: Sample sequences; default the number of stages (at least 2), one per microbatch.
        trust_remote_code: Allow transformers to run code from the folder.

    Returns:
        The :class:`VerifyResult` (``passed`` tells the verdict).

    Raises:
        SourceError, LoadError, PlanError, PipelineError, UnsupportedModelError: the folder or
            the options cannot be used (one line saying what to fix).
    """
    from hfpipe.progress.ticker import Ticker

    with Ticker("checking the folder, the plan and the shards"):
        from hfpipe.parallel.launch import launch

        source, adapter_dir, plan, microbatches, inputs = _prepare(hf_dir, pp, schedule, tolerance, seq_len,
                                                                    batch, trust_remote_code)
    with Ticker(f"{'PEFT' if adapter_dir else 'transformers'}: the reference logits in this process"):
        reference = _reference_logits(source.folder, inputs, trust_remote_code, adapter_dir)
    with Ticker(f"the pipeline's logits in {pp} processes"):
        results = launch(_rank_logits, pp, str(source.folder), plan, schedule, microbatches, inputs,
                         trust_remote_code, adapter_dir)
    logits = _gather(results)
    return _compare(reference, logits, inputs["attention_mask"].bool(), tolerance, pp, schedule)


def _prepare(hf_dir, pp: int, schedule: str, tolerance: float, seq_len, batch, trust_remote_code: bool):
    """Every check before a model loads; ``(source, adapter_dir, plan, microbatches, inputs)``."""
    from hfpipe.models.support import get_adapter
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import check_gpus
    from hfpipe.parallel.rules import check_layout
    from hfpipe.pipeline.schedule import PipelineError
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    from hfpipe.data.config import check_seq_len, context_limit
    from hfpipe.lora.folder import check_adapter_weights, read_adapter_folder
    from hfpipe.config.options import require_tolerance

    if seq_len is not None and seq_len < 2:  # one token has no next-token logits to compare over
        raise PipelineError(f"--seq-len must be >= 2, got {seq_len}")
    if batch is not None and batch < 1:
        raise PipelineError(f"--batch-size must be >= 1, got {batch}")
    require_tolerance(tolerance)
    adapter = read_adapter_folder(hf_dir)  # a PEFT LoRA folder: its base, with the adapters on top
    adapter_dir = str(hf_dir) if adapter else None
    source = ModelSource.open(adapter[0] if adapter else hf_dir, trust_remote_code=trust_remote_code)
    get_adapter(source.config)
    if adapter:  # keys, ranks and shapes from the headers, before PEFT's reference allocates anything
        check_adapter_weights(hf_dir, adapter[1], source.config)
    if seq_len is None:  # a small model's context may be shorter than the default sample
        seq_len = min(_SEQ_LEN, context_limit(source.config) or _SEQ_LEN)
    check_seq_len(seq_len, source.config)
    layout = check_layout(ParallelDims(pp=pp), schedule)
    microbatches = layout.microbatches
    batch = batch or max(2, microbatches)
    check_layout(layout.dims, schedule, batch_size=batch)
    plan = plan_pipeline(source.config, pp, vpp=layout.vpp, style=layout.style, seq_len=seq_len)
    _check_shards(source)
    inputs = _sample_batch(source.config, batch, seq_len)
    check_gpus(pp)
    return source, adapter_dir, plan, microbatches, inputs


def _check_shards(source) -> None:
    """Every shard the index names exists, has a readable header and all its bytes."""
    from hfpipe.source.folder import SourceError

    for name in sorted(set(source.weight_map.values())):
        header = source.header(name)  # SourceError if missing or the header is corrupt
        path = source.path(name)
        need = header["__data_start__"]["offset"] + max(
            (e["data_offsets"][1] for k, e in header.items() if k != "__data_start__"), default=0)
        have = path.stat().st_size
        if have < need:
            raise SourceError(f"{path}: truncated shard ({have} of {need} bytes); re-download it")


def _sample_batch(config, batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Seeded random token ids over the whole vocabulary; the last row right-padded by a quarter."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)  # (B, T)
    mask = torch.ones_like(ids)
    pad = seq_len // 4
    if pad:
        mask[-1, -pad:] = 0
        ids[-1, -pad:] = getattr(config, "pad_token_id", None) or 0
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def _reference_logits(folder: Path, inputs: dict, trust_remote_code: bool,
                      adapter_dir: str | None = None) -> torch.Tensor:
    """transformers' logits (fp32, one process), through PEFT with an adapter; the model is freed."""
    from transformers import AutoModelForCausalLM

    from hfpipe.pipeline.load import LoadError
    from hfpipe.progress.logs import quiet_transformers

    with quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, trust_remote_code=trust_remote_code,
            ignore_mismatched_sizes=True, output_loading_info=True)
    for kind in ("mismatched_keys", "missing_keys", "unexpected_keys"):
        keys = sorted(map(str, info.get(kind) or ()))
        if keys:
            what = kind.split("_")[0]
            raise LoadError(f"{folder}: {len(keys)} {what} tensor(s) in transformers' load, e.g. "
                            f"{keys[0]}; config.json does not match the weights")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    logits = model.eval()(**inputs, use_cache=False).logits.float()  # (B, T, V)
    del model
    return logits


def _rank_logits(hf_dir: str, plan, schedule: str, microbatches: int, inputs: dict,
                 trust_remote_code: bool, adapter_dir: str | None = None):
    """One pipeline rank: load its stages, run the batch; the last stage's rank returns logits.

    User errors come back as values, not exceptions, after every rank has agreed that loading
    failed somewhere (so no rank is left waiting in a send for a peer that already gave up).
    """
    import torch.distributed as dist

    from hfpipe.progress.logs import quiet_import_noise, rank_level

    quiet_import_noise(rank_level(int(os.environ.get("RANK", "0"))))  # before PEFT imports torchao
    from hfpipe.pipeline.build import build_pipeline
    from hfpipe.pipeline.options import PipelineLayout, StageOptions
    from hfpipe.parallel.mesh import init_distributed

    mesh = init_distributed(plan.pp)
    try:
        error = None
        try:
            from hfpipe.lora.folder import load_adapter_weights, read_adapter_folder

            lora = read_adapter_folder(adapter_dir)[1] if adapter_dir else None
            layout = PipelineLayout(pp=plan.pp, vpp=plan.vpp, schedule=schedule, microbatches=microbatches)
            pm = build_pipeline(hf_dir, layout, StageOptions(lora=lora), trust_remote_code=trust_remote_code,
                                dist=mesh)
            if adapter_dir:
                load_adapter_weights(pm.modules, adapter_dir)
        except ValueError as e:  # hfpipe's user-facing errors are ValueErrors
            error = ("error", type(e).__module__, type(e).__qualname__, str(e))
        failed = torch.tensor([error is not None], dtype=torch.int64, device=mesh.device)
        dist.all_reduce(failed, group=mesh.pp_group)
        if failed.item():
            return error or ("peer failed",)
        logits = pm.forward(inputs)
        return ("logits", None if logits is None else logits.float().cpu())
    finally:
        dist.destroy_process_group()


def _gather(results: dict) -> torch.Tensor:
    """The last stage's logits out of every rank's result; re-raise a rank's user error here."""
    for result in results.values():
        if result[0] == "error":
            _, module, name, message = result
            cls = getattr(importlib.import_module(module), name, None)
            raise (cls if isinstance(cls, type) and issubclass(cls, ValueError) else ValueError)(message)
    (logits,) = [r[1] for r in results.values() if r[0] == "logits" and r[1] is not None]
    return logits


def _compare(ref: torch.Tensor, got: torch.Tensor, real: torch.Tensor, tolerance: float, pp: int,
             schedule: str) -> VerifyResult:
    ref, got = ref[real].double(), got[real].double()  # (N, V): real tokens only
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return VerifyResult(max_abs_diff=(ref - got).abs().max().item(), kl=max(kl.item(), 0.0),
                        tolerance=tolerance, tokens=int(real.sum()), pp=pp, schedule=schedule)
