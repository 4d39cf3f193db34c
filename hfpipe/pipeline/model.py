"""This rank's part of a pipelined model: :func:`load_pipeline` builds it, :class:`PipelineModel` runs and saves it.

The run loop (:mod:`hfpipe.train.runner`) and ``verify`` stand on this module; the public face,
:mod:`hfpipe.api`, adds ``trainer`` (:mod:`hfpipe.train.step`, a floor above) and ``save_pretrained``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from hfpipe.models.support import get_adapter
from hfpipe.parallel.dims import ParallelDims, check_degrees
from hfpipe.parallel.mesh import Dist, init_distributed
from hfpipe.parallel.rules import check_layout
from hfpipe.pipeline.build import StageOptions, build_rank_stages
from hfpipe.pipeline.inputs import check_batches
from hfpipe.pipeline.params import unique_parameters
from hfpipe.pipeline.schedule import Pipeline, PipelineError
from hfpipe.plan.split import Plan, plan_pipeline
from hfpipe.source.folder import ModelSource

__all__ = ["PipelineModel", "load_pipeline", "DTYPES"]

log = logging.getLogger(__name__)

# --dtype: (dtype the parameters are stored in, dtype the compute runs in)
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16": (torch.bfloat16, torch.bfloat16),
}


@dataclass
class PipelineModel:
    """This rank's part of a pipelined model.

    Attributes:
        source: The checkpoint it was loaded from.
        plan: Every stage's layout.
        dist: This rank's place in the (dp, pp) mesh.
        modules: This rank's stage modules (parameter names are the full model's).
        pipe: The schedule driver.
        tied_group: Group summing the tied embedding's gradient halves, or ``None``.
        lora: The ``LoraConfig`` whose adapters are the only trainable parameters, or ``None``.
    """

    source: ModelSource
    plan: Plan
    dist: Dist
    modules: list
    pipe: Pipeline
    tied_group: object = None
    lora: object = None  # the resolved peft.LoraConfig of a LoRA run (base frozen), or None
    quantize: object = None  # the hfpipe.quant.linear.QuantSpec of a quantized base, or None
    ep: int = 1  # ranks each MoE layer's routed experts are sharded over

    @property
    def loss_rank(self) -> int:
        """The pipeline rank holding the last stage (rank 0 for V schedules)."""
        return self.plan.rank_of_stage(len(self.plan.stages) - 1)

    def parameters(self):
        """This rank's trainable parameters, each shared tensor once (for your optimizer).

        On a rank whose stages are all empty (a layout such as ``E||t*30|L``) this is one empty
        parameter *group*, ``[{"params": []}]``: any torch optimizer accepts it (an empty list it
        refuses), so the same optimizer line runs on every rank and its steps do nothing there.
        """
        params = [p for _, p in unique_parameters(self.modules)]
        return params or [{"params": []}]

    def named_parameters(self):
        return unique_parameters(self.modules)

    @property
    def vocab_size(self) -> int | None:
        """Token ids a batch may hold: 0 .. vocab_size - 1."""
        config = self.source.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "vocab_size", None)

    def forward(self, batch: dict) -> torch.Tensor | None:
        """Logits on the loss rank, ``None`` elsewhere (no gradients)."""
        check_batches([batch], self.vocab_size, "forward", labels=False)
        return self.pipe.forward(batch)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.source.config, "tie_word_embeddings", False))

    def view(self):
        """One module holding this rank's parameters under their full-model names (for DCP).

        Under LoRA it holds the adapters only: they are all a checkpoint needs besides the base.
        """
        from hfpipe.checkpoint.dcp import rank_view

        if self.lora is not None:
            from hfpipe.lora.adapters import adapter_view

            return adapter_view(self.modules)
        return rank_view(self.modules, self.tied)

    def save_checkpoint(self, root: str, step: int, optimizer=None, *, keep: int | None = None,
                        extra: dict | None = None, async_save: bool = False):
        """Save a DCP checkpoint ``root/step-<step>`` (every rank calls this).

        The checkpoint resumes at any pipeline size and exports with ``hfpipe export``.
        ``extra`` adds to (or replaces) the ``hfpipe.json`` fields. Returns the path, or with
        ``async_save`` a pending save whose ``wait()`` every rank must call.
        """
        from pathlib import Path

        from hfpipe.checkpoint.dcp import CheckpointError, save_checkpoint

        if Path(root).exists() and not Path(root).is_dir():
            raise CheckpointError(f"save_checkpoint(root={str(root)!r}): it is a file; give a folder "
                                  "(checkpoints go to root/step-XXXXXXXX)")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"save_checkpoint(step={step!r}): step must be an integer >= 0")
        config = self.source.config
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        meta = {"format": 1, "source": str(self.source.folder), "tied": self.tied,
                "source_dtype": str(dtype).replace("torch.", ""),
                "config": {"model": self.source.name, "pp": self.dist.pp, "dp": self.dist.dp, "ep": self.ep},
                "world": {"pp": self.dist.pp, "dp": self.dist.dp, "ep": self.ep}, "train": {}, **(extra or {})}
        if self.lora is not None:
            from hfpipe.lora.adapters import config_to_dict

            meta["lora"] = config_to_dict(self.lora)  # the base is meta["source"]
        if self.quantize is not None:
            meta["quantize_base"] = self.quantize.to_dict()  # how the base was quantized (for --merge)
        return save_checkpoint(Path(root), step, self.view(), optimizer, meta, keep=keep,
                               async_save=async_save)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under full-model names (a tied head is stored as the embedding)."""
        return dict(self.view().state_dict())


def _default_pp(dp: int) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // dp)


_CHECKPOINTING = ("none", "full", "selective")
#: load_pipeline's counts: (lowest value, whether None means "the default").
#: (The degrees pp, dp and ep are checked by hfpipe.parallel.dims, phrased for this call.)
_COUNTS = {"vpp": (1, True), "microbatches": (1, True), "seed": (0, False), "loss_chunk_tokens": (0, True)}


def _check_arguments(*, activation_checkpointing: str, **counts) -> None:
    """Refuse load_pipeline's arguments by their names (the CLI checked its flags already)."""
    for name, value in counts.items():
        low, optional = _COUNTS[name]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PipelineError(f"load_pipeline({name}={value!r}): {name} must be an integer >= {low}"
                                + (" (or None for the default)" if optional else ""))
    if activation_checkpointing not in _CHECKPOINTING:
        raise PipelineError(f"load_pipeline(activation_checkpointing={activation_checkpointing!r}): "
                            f"choose one of {', '.join(_CHECKPOINTING)}")


def load_pipeline(model: str, *, pp: int | None = None, dp: int = 1, ep: int = 1, vpp: int | None = None,
                  schedule: str = "1f1b", microbatches: int | None = None, method: str = "balanced",
                  layout: str | None = None, dtype: str = "fp32", activation_checkpointing: str = "none",
                  trust_remote_code: bool = False, dist: Dist | None = None, lora=None,
                  seed: int = 0, loss_chunk_tokens: int | None = None,
                  quantize_base: str | None = None, quantize_block_size: int | None = None,
                  model_class: type | None = None) -> PipelineModel:
    """Load this rank's stages of ``model`` (folder or hub id) ready to train.

    Args:
        model: Local HF folder or hub id.
        pp: Pipeline ranks (default: WORLD_SIZE / dp).
        dp: Data-parallel replicas (FSDP2 over the dp dimension).
        ep: Expert-parallel degree: MoE routed experts sharded over ep ranks of the dp group.
        vpp: Stages per rank (default 1, or 2 for multi-stage schedules).
        schedule: A name from :data:`hfpipe.pipeline.schedule.SCHEDULES`.
        microbatches: Microbatches per step (default: the number of stages).
        method, layout: How to split the layers (see :func:`hfpipe.plan.split.plan_pipeline`).
        dtype: ``fp32``, ``bf16-mixed`` (fp32 master weights, bf16 compute) or ``bf16``.
        activation_checkpointing: ``none``, ``full`` (every layer) or ``selective`` (every other layer).
        trust_remote_code: Allow configs that need remote code.
        dist: An existing :class:`Dist` (default: join/create the process group).
        lora: A ``peft.LoraConfig``: inject PEFT's LoRA adapters and freeze the base weights;
            ``parameters()`` then yields only the adapters.
        seed: Seeds the LoRA adapters' initialisation (per adapter, whatever the pipeline size).
        loss_chunk_tokens: Tokens per chunk of the last stage's loss (default: sized so that one
            chunk's fp32 logits stay near 256 MiB; 0: full logits). See :mod:`hfpipe.pipeline.head_loss`.
        quantize_base: ``nf4`` or ``fp8``: keep a LoRA run's frozen base quantized on the device
            (:mod:`hfpipe.quant`); every decoder-layer linear dequantizes just in time.
        quantize_block_size: Values per NF4 scale (default 64), or the FP8 tile edge (default: the
            checkpoint's own tiles, else 128).
        model_class: The :class:`PipelineModel` subclass to return (:mod:`hfpipe.api` passes its own).
    """
    check_degrees("load_pipeline", **({} if pp is None else {"pp": pp}), dp=dp, ep=ep)
    _check_arguments(vpp=vpp, microbatches=microbatches, seed=seed, loss_chunk_tokens=loss_chunk_tokens,
                     activation_checkpointing=activation_checkpointing)
    quantize = _quant_spec(quantize_base, quantize_block_size, lora)
    if dtype not in DTYPES:
        raise PipelineError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    dims = ParallelDims(pp=pp or (dist.pp if dist else _default_pp(dp)), dp=dp, ep=ep)
    source = ModelSource.open(model, trust_remote_code=trust_remote_code)
    get_adapter(source.config)  # an unsupported architecture says so before planning fails on it
    checked = check_layout(dims, schedule, vpp=vpp, microbatches=microbatches, model_config=source.config)
    plan = plan_pipeline(source.config, dims.pp, vpp=checked.vpp, style=checked.style, method=method, layout=layout)
    dist = _with_dims(dist, dims) if dist else init_distributed(dims)
    param_dtype, compute_dtype = DTYPES[dtype]
    if quantize is not None:
        quantize = dataclasses.replace(quantize, dtype=str(param_dtype).removeprefix("torch."))
    options = StageOptions(param_dtype, compute_dtype, activation_checkpointing, lora, seed, quantize)
    modules, stats, lora = build_rank_stages(source, plan, dist, options)
    log.info("rank %d loaded %d tensors (%.1f MB) from %d shards", dist.rank, len(stats.keys_read),
             stats.bytes_read / 1e6, len(stats.files_opened))
    first, last = plan.rank_of_stage(0), plan.rank_of_stage(len(plan.stages) - 1)
    tied = bool(getattr(source.config, "tie_word_embeddings", False))
    # one rank holding both ends already shares one parameter between them
    group = dist.tied_group(first, last) if tied and first != last else None
    pipe = Pipeline(modules, len(plan.stages), schedule, checked.microbatches, dist.pp_group, dist.device,
                    loss_chunk_tokens=loss_chunk_tokens)
    return (model_class or PipelineModel)(source, plan, dist, modules, pipe, group, lora, quantize, ep)


def _with_dims(dist: Dist, dims: ParallelDims) -> Dist:
    """A caller's ``dist`` (its world must fit ``dims``) carrying the degrees it was not built with (ep)."""
    if dist.dims.shape != dims.shape:
        raise PipelineError(f"load_pipeline(dist=...): its mesh {dist.dims.shape} (pp, dp, cp, tp) differs from "
                            f"pp={dims.pp}, dp={dims.dp}; build it with init_distributed(ParallelDims(...))")
    return dist if dist.dims == dims else dataclasses.replace(dist, dims=dims, _cache={})


def _quant_spec(kind: str | None, block: int | None, lora):
    """The :class:`~hfpipe.quant.linear.QuantSpec` of ``quantize_base``, checked against ``lora``."""
    if kind is None:
        if block is not None:
            raise PipelineError("--quantize-block-size applies with --quantize-base nf4|fp8 only")
        return None
    if lora is None:
        raise PipelineError("--quantize-base trains LoRA adapters on a frozen base; add --lora-rank R (e.g. 16)")
    from hfpipe.quant.linear import QuantSpec

    return QuantSpec(kind, block)
