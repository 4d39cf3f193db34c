"""Every rule a parallel layout must keep, in one validator: :func:`check_layout`.

The CLI's config, the Python API (``load_pipeline``), ``plan`` and the run's preflight all call it,
so a layout gets the same message, in the same order, wherever it is given: the degrees
(:class:`~hfpipe.parallel.dims.ParallelDims`), the schedule and its stages per rank, the
microbatches, the batch, the schedules FSDP cannot run, what --tp and --cp do not compose with (and
the sequence split cp needs), then what the model allows (--ep over its routed experts, --tp over its
heads and sizes, --cp over its attention). The schedule names and the stages each rank holds under each
(:func:`required_vpp`, :func:`default_vpp`) live here too, the one table the config, the planner and the
pipeline read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hfpipe.errors import ParallelError
from hfpipe.models.moe import routed_experts
from hfpipe.parallel.dims import ParallelDims

__all__ = ["INTERLEAVED_SCHEDULES", "Layout", "SCHEDULES", "SINGLE_STAGE", "SPLIT_BACKWARD", "STYLES",
           "V_SCHEDULES", "check_layout", "count_experts", "default_vpp", "required_vpp", "schedule_style",
           "style_vpp"]

#: Every pipeline schedule, as spelled in ``--schedule``.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
#: One stage per rank.
SINGLE_STAGE = ("gpipe", "1f1b")
#: Several stages per rank in a loop (rank r holds stages r, r+pp, ...).
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")
#: Exactly two stages per rank in a V (rank r holds stages r and 2*pp-1-r).
V_SCHEDULES = ("zbv", "dualpipev")
#: Schedules whose backward splits into input and weight passes (zero bubble).
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
#: How stages sit on ranks: a loop (rank r holds stages r, r+pp, ...) or a V (rank r holds r and 2*pp-1-r).
STYLES = ("loop", "v")


def schedule_style(schedule: str) -> str:
    """``"v"`` for the V-shaped schedules (stages r and 2p-1-r on rank r), else ``"loop"``."""
    return "v" if schedule in V_SCHEDULES else "loop"


def style_vpp(style: str) -> int | None:
    """Stages per rank a pipeline style fixes: two in a V; ``None`` in a loop, which holds any number."""
    return 2 if style == "v" else None


def required_vpp(schedule: str) -> int | None:
    """Stages per rank ``schedule`` must run: 1 (gpipe, 1f1b), 2 (a V), or ``None`` where any number runs."""
    return 1 if schedule in SINGLE_STAGE else style_vpp(schedule_style(schedule))


def default_vpp(schedule: str) -> int:
    """Stages per rank a schedule runs unless told otherwise: its required count, else two."""
    return required_vpp(schedule) or 2


def count_experts(config) -> int | None:
    """Routed experts per MoE layer that ``--ep`` can shard, or ``None`` (a dense model, or a family
    without transformers' expert-parallel plan, which is what the runtime shards by)."""
    if not getattr(config, "base_model_ep_plan", None):
        return None
    return routed_experts(config)[0] or None


@dataclass(frozen=True)
class Layout:
    """A checked layout: the degrees, the schedule, and the counts it resolved."""

    dims: ParallelDims
    schedule: str
    vpp: int
    microbatches: int

    @property
    def stages(self) -> int:
        return self.dims.pp * self.vpp

    @property
    def style(self) -> str:
        return schedule_style(self.schedule)


def check_layout(dims: ParallelDims, schedule: str = "1f1b", *, vpp: int | None = None,
                 microbatches: int | None = None, batch_size: int | None = None, model_config=None,
                 reshard_per_microbatch: bool = False, lora: bool = False, quantize_base: str | None = None,
                 seq_len: int | None = None, compile: bool = False, sequence_parallel: bool = True) -> Layout:
    """Raise :class:`~hfpipe.errors.ParallelError` unless the layout can run; return it resolved.

    ``vpp`` None (or 1 for a schedule that needs several stages per rank) becomes the schedule's
    default; ``microbatches`` None becomes the number of stages. ``model_config`` adds the model's rules,
    ``seq_len`` the split of each sequence over cp ranks. ``lora`` is whether adapters are trained; what
    LoRA needs under ``--tp`` depends on its resolved targets and is checked on them
    (:func:`hfpipe.lora.tensor.check_tp_lora`). ``compile``: the decoder layers run compiled (``--compile``);
    ``sequence_parallel``: tp splits the activations between layers by sequence (``--sequence-parallel``).
    """
    if schedule not in SCHEDULES:
        raise ParallelError(f"--schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    vpp = _fit_vpp(schedule, vpp)
    origin = "" if microbatches else ", the default pp * vpp"
    microbatches = microbatches or dims.pp * vpp
    _check_microbatches(schedule, dims.pp, vpp, microbatches)
    if batch_size is not None and batch_size % microbatches:
        raise ParallelError(f"--batch-size ({batch_size}) must be a multiple of --microbatches "
                            f"({microbatches}{origin})")
    if dims.dp > 1 and schedule in SPLIT_BACKWARD:
        # Measured on torch 2.13 (CPU/gloo): a dense Llama at pp 2 x dp 2 under zbv or dualpipev reports a
        # grad norm of 0.0 and does not train; the weight-gradient pass runs outside FSDP's reduction.
        needs = f" (which --ep {dims.ep} needs)" if dims.ep > 1 else ""
        raise ParallelError(f"--schedule {schedule} with --dp {dims.dp}{needs}: zero-bubble schedules leave FSDP's "
                            "gradients empty when dp > 1 (torch 2.13); use 1f1b, gpipe, interleaved-1f1b or "
                            "looped-bfs with --dp > 1, or --dp 1")
    if compile and schedule in SPLIT_BACKWARD:
        # Measured on torch 2.13 (CPU): the input-gradient pass keeps the graph for the weight pass
        # (retain_graph=True), which a compiled layer's backward refuses ("compiled with non-empty donated
        # buffers"); torch refuses a compiled stage under these schedules too (pytorch#161904, open).
        raise ParallelError(f"--compile with --schedule {schedule}: the zero-bubble schedules split the backward "
                            "into input and weight passes, which torch cannot run on compiled layers "
                            "(pytorch#161904); use 1f1b, gpipe, interleaved-1f1b or looped-bfs, or drop --compile")
    if compile and dims.tp > 1 and not sequence_parallel:
        # Measured on torch 2.13 (CPU, Llama at pp2 x tp2): without SP each block takes a replicated DTensor, and
        # once a second sequence length makes a layer's shapes symbolic, AOTAutograd's trace of its backward
        # recurses without end (RecursionError in proxy_tensor's _compute_proxy, at a recursion limit of 10,000
        # too). With SP (the default) the same layers compile and match transformers.
        raise ParallelError(f"--compile with --tp {dims.tp} --no-sequence-parallel: torch 2.13 cannot trace these "
                            "compiled layers' backward once sequence lengths vary; keep --sequence-parallel (the "
                            "default) or drop --compile")
    if compile and (dims.tp > 1 or dims.ep > 1) and os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE") == "1":
        # hfpipe turns that cache off under tp/ep (hfpipe.models.compile); this variable outranks code in torch
        raise ParallelError("TORCHINDUCTOR_AUTOGRAD_CACHE=1 forces torch's AOTAutograd cache on, which hands one tp "
                            "group's compiled layers to another's ranks (torch 2.13); unset it for --compile with "
                            f"--{'tp' if dims.tp > 1 else 'ep'}")
    _check_tp_with(dims, schedule, quantize_base)
    _check_cp_with(dims, seq_len)
    if reshard_per_microbatch and dims.dp == 1:
        raise ParallelError("--reshard-per-microbatch shards over the data-parallel ranks; with --dp 1 there "
                            "is nothing to shard: raise --dp or leave it out")
    if model_config is not None:
        _check_moe_config(model_config)
        _check_experts(dims.ep, model_config)
        _check_cp_config(model_config, dims.cp)
        if dims.tp > 1:
            from hfpipe.parallel.tensor_plan import check_tp_config  # torch's styles: only when asked

            check_tp_config(model_config, dims.tp)
    return Layout(dims, schedule, vpp, microbatches)


def _fit_vpp(schedule: str, vpp: int | None) -> int:
    if vpp is None or (vpp == 1 and schedule not in SINGLE_STAGE):
        return default_vpp(schedule)
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise ParallelError(f"--vpp must be >= 1, got {vpp!r}")
    need = required_vpp(schedule)
    if need is None or vpp == need:
        return vpp
    if schedule_style(schedule) == "v":
        raise ParallelError(f"--vpp must be {need} for --schedule {schedule} (a V of two stages), got {vpp}")
    raise ParallelError(f"--vpp must be {need} for --schedule {schedule}, got {vpp}; "
                        "use --schedule interleaved-1f1b for several stages per rank")


def _check_microbatches(schedule: str, pp: int, vpp: int, microbatches: int) -> None:
    """torch's own rules (each schedule's constructor checks them), said in flags before anything starts."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ParallelError(f"--microbatches must be >= 1, got {microbatches!r}")
    stages = pp * vpp
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise ParallelError(f"--schedule {schedule} needs at least as many microbatches as stages "
                            f"({stages}); got --microbatches {microbatches}: raise it to {stages}")
    if schedule in ("interleaved-1f1b", "interleaved-zb") and microbatches > pp:
        rounds = microbatches // pp
        if microbatches % rounds:
            raise ParallelError(f"--schedule {schedule} needs --microbatches <= --pp or a multiple of the "
                                f"rounds ({rounds}); got {microbatches}: use {rounds * pp}")


def _check_tp_with(dims: ParallelDims, schedule: str, quantize_base: str | None) -> None:
    """What tensor parallelism does not compose with yet: refused in one line, never run half-right."""
    if dims.tp == 1:
        return
    if schedule in SPLIT_BACKWARD:  # measured: torch 2.13's input-gradient pass fails on the tp-split stage
        raise ParallelError(f"--tp {dims.tp} with --schedule {schedule}: the zero-bubble schedules' split "
                            "backward does not run on tensor-parallel stages yet (torch 2.13); use 1f1b, gpipe, "
                            "interleaved-1f1b or looped-bfs")
    # With --ep the routed experts stay whole on each tp rank, which dispatches its slice of the tokens
    # (hfpipe.parallel.expert); with --cp too, _check_cp_with refuses tp x cp.
    if quantize_base == "nf4":  # an NF4Tensor is neither a DTensor's local part nor sliceable by columns
        raise ParallelError(f"--tp {dims.tp} with --quantize-base nf4: NF4 weights are not split over tp ranks; "
                            "use --quantize-base fp8 (split on its tiles) or --tp 1")
    if quantize_base and dims.ep > 1:
        raise ParallelError(f"--tp {dims.tp} with --ep {dims.ep} and --quantize-base {quantize_base}: a quantized base "
                            "under tensor and expert parallelism together is not checked exact yet; use --ep 1 or --tp 1")


def _check_cp_with(dims: ParallelDims, seq_len: int | None) -> None:
    """What context parallelism does not compose with, and the sequence split it needs."""
    if dims.cp == 1:
        return
    if dims.tp > 1:  # sequence parallelism cuts the residual stream along the very dimension cp splits
        raise ParallelError(f"--cp {dims.cp} with --tp {dims.tp}: tensor parallelism's sequence-parallel regions and "
                            "the cp split both cut the sequence, which is not checked exact yet; use one of them")
    # The zero-bubble schedules run exactly at dp 1 x cp 2 (FSDP2 over cp alone, measured); at dp > 1 the
    # dp rule above refuses them.
    if seq_len is not None and seq_len % (2 * dims.cp):
        fit = seq_len // (2 * dims.cp) * 2 * dims.cp
        raise ParallelError(f"--seq-len {seq_len} does not split into {2 * dims.cp} equal chunks (two per cp rank, "
                            f"head and tail) for --cp {dims.cp}; use a multiple of {2 * dims.cp}, e.g. "
                            f"{fit or 2 * dims.cp}")


#: Families whose attention the gathered-K/V path does not express, and why.
_CP_REFUSED = {"deepseek_v32": "an indexer that picks keys inside attention",
               "deepseek_v4": "compressed attention over hyper-connection streams",
               "gpt_oss": "attention sinks", "llama4": "chunked attention"}


def _check_cp_config(config, cp: int) -> None:
    """A family whose attention is not causal-with-window (or has softcapping, sinks, a router aux loss
    summed per cp rank) is refused: never run as plain causal attention."""
    if cp == 1:
        return
    kind = config.model_type
    why = _CP_REFUSED.get(kind)
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if why is None and kinds:
        why = f"{sorted(kinds)[0]!r} layers"
    if why is None and getattr(config, "attn_logit_softcapping", None):
        why = "attention logit softcapping"
    if why is None and getattr(config, "output_router_logits", False):
        why = "a router aux loss over the whole sequence (each cp rank sees part of it)"
    if why:
        raise ParallelError(f"--cp {cp}: {kind} has {why}, which context parallelism does not run exactly; "
                            "use --cp 1" + (" or set output_router_logits false" if "router" in why else ""))


def _check_moe_config(config) -> None:
    """A MoE config that cannot run at all: said here for plan, finetune and the API alike, before a worker
    meets it as ``selected index k out of range`` or an empty matmul."""
    experts, top_k = routed_experts(config)
    if experts and top_k > experts:
        raise ParallelError(f"config.json: num_experts_per_tok={top_k} is more than the {experts} routed experts "
                            f"of this {config.model_type} model; the config is damaged or mistyped")
    for key in ("moe_intermediate_size", "intermediate_size"):
        size = getattr(config, key, None)
        if experts and isinstance(size, int) and size < 1:
            raise ParallelError(f"config.json: {key}={size} leaves the experts no width; it must be >= 1")


def _check_experts(ep: int, config) -> None:
    if ep == 1:
        return
    experts = count_experts(config)
    if not experts:
        raise ParallelError(f"--ep {ep}: {config.model_type} is a dense model (no routed experts to shard) or "
                            "has no expert-parallel plan in transformers; leave out --ep")
    if experts % ep:
        fits = [d for d in range(2, experts + 1) if experts % d == 0 and d <= 64]
        raise ParallelError(f"--ep {ep} must divide the {experts} routed experts of each MoE layer of this "
                            f"{config.model_type} model; use one of {', '.join(map(str, fits[:8]))}")
