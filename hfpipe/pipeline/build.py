"""``load_pipeline``: this rank's stages built as meta modules, then each parallel axis in one fixed order,
then the bytes; returned as a :class:`~hfpipe.pipeline.model.PipelineModel`.

The order, for every stage (KempnerForge's and torchtitan's: an axis that changes a parameter's
shape or storage comes before one that wraps it):

======  ==============  =========================================================================
 when    step            what it does
======  ==============  =========================================================================
 meta    build           the stage's transformers modules under the full model's names (models/stage.py)
 meta    ``apply_tp``    every matrix split over tp (transformers' plan, hfpipe.parallel.tensor_plan), so
                         the loader then reads only a rank's slice; an FP8 base's codes and tile scales are
                         split together (hfpipe.quant.tensor), so under tp ``apply_quant`` runs first
 meta    ``apply_ep``    routed experts sharded over ep (transformers' expert-parallel plan)
 meta    ``apply_quant`` a LoRA base's linears and expert stacks swapped for quantized storage
 meta    ``apply_ac``    activation checkpointing of each decoder layer
 load    ``load``        this rank's bytes only, into what the steps above left (pipeline/load.py)
 loaded  ``apply_cp``    attention through the gathered-K/V function (hfpipe.parallel.context); the stage
                         then takes its tokens of each sequence and the whole rows' document ids
 loaded  ``apply_lora``  PEFT's adapters; after loading, since PEFT initialises them from the seed
                         on real tensors
 loaded  ``apply_fsdp``  FSDP2 over the fsdp mesh; after loading, since the loader reads whole
                         tensors of a stage and FSDP2 keeps them as dp shards
======  ==============  =========================================================================

A new axis is one more ``apply_<axis>`` here, at its place in the order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from hfpipe.models.meta import model_config
from hfpipe.models.registry import adapter_for
from hfpipe.models.stage import build_stage_modules
from hfpipe.models.support import get_adapter
from hfpipe.parallel.context import ContextParallel, register_attention
from hfpipe.parallel.dims import ParallelDims, check_degrees
from hfpipe.parallel.expert import experts_of, shard_experts, shard_moe_layer
from hfpipe.parallel.mesh import Dist, init_distributed
from hfpipe.parallel.rules import check_layout
from hfpipe.pipeline.load import LoadStats, load_stage_weights
from hfpipe.pipeline.model import PRECISIONS, RankPipeline
from hfpipe.pipeline.schedule import Pipeline, PipelineError
from hfpipe.plan.split import plan_pipeline
from hfpipe.quant.linear import Quantizer
from hfpipe.source.folder import ModelSource

__all__ = ["StageOptions", "build_pipeline", "build_rank_stages", "load_rank_stages"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOptions:
    """How this rank's stages are built.

    Attributes:
        param_dtype: The dtype parameters are stored in.
        compute_dtype: The dtype the forward runs in (FSDP2 casts to it under bf16-mixed).
        activation_checkpointing: ``none``, ``full`` or ``selective``.
        lora: A ``peft.LoraConfig`` (adapters trained, base frozen), or ``None``.
        seed: Seeds each LoRA adapter's initialisation.
        quantize: A :class:`hfpipe.quant.linear.QuantSpec` (a quantized frozen base), or ``None``.
        sequence_parallel: Under ``--tp``, also split the norms and the activations between layers by sequence.
        reshard_per_microbatch: FSDP2 reshards weights after every microbatch's forward and backward and
            reduce-scatters gradients every microbatch (:mod:`hfpipe.pipeline.stage_sync`).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: str = "none"
    lora: object = None
    seed: int = 0
    quantize: object = None
    sequence_parallel: bool = True
    reshard_per_microbatch: bool = False


def _default_pp(others: int) -> int:
    """The pipeline size the started world leaves once the other degrees (their product) are taken."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // others)


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


def build_pipeline(model: str, *, pp: int | None = None, dp: int = 1, ep: int = 1, tp: int = 1, cp: int = 1,
                  sequence_parallel: bool = True, reshard_per_microbatch: bool = False, vpp: int | None = None,
                  schedule: str = "1f1b", microbatches: int | None = None, method: str = "balanced",
                  layout: str | None = None, dtype: str = "fp32", activation_checkpointing: str = "none",
                  trust_remote_code: bool = False, dist: Dist | None = None, lora=None,
                  seed: int = 0, loss_chunk_tokens: int | None = None,
                  quantize_base: str | None = None, quantize_block_size: int | None = None,
                  model_class: type | None = None) -> RankPipeline:
    """Load this rank's stages of ``model`` (folder or hub id) ready to train.

    Args:
        model: Local HF folder or hub id.
        pp: Pipeline ranks (default: WORLD_SIZE / (dp * tp)).
        dp: Data-parallel replicas (FSDP2 over the dp dimension).
        ep: Expert-parallel degree: MoE routed experts sharded over ep ranks of the dp group.
        tp: Tensor-parallel degree: each stage's matrices, embedding and head split over tp ranks
            (:mod:`hfpipe.parallel.tensor`); the world is pp * dp * tp processes.
        cp: Context-parallel degree: each microbatch's sequence split over cp ranks (head-tail balanced),
            attention over K and V gathered from them (:mod:`hfpipe.parallel.context`); every cp rank of a
            replica is handed the same whole rows. The world is pp * dp * cp * tp processes.
        sequence_parallel: With tp > 1, also split the norms and the activations between layers by
            sequence (default on).
        reshard_per_microbatch: With dp > 1, FSDP2 shards weights and gradients under the pipeline too:
            reshard after every microbatch's forward and backward, reduce-scatter every microbatch.
        vpp: Stages per rank (default 1, or 2 for multi-stage schedules).
        schedule: A name from :data:`hfpipe.parallel.rules.SCHEDULES`.
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
        model_class: The :class:`RankPipeline` subclass to return (:mod:`hfpipe.api` passes its own).
    """
    check_degrees("load_pipeline", **({} if pp is None else {"pp": pp}), dp=dp, ep=ep, tp=tp, cp=cp)
    _check_arguments(vpp=vpp, microbatches=microbatches, seed=seed, loss_chunk_tokens=loss_chunk_tokens,
                     activation_checkpointing=activation_checkpointing)
    quantize = _quant_spec(quantize_base, quantize_block_size, lora)
    if dtype not in PRECISIONS:
        raise PipelineError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(PRECISIONS)}")
    dims = ParallelDims(pp=pp or (dist.pp if dist else _default_pp(dp * cp * tp)), dp=dp, cp=cp, tp=tp, ep=ep)
    source = ModelSource.open(model, trust_remote_code=trust_remote_code)
    get_adapter(source.config)  # an unsupported architecture says so before planning fails on it
    checked = check_layout(dims, schedule, vpp=vpp, microbatches=microbatches, model_config=source.config,
                           reshard_per_microbatch=reshard_per_microbatch, lora=lora is not None,
                           quantize_base=quantize_base)
    plan = plan_pipeline(source.config, dims.pp, vpp=checked.vpp, style=checked.style, method=method, layout=layout)
    dist = _with_dims(dist, dims) if dist else init_distributed(dims)
    param_dtype, compute_dtype = PRECISIONS[dtype]
    if quantize is not None:
        quantize = dataclasses.replace(quantize, dtype=str(param_dtype).removeprefix("torch."))
    options = StageOptions(param_dtype, compute_dtype, activation_checkpointing, lora, seed, quantize,
                           bool(sequence_parallel), bool(reshard_per_microbatch))
    modules, stats, lora = build_rank_stages(source, plan, dist, options)
    log.info("rank %d loaded %d tensors (%.1f MB) from %d shards", dist.rank, len(stats.keys_read),
             stats.bytes_read / 1e6, len(stats.files_opened))
    first, last = plan.rank_of_stage(0), plan.rank_of_stage(len(plan.stages) - 1)
    tied = bool(getattr(source.config, "tie_word_embeddings", False))
    # one rank holding both ends already shares one parameter between them
    group = dist.tied_group(first, last) if tied and first != last else None
    pipe = Pipeline(modules, plan.owners, schedule, checked.microbatches, dist.pp_group, dist.device,
                    loss_chunk_tokens=loss_chunk_tokens, reduce_every_microbatch=options.reshard_per_microbatch,
                    context=modules[0].context if modules else None)
    return (model_class or RankPipeline)(source, plan, dist, modules, pipe, group, lora, quantize, ep, stats)


def _with_dims(dist: Dist, dims: ParallelDims) -> Dist:
    """A caller's ``dist`` (its world must fit ``dims``) carrying the degrees it was not built with (ep)."""
    if dist.dims.shape != dims.shape:
        raise PipelineError(f"load_pipeline(dist=...): its mesh {dist.dims.shape} (pp, dp, cp, tp) differs from "
                            f"pp={dims.pp}, dp={dims.dp}; build it with init_distributed(ParallelDims(...))")
    return dist if dist.dims == dims else dataclasses.replace(dist, dims=dims, _cache={})


def _quant_spec(kind: str | None, block: int | None, lora):
    """The :class:`~hfpipe.quant.linear.QuantSpec` of ``quantize_base``, checked against ``lora``."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise PipelineError(f"load_pipeline(quantize_block_size={block!r}): quantize_block_size must be an "
                            "integer >= 1 (or None for the default)")
    if kind is None:
        if block is not None:
            raise PipelineError("--quantize-block-size applies with --quantize-base nf4|fp8 only")
        return None
    if lora is None:
        raise PipelineError("--quantize-base trains LoRA adapters on a frozen base; add --lora-rank R (e.g. 16)")
    from hfpipe.quant.linear import QuantSpec

    return QuantSpec(kind, block)


def build_rank_stages(source, plan, dist, options: StageOptions) -> tuple[list, LoadStats, object]:
    """This rank's stage modules, parallelized in the module docstring's order and loaded.

    Returns ``(modules, stats, lora)``: ``lora`` is the resolved ``peft.LoraConfig`` (or ``None``).
    """
    modules, stats = _loaded_stages(source, plan, dist.pp_rank, dist.device, options, options.param_dtype,
                                    dist.mesh["tp"] if dist.dims.tp > 1 else None,
                                    dist.expert_mesh() if dist.dims.ep > 1 else None)
    if dist.dims.cp > 1:
        apply_cp(modules, ContextParallel(dist.cp_group, dist.dims.cp, dist.cp_rank))
    lora = apply_lora(modules, options, dist.mesh["tp"] if dist.dims.tp > 1 else None, dist.dims.ep > 1)
    apply_fsdp(modules, dist, options)
    return modules, stats, lora


def load_rank_stages(source, plan, pp_rank: int, device: torch.device, dtype: torch.dtype | None = None,
                     quantize=None, expert_mesh=None) -> tuple[list, LoadStats]:
    """The steps up to loading alone (no process group needed unless ``expert_mesh``): for tests and
    ``bench/load.py``, which measure what a rank reads. ``expert_mesh`` is ``Dist.expert_mesh()``."""
    stored = dtype or torch.float32  # computed in as stored: what the stage module assumes on its own
    options = StageOptions(param_dtype=stored, compute_dtype=stored, quantize=quantize)
    return _loaded_stages(source, plan, pp_rank, device, options, dtype, None, expert_mesh)


def _loaded_stages(source, plan, pp_rank: int, device, options: StageOptions, load_dtype, tp_mesh, expert_mesh):
    """The meta steps of the module docstring's order, then the load: ``(modules, stats)``."""
    config = model_config(source.config)
    modules = build_stage_modules(config, plan.stages_of_rank(pp_rank), options.param_dtype,
                                  adapter=adapter_for(config))
    quantizer = None
    if tp_mesh is not None and options.quantize is not None:  # FP8 storage first: tp splits it on its tiles
        quantizer = apply_quant(modules, source.config, options, tp_mesh.size())  # (no --ep: rules refuse it)
    if tp_mesh is not None:
        apply_tp(modules, tp_mesh, options, experts_whole=expert_mesh is not None)
    if expert_mesh is not None:
        apply_ep(modules, expert_mesh)
    if quantizer is None:
        quantizer = apply_quant(modules, source.config, options)
    apply_ac(modules, options)
    return modules, load_stage_weights(modules, source, device, load_dtype, quantizer)


def apply_tp(modules: list, tp_mesh, options: StageOptions, experts_whole: bool = False) -> None:
    """Every matrix of the meta stage split over ``tp_mesh`` (a stage still takes and returns whole tensors);
    but the routed experts when ``experts_whole`` (``--ep`` shards them next, whole on each tp rank)."""
    from hfpipe.parallel.tensor import apply_tp as split
    from hfpipe.parallel.tensor_plan import stage_tp_plan
    from hfpipe.quant.tensor import fp8_tp_plan

    for m in modules:
        names = [n for n, _ in m.named_modules()]
        plan = stage_tp_plan(m.config, names, options.sequence_parallel, tp_mesh.size(), experts_whole)
        split(m, tp_mesh, fp8_tp_plan(m, plan))  # an FP8 linear's own split (a no-op without one)


def apply_cp(modules: list, context: ContextParallel) -> None:
    """Every stage's attention through the gathered-K/V function, registered with transformers'
    ``AttentionInterface`` (the model classes stay as they are); the stages share one ``context``."""
    name = register_attention()
    for m in modules:
        m.config._attn_implementation = name  # the layers' config: read at every attention call
        m.context = context


def apply_ep(modules: list, expert_mesh) -> None:
    """Routed experts sharded over the ep dimension of ``expert_mesh`` (hfpipe.parallel.expert)."""
    shard_experts(modules, expert_mesh)


def apply_quant(modules: list, config, options: StageOptions, tp: int = 1):
    """A quantized base's storage on the meta stage; the returned quantizer fills it while loading
    (under ``tp``, this rank's tiles of each FP8 linear)."""
    if options.quantize is None:
        return None
    quantizer = Quantizer(options.quantize, config, tp=tp)
    quantizer.prepare(modules, options.param_dtype)
    return quantizer


def apply_ac(modules: list, options: StageOptions) -> None:
    """Activation checkpointing (the stage forward checkpoints its layers) in the compute dtype."""
    for m in modules:
        m.activation_checkpointing = options.activation_checkpointing
        m.hidden_dtype = options.compute_dtype


def apply_lora(modules: list, options: StageOptions, tp_mesh=None, experts_whole: bool = False):
    """PEFT's LoRA adapters on the loaded stage (base frozen); returns the resolved ``LoraConfig``.

    Under ``--tp`` each adapter is then split as its base layer is (:mod:`hfpipe.lora.tensor`).
    """
    if options.lora is None:
        return None
    from hfpipe.lora.adapters import add_adapters, resolve_config
    from hfpipe.lora.experts import attach_expert_adapters, stacks_as_parameters

    lora = resolve_config(options.lora, modules[0]._hf_model)
    plans = _tp_plans(modules, options, tp_mesh, lora, experts_whole)  # keyed by the names PEFT is about to wrap
    with stacks_as_parameters(modules, options.param_dtype):  # quantized expert stacks: PEFT adapts parameters
        add_adapters(modules, lora, seed=options.seed)
    attach_expert_adapters(modules)  # quantized or ep-split experts: hfpipe's experts forward adapts them
    if tp_mesh is not None:
        from hfpipe.lora.tensor import split_adapters

        split_adapters(modules, plans, tp_mesh)
    return lora


def _tp_plans(modules: list, options: StageOptions, tp_mesh, lora, experts_whole: bool) -> list | None:
    if tp_mesh is None:
        return None
    from hfpipe.lora.tensor import check_tp_lora
    from hfpipe.parallel.tensor_plan import stage_tp_plan

    check_tp_lora(lora, tp_mesh.size())
    return [stage_tp_plan(m.config, [n for n, _ in m.named_modules()], options.sequence_parallel, tp_mesh.size(),
                          experts_whole) for m in modules]


def apply_fsdp(modules: list, dist, options: StageOptions) -> None:
    """FSDP2 over the fsdp mesh: each decoder layer, then the stage (and bf16-mixed's casts).

    With sharded experts, a MoE layer's experts, attention and MoE block are units of their own first
    (:func:`hfpipe.parallel.expert.shard_moe_layer`). FSDP2 also carries bf16-mixed: fp32 sharded masters
    (and so fp32 optimizer state), bf16 compute, fp32 gradient reduction. No reshard after forward: under
    pipelining a stage runs forward for several microbatches before their backward; unless
    ``reshard_per_microbatch``, which trades an all-gather per microbatch for weights divided by dp.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dims = dist.dims
    if dims.grad_divide_factor == 1 and options.compute_dtype == options.param_dtype:
        return
    if dims.dp > 1 and options.quantize is not None:
        from hfpipe.quant.linear import check_shardable

        check_shardable(modules, dims.dp)
    mesh, again = dist.fsdp_mesh, options.reshard_per_microbatch
    mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32)
    # A stage's float inputs are hidden states, already in the compute dtype, and the fp32 router
    # sums of MoE aux losses (hfpipe.models.router_loss), which must stay fp32: bf16 counts
    # tokens exactly only up to 256.
    stage_mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    for m in modules:
        for layer in m.model.layers.values():
            if dims.ep > 1 and experts_of(layer):
                shard_moe_layer(layer, mesh, dist.expert_replica_mesh(), mp, dims.grad_divide_factor)
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=again)
        fully_shard(m, mesh=mesh, mp_policy=stage_mp, reshard_after_forward=again)
