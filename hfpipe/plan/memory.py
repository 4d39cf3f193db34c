"""Bytes per parameter on one rank: weights, gradients and AdamW state, alone or under FSDP2.

The one place these formulas live, below the full-run report (:mod:`hfpipe.plan.report`), the
LoRA pricing (:mod:`hfpipe.plan.lora`), expert parallelism's (:mod:`hfpipe.plan.experts`) and a
quantized base's (:mod:`hfpipe.plan.quant`), which all price parameters with them. (The last stage's
loss chunk, which the report prices too, is the loss room's: :func:`hfpipe.loss.budget.chunk_tokens`.)
"""

__all__ = ["ACT_BYTES", "BYTES_PER_PARAM", "frozen_dtype", "fsdp_bytes", "fsdp_units", "param_bytes",
           "reduce_scatter_bytes"]

#: dtype -> (weights, gradients, optimizer) bytes per parameter; see the module docstring.
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16-mixed": (6, 4, 8), "bf16": (2, 2, 4), "fp64": (8, 8, 16)}
#: dtype -> bytes per activation element (what runs the matmuls).
ACT_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2, "fp64": 8}

#: dtype -> (master weights, compute copy, whole gradients, optimizer) bytes per parameter under FSDP2. The whole
#: gradients are in the reduce dtype, fp32 under bf16 too (hfpipe.parallel.fsdp): with gradient sync off until the
#: step's last backward, FSDP2 upcasts each unit's gradients as its backward ends and accumulates them so (a cp2
#: bf16 run held fp32 ones; priced at 2 bytes, full fine-tuning under full checkpointing was 0.94x of its peak)
_FSDP_BYTES = {"fp32": (4, 4, 4, 8), "bf16-mixed": (4, 2, 4, 8), "bf16": (2, 2, 4, 4), "fp64": (8, 8, 8, 16)}


def fsdp_bytes(dtype: str) -> tuple[int, int, int, int]:
    """(master, compute copy, unsharded gradient, AdamW) bytes per parameter under FSDP2 at ``dtype``."""
    return _FSDP_BYTES[dtype]


def frozen_dtype(dtype: str, quantized: bool = False) -> str:
    """The precision a LoRA run's frozen base is held (and priced) in: bf16-mixed holds an unquantized base in bf16
    (nothing trains it, so no fp32 master); :attr:`hfpipe.pipeline.options.StageOptions.base_dtype` builds by it."""
    return "bf16" if dtype == "bf16-mixed" and not quantized else dtype


def param_bytes(dtype: str, dp: int = 1, reshard: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter on one rank at data-parallel ``dp``.

    ``dp == 1`` is :data:`BYTES_PER_PARAM`; above it, FSDP2's shards plus the whole compute-dtype
    parameters and reduce-dtype gradients a pipeline step keeps (see the module docstring). The sharded
    gradients are not added to the whole ones: torch's pipeline stage reduce-scatters them after the step's
    last backward one FSDP2 unit at a time, freeing each unit's whole gradients as it makes its shard (a cp2
    run never held whole + shard: at its optimizer step it held the shards alone, in backward the whole).
    ``reshard`` (``--reshard-per-microbatch``): those two are sharded too; the one unit FSDP2 holds
    gathered at a time is priced apart (:func:`hfpipe.plan.tensor.gathered_unit`).
    """
    if dp == 1:
        return BYTES_PER_PARAM[dtype]
    master, compute, grad, optim = _FSDP_BYTES[dtype]
    if reshard:
        return master / dp + compute / dp, grad / dp, optim / dp
    return master / dp + compute, grad, optim / dp


def reduce_scatter_bytes(grad_bytes: float, units: list[int]) -> int:
    """What FSDP2's reduce-scatter after the step's last backward holds beside a rank's ``grad_bytes`` of whole
    gradients: the largest of its ``units`` (parameters per FSDP2 unit) copied into one reduce-scatter input in the
    reduce dtype, while that unit's whole gradients are freed only once copied (torch's ``foreach_reduce``). The
    stage's own unit (embedding, norm and head) goes first, while every layer's gradients are still whole (measured
    on a cp2 run's real peak). On CPU, gloo's reduce-scatter allocates one more buffer of its input's size; NCCL's
    does not, and it is not priced."""
    return int(grad_bytes * max(units) / sum(units)) if units and sum(units) else 0


def fsdp_units(stages, costs, ep: int = 1) -> list[int]:
    """Parameters of each FSDP2 unit of ``stages`` (:mod:`hfpipe.parallel.fsdp`): each decoder layer, with its routed
    experts a unit of their own under ep (``1 / ep`` of them), and each stage's own (embedding, head)."""
    routed = costs.layer_routed_params or (0,) * len(costs.layer_params)
    units = [costs.embed_params * s.embed + costs.head_params * s.head for s in stages]
    for i in (i for s in stages for i in s.layers):
        units += [costs.layer_params[i] - routed[i], routed[i] // ep] if ep > 1 else [costs.layer_params[i]]
    return units
