"""``build_pipeline``: this rank's stages built as meta modules, then each parallel axis in one fixed order,
then the bytes; returned as a :class:`~hfpipe.pipeline.model.RankPipeline` (:func:`hfpipe.api.load_pipeline`
is the public face).

The order, for every stage (KempnerForge's and torchtitan's: an axis that changes a parameter's
shape or storage comes before one that wraps it). Each step lives beside its axis; this module keeps
only the order:

======  ==============  =========================================================================
 when    step            what it does
======  ==============  =========================================================================
 meta    build           the stage's transformers modules under the full model's names (models/stage.py)
 meta    ``apply_fp8``   the decoder layers' linears compute in float8 (hfpipe.quant.float8: torchao's
                         ``Float8Linear``, the same parameters); before tp, whose plan then splits them
 meta    ``apply_tp``    every matrix split over tp (hfpipe.parallel.tensor, transformers' plan mapped by
                         hfpipe.parallel.tensor_plan), so the loader then reads only a rank's slice; an FP8
                         base's codes and tile scales are split together (hfpipe.quant.tensor), so under tp
                         ``apply_quant`` runs first
 meta    ``apply_ep``    routed experts sharded over ep (hfpipe.parallel.expert: transformers' plan)
 meta    ``apply_quant`` a LoRA base's linears and expert stacks swapped for quantized storage
                         (hfpipe.quant.linear); under ``--fp8-recipe blockwise`` its FP8 linears multiply
                         their codes in float8 (hfpipe.quant.fp8_matmul)
 meta    ``apply_ac``    activation checkpointing of each decoder layer (hfpipe.models.stage)
 load    ``load``        this rank's bytes only, into what the steps above left (pipeline/load.py)
 loaded  ``apply_cp``    attention through the gathered-K/V function (hfpipe.parallel.context); the stage
                         then takes its tokens of each sequence and the whole rows' document ids
 loaded  ``apply_lora``  PEFT's adapters (hfpipe.lora.stages); after loading, since PEFT initialises them
                         from the seed on real tensors
 loaded  ``apply_compile`` ``torch.compile`` each decoder layer in place (hfpipe.models.compile): after every
                         step that changes what a layer holds (LoRA's adapters are traced with it), before
                         FSDP2, whose hooks run outside the compiled graph (torchtitan's order)
 loaded  ``apply_fsdp``  FSDP2 over the fsdp mesh (hfpipe.parallel.fsdp); after loading, since the loader
                         reads whole tensors of a stage and FSDP2 keeps them as dp shards
======  ==============  =========================================================================

A new axis is one more ``apply_<axis>`` beside its axis, called here at its place in the order.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from hfpipe.lora.stages import apply_lora
from hfpipe.models.compile import apply_compile
from hfpipe.models.meta import model_config
from hfpipe.models.registry import adapter_for
from hfpipe.models.stage import apply_ac, build_stage_modules
from hfpipe.models.support import get_adapter
from hfpipe.parallel.context import ContextParallel, apply_cp
from hfpipe.parallel.dims import ParallelDims
from hfpipe.parallel.expert import apply_ep
from hfpipe.parallel.fsdp import apply_fsdp
from hfpipe.parallel.mesh import Dist, init_distributed
from hfpipe.parallel.rules import check_layout
from hfpipe.parallel.tensor import apply_tp
from hfpipe.pipeline.load import LoadStats, load_stage_weights
from hfpipe.pipeline.model import RankPipeline
from hfpipe.pipeline.options import PipelineLayout, StageOptions
from hfpipe.pipeline.schedule import Pipeline, PipelineError
from hfpipe.plan.split import plan_pipeline
from hfpipe.quant.float8 import apply_fp8, warn_if_uncompiled
from hfpipe.quant.linear import apply_quant, check_shardable
from hfpipe.quant.tensor import fp8_tp_plan
from hfpipe.source.folder import ModelSource

__all__ = ["build_pipeline", "build_rank_stages", "load_rank_stages"]

log = logging.getLogger(__name__)


def build_pipeline(model: str, layout: PipelineLayout, stages: StageOptions, *, trust_remote_code: bool = False,
                   dist: Dist | None = None, model_class: type | None = None) -> RankPipeline:
    """Load this rank's stages of ``model`` (folder or hub id) ready to train.

    Args:
        model: Local HF folder or hub id.
        layout: How the model is split over the ranks and scheduled.
        stages: How each rank's stages are built and run.
        trust_remote_code: Allow configs that need remote code.
        dist: An existing :class:`Dist` (default: join/create the process group).
        model_class: The :class:`RankPipeline` subclass to return (:mod:`hfpipe.api` passes its own).
    """
    dims = layout.dims(dist)
    source = ModelSource.open(model, trust_remote_code=trust_remote_code)
    get_adapter(source.config)  # an unsupported architecture says so before planning fails on it
    checked = check_layout(dims, layout.schedule, vpp=layout.vpp, microbatches=layout.microbatches,
                           model_config=source.config, reshard_per_microbatch=stages.reshard_per_microbatch,
                           lora=stages.lora is not None, quantize_base=stages.quantize_base,
                           compile=stages.compile, sequence_parallel=stages.sequence_parallel)
    plan = plan_pipeline(source.config, dims.pp, vpp=checked.vpp, style=checked.style, method=layout.method,
                         layout=layout.layout)
    dist = _with_dims(dist, dims) if dist else init_distributed(dims)
    modules, stats, lora = build_rank_stages(source, plan, dist, stages)
    log.info("rank %d loaded %d tensors (%.1f MB) from %d shards", dist.rank, len(stats.keys_read),
             stats.bytes_read / 1e6, len(stats.files_opened))
    first, last = plan.rank_of_stage(0), plan.rank_of_stage(len(plan.stages) - 1)
    tied = bool(getattr(source.config, "tie_word_embeddings", False))
    # one rank holding both ends already shares one parameter between them
    group = dist.tied_group(first, last) if tied and first != last else None
    pipe = Pipeline(modules, plan.owners, layout.schedule, checked.microbatches, dist.pp_group, dist.device,
                    loss_chunk_tokens=stages.loss_chunk_tokens, reduce_every_microbatch=stages.reshard_per_microbatch,
                    context=modules[0].context if modules else None, vocab_split=dims.tp > 1)
    return (model_class or RankPipeline)(source, plan, dist, modules, pipe, group, lora, stages.quantize, layout.ep,
                                         stats)


def _with_dims(dist: Dist, dims: ParallelDims) -> Dist:
    """A caller's ``dist`` (its world must fit ``dims``) carrying the degrees it was not built with (ep)."""
    if dist.dims.shape != dims.shape:
        raise PipelineError(f"load_pipeline(dist=...): its mesh {dist.dims.shape} (pp, dp, cp, tp) differs from "
                            f"pp={dims.pp}, dp={dims.dp}; build it with init_distributed(ParallelDims(...))")
    return dist if dist.dims == dims else dataclasses.replace(dist, dims=dims, _cache={})


@dataclass(frozen=True)
class _Meta:
    """What the meta steps and the load read: :class:`StageOptions` resolved, or :func:`load_rank_stages`'
    few arguments (which store in any dtype, and may keep the checkpoint's own)."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    load_dtype: torch.dtype | None
    quantize: object = None
    activation_checkpointing: str = "none"
    sequence_parallel: bool = True
    fp8: str | None = None


def build_rank_stages(source, plan, dist, options: StageOptions) -> tuple[list, LoadStats, object]:
    """This rank's stage modules, parallelized in the module docstring's order and loaded.

    Returns ``(modules, stats, lora)``: ``lora`` is the resolved ``peft.LoraConfig`` (or ``None``).
    """
    dims = dist.dims
    tp_mesh = dist.mesh["tp"] if dims.tp > 1 else None
    expert_mesh = dist.expert_mesh() if dims.ep > 1 else None
    meta = _Meta(options.base_dtype, options.compute_dtype, options.base_dtype, options.quantize,
                 options.activation_checkpointing, options.sequence_parallel, options.fp8)
    modules, stats = _loaded_stages(source, plan, dist.pp_rank, dist.device, meta, tp_mesh, expert_mesh)
    if dims.cp > 1:
        apply_cp(modules, ContextParallel(dist.cp_group, dims.cp, dist.cp_rank))
    lora = apply_lora(modules, options.lora, seed=options.seed, dtype=options.param_dtype, tp_mesh=tp_mesh,
                      sequence_parallel=options.sequence_parallel, experts_whole=expert_mesh is not None)
    apply_compile(modules, options.compile_spec, sub_meshes=tp_mesh is not None or expert_mesh is not None)
    warn_if_uncompiled(options.fp8, options.compile_spec is not None, dist.device)
    if dims.dp > 1 and meta.quantize is not None:  # here, not in apply_fsdp: parallel/ sits below quant/
        check_shardable(modules, dims.dp)
    apply_fsdp(modules, dist, param_dtype=options.param_dtype, compute_dtype=options.compute_dtype,
               reshard_per_microbatch=options.reshard_per_microbatch)
    return modules, stats, lora


def load_rank_stages(source, plan, pp_rank: int, device: torch.device, dtype: torch.dtype | None = None,
                     quantize=None, expert_mesh=None) -> tuple[list, LoadStats]:
    """The steps up to loading alone (no process group needed unless ``expert_mesh``): for tests and
    ``bench/load.py``, which measure what a rank reads. ``expert_mesh`` is ``Dist.expert_mesh()``."""
    stored = dtype or torch.float32  # computed in as stored: what the stage module assumes on its own
    return _loaded_stages(source, plan, pp_rank, device, _Meta(stored, stored, dtype, quantize), None, expert_mesh)


def _loaded_stages(source, plan, pp_rank: int, device, meta: _Meta, tp_mesh, expert_mesh):
    """The meta steps of the module docstring's order, then the load: ``(modules, stats)``."""
    config = model_config(source.config)
    modules = build_stage_modules(config, plan.stages_of_rank(pp_rank), meta.param_dtype, adapter=adapter_for(config))
    apply_fp8(modules, meta.fp8, device)
    tiles = meta.fp8 == "blockwise"  # an FP8 base multiplies its own tiles in float8 (apply_fp8 leaves it)
    quantizer = None
    if tp_mesh is not None and meta.quantize is not None:  # FP8 storage first: tp splits it on its tiles
        quantizer = apply_quant(modules, source.config, meta.quantize, meta.param_dtype, tp_mesh.size(),  # (no --ep)
                                float8=tiles, device=device)
    if tp_mesh is not None:  # an FP8 linear splits by its own style (fp8_tp_plan; a no-op without one)
        apply_tp(modules, tp_mesh, sequence_parallel=meta.sequence_parallel, experts_whole=expert_mesh is not None,
                 restyle=fp8_tp_plan)
    if expert_mesh is not None:
        apply_ep(modules, expert_mesh)
    if quantizer is None:
        quantizer = apply_quant(modules, source.config, meta.quantize, meta.param_dtype, float8=tiles, device=device)
    apply_ac(modules, meta.activation_checkpointing, meta.compute_dtype)
    return modules, load_stage_weights(modules, source, device, meta.load_dtype, quantizer)
