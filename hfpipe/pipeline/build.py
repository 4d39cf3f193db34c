"""Build this rank's stages: meta modules, then each parallel axis in one fixed order, then the bytes.

The order, for every stage (KempnerForge's and torchtitan's: an axis that changes a parameter's
shape or storage comes before one that wraps it):

======  ==============  =========================================================================
 when    step            what it does
======  ==============  =========================================================================
 meta    build           the stage's transformers modules under the full model's names (models/stage.py)
 meta    ``apply_ep``    routed experts sharded over ep (transformers' expert-parallel plan)
 meta    ``apply_quant`` a LoRA base's linears and expert stacks swapped for quantized storage
 meta    ``apply_ac``    activation checkpointing of each decoder layer
 load    ``load``        this rank's bytes only, into what the steps above left (pipeline/load.py)
 loaded  ``apply_lora``  PEFT's adapters; after loading, since PEFT initialises them from the seed
                         on real tensors
 loaded  ``apply_fsdp``  FSDP2 over the fsdp mesh; after loading, since the loader reads whole
                         tensors of a stage and FSDP2 keeps them as dp shards
======  ==============  =========================================================================

A new axis is one more ``apply_<axis>`` here, at its place in the order (tensor parallelism goes
first, before ep: it changes every matrix's shape, and the loader then reads only its slice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfpipe.models.meta import model_config
from hfpipe.models.registry import adapter_for
from hfpipe.models.stage import build_stage_modules
from hfpipe.parallel.expert import experts_of, shard_experts, shard_moe_layer
from hfpipe.pipeline.load import LoadStats, load_stage_weights
from hfpipe.quant.linear import Quantizer

__all__ = ["StageOptions", "build_rank_stages", "load_rank_stages"]


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
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: str = "none"
    lora: object = None
    seed: int = 0
    quantize: object = None


def build_rank_stages(source, plan, dist, options: StageOptions) -> tuple[list, LoadStats, object]:
    """This rank's stage modules, parallelized in the module docstring's order and loaded.

    Returns ``(modules, stats, lora)``: ``lora`` is the resolved ``peft.LoraConfig`` (or ``None``).
    """
    modules = _meta_stages(source, plan, dist.pp_rank, options.param_dtype)
    if dist.dims.ep > 1:
        apply_ep(modules, dist.expert_mesh())
    quantizer = apply_quant(modules, source.config, options)
    apply_ac(modules, options)
    stats = load_stage_weights(modules, source, dist.device, options.param_dtype, quantizer)
    lora = apply_lora(modules, options)
    apply_fsdp(modules, dist, options)
    return modules, stats, lora


def load_rank_stages(source, plan, pp_rank: int, device: torch.device, dtype: torch.dtype | None = None,
                     quantize=None, expert_mesh=None) -> tuple[list, LoadStats]:
    """The steps up to loading alone (no process group needed unless ``expert_mesh``): for tests and
    ``bench/load.py``, which measure what a rank reads. ``expert_mesh`` is ``Dist.expert_mesh()``."""
    options = StageOptions(param_dtype=dtype or torch.float32, quantize=quantize)
    modules = _meta_stages(source, plan, pp_rank, options.param_dtype)
    if expert_mesh is not None:
        apply_ep(modules, expert_mesh)
    quantizer = apply_quant(modules, source.config, options)
    return modules, load_stage_weights(modules, source, device, dtype, quantizer)


def _meta_stages(source, plan, pp_rank: int, dtype: torch.dtype) -> list:
    config = model_config(source.config)
    return build_stage_modules(config, plan.stages_of_rank(pp_rank), dtype, adapter=adapter_for(config))


def apply_ep(modules: list, expert_mesh) -> None:
    """Routed experts sharded over the ep dimension of ``expert_mesh`` (hfpipe.parallel.expert)."""
    shard_experts(modules, expert_mesh)


def apply_quant(modules: list, config, options: StageOptions):
    """A quantized base's storage on the meta stage; the returned quantizer fills it while loading."""
    if options.quantize is None:
        return None
    quantizer = Quantizer(options.quantize, config)
    quantizer.prepare(modules, options.param_dtype)
    return quantizer


def apply_ac(modules: list, options: StageOptions) -> None:
    """Activation checkpointing (the stage forward checkpoints its layers) in the compute dtype."""
    for m in modules:
        m.activation_checkpointing = options.activation_checkpointing
        m.hidden_dtype = options.compute_dtype


def apply_lora(modules: list, options: StageOptions):
    """PEFT's LoRA adapters on the loaded stage (base frozen); returns the resolved ``LoraConfig``."""
    if options.lora is None:
        return None
    from hfpipe.lora.adapters import add_adapters, resolve_config
    from hfpipe.lora.experts import attach_expert_adapters, stacks_as_parameters

    lora = resolve_config(options.lora, modules[0]._hf_model)
    with stacks_as_parameters(modules, options.param_dtype):  # quantized expert stacks: PEFT adapts parameters
        add_adapters(modules, lora, seed=options.seed)
    attach_expert_adapters(modules)  # quantized or ep-split experts: hfpipe's experts forward adapts them
    return lora


def apply_fsdp(modules: list, dist, options: StageOptions) -> None:
    """FSDP2 over the fsdp mesh: each decoder layer, then the stage (and bf16-mixed's casts).

    With sharded experts, a MoE layer's experts, attention and MoE block are units of their own first
    (:func:`hfpipe.parallel.expert.shard_moe_layer`). FSDP2 also carries bf16-mixed: fp32 sharded masters
    (and so fp32 optimizer state), bf16 compute, fp32 gradient reduction. No reshard after forward: under
    pipelining a stage runs forward for several microbatches before their backward.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dims = dist.dims
    if dims.grad_divide_factor == 1 and options.compute_dtype == options.param_dtype:
        return
    if dims.dp > 1 and options.quantize is not None:
        from hfpipe.quant.linear import check_shardable

        check_shardable(modules, dims.dp)
    mesh = dist.fsdp_mesh
    mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32)
    # A stage's float inputs are hidden states, already in the compute dtype, and the fp32 router
    # sums of MoE aux losses (hfpipe.models.router_loss), which must stay fp32: bf16 counts
    # tokens exactly only up to 256.
    stage_mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    for m in modules:
        for layer in m.model.layers.values():
            if dims.ep > 1 and experts_of(layer):
                shard_moe_layer(layer, mesh, dist.expert_mesh(), mp, dims.grad_divide_factor)
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(m, mesh=mesh, mp_policy=stage_mp, reshard_after_forward=False)
