"""What a pipeline plan costs each rank: parameters, memory and idle time, from config.json alone.

``hfpipe plan`` prints this before any GPU is rented. The model is built on the meta device (no
weights), split by :func:`hfpipe.plan.split.plan_pipeline`, and each stage is priced as follows.

Weights, gradients and AdamW state, bytes per parameter by ``dtype``:

============  =======  =====  =========  ===================================================
dtype         weights  grads  optimizer  why
============  =======  =====  =========  ===================================================
fp32          4        4      8          fp32 everything; AdamW keeps exp_avg and exp_avg_sq
bf16-mixed    4 + 2    4      8          fp32 masters, plus the bf16 copy autocast casts for
                                         the matmuls (counted once); fp32 grads and AdamW
bf16          2        2      4          everything bf16; AdamW state in the parameter dtype
============  =======  =====  =========  ===================================================

With ``dp > 1`` the stage modules are FSDP2-sharded over dp (as :mod:`hfpipe.pipeline.model` does, each decoder layer
and then the stage, no reshard after forward): fp32 masters, the sharded gradients kept for the optimizer and AdamW
state are split ``dp`` ways, but during a schedule step torch's pipeline stage keeps the stage's parameters gathered
in the compute dtype and accumulates their gradients unsharded in the reduce dtype (fp32, under ``bf16`` too) until
the step's last backward (``set_requires_gradient_sync(False)`` for every microbatch before it), then reduce-scatters
them one unit at a time, each unit's whole gradients freed as its shard is made. So per parameter: weights
``master / dp + compute``, grads ``reduce``, optimizer ``adamw / dp`` (see :func:`param_bytes`): more dp shrinks a
rank down to the 6 bytes (bf16-mixed) it cannot shard. The first unit reduced, the stage's own, is copied into one
reduce-scatter input beside every whole gradient, once the activations are gone (``reduce_bytes``).

Activations, bytes per token per decoder layer: measured on transformers' own layer, one of each
kind (dense, MoE, ...), by :mod:`hfpipe.plan.activations` (Korthikanti et al.'s ``34 * h`` for a
GPT block under-prices these families 1.4x-8x; it remains the fallback). SDPA's fused kernels
keep no T x T scores, so the bytes grow linearly with tokens. With ``full`` activation
checkpointing a layer keeps only its input (the hidden states crossing a stage boundary: ``h``,
or ``hc * h`` for DeepSeek-V4's streams), plus the largest layer recomputed for one microbatch at
a time; ``selective`` checkpoints every other layer of a stage (the first, third, ...), as
:class:`hfpipe.models.stage.PipelineStageModule` does. The stage with the head also keeps, per token, the
logits in the compute dtype and cross-entropy's fp32 log-probabilities: ``vocab * (2 + 4)`` bytes
(``4 + 4`` in fp32), unless the microbatch is larger than one chunk of :mod:`hfpipe.loss.chunked`: then it keeps the gradient of its hidden states
(``h`` per token) and of the head (``vocab * h`` per microbatch). On top, once per rank, the largest
working set that lives only inside one layer's backward or one loss chunk (:mod:`hfpipe.plan.transient`).
MTP layers cost nothing: the loader skips them; a layout places them only by name.

Microbatches in flight come from torch's own schedule (the action list each rank runs, as
``torch.distributed.pipelining`` builds it): a forward adds a microbatch to its stage, a full
backward frees it, and a split backward (zero-bubble) frees it only at the weight-gradient step,
since the weight gradient needs the layer inputs. This gives 1F1B ``min(p - rank, m)`` in flight,
GPipe all ``m``; a rank's activation peak is the largest sum over its stages at any point of its
action list. Bubble fractions are :func:`hfpipe.plan.split.bubble_fraction`'s analytic ones.

``tp > 1`` splits every matrix, the embedding, the head and the activations (all of them with
sequence parallelism, 24/34 of them without) over tp ranks and counts the tensor-parallel
collectives; ``reshard_per_microbatch`` shards the step's gathered weights and whole gradients over
dp too and counts FSDP2's traffic (both: :mod:`hfpipe.plan.tensor`).
``cp > 1`` counts every activation on ``seq_len / cp`` tokens, adds the gathered K/V attention
keeps, shards weights, gradients and AdamW state over dp x cp and counts the K/V gathers
(:mod:`hfpipe.plan.context`).
``ep > 1`` re-prices each rank's routed experts (:mod:`hfpipe.plan.experts`: ``1/ep`` of them,
FSDP2 over ``dp/ep``; with tp, whole on each tp rank and FSDP2 over ``dp/ep x tp``) and counts the
all-to-all bytes; a LoRA run's ``quantize_base`` re-prices its frozen base (:mod:`hfpipe.plan.quant`) and adds the
transient dequantized weight (or, ``fp8="blockwise"``, a float8 tile product's working set).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hfpipe.loss.budget import chunk_tokens
from hfpipe.plan.actions import in_flight, schedule_actions
from hfpipe.plan.activations import expert_adapter_bytes, head_bytes_per_token, layer_layouts
from hfpipe.plan.experts import all_to_all_bytes, describe_ep, price_ranks as price_ep
from hfpipe.plan.memory import ACT_BYTES as _ACT_BYTES, BYTES_PER_PARAM, fsdp_units, param_bytes, reduce_scatter_bytes
from hfpipe.plan.preference import describe_reference, reference_pass, sequences_per_pair
from hfpipe.plan.model_config import load_model_config
from hfpipe.plan.peak import rank_peak
from hfpipe.plan.quant import check_quant, describe_quant, price_ranks as price_base
from hfpipe.plan import context, tensor
from hfpipe.plan.text import format_report, size as _size
from hfpipe.plan.transient import rank_transient

__all__ = ["BYTES_PER_PARAM", "PlanReport", "param_bytes", "RankReport", "StageReport", "format_report",
           "load_model_config", "plan_report"]

_AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class StageReport:
    """One stage: what it holds and what it costs (bytes are for this stage alone)."""

    index: int
    rank: int
    holds: str  # e.g. "embed, layers 0-7" or "layers 24-31, norm, head"
    params: int
    cost_share: float  # this stage's compute over the mean stage's
    in_flight: int  # most microbatches whose activations this stage keeps at once
    activation_bytes_per_microbatch: int
    activation_bytes: int  # in_flight x per microbatch (+ the recompute buffer with full AC)


@dataclass(frozen=True)
class RankReport:
    """One pipeline rank: the sum of its stages (a tied embedding/head it holds twice counts once)."""

    rank: int
    stages: tuple[int, ...]
    params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # the peak over the rank's schedule, not the sum of stage peaks
    backward_bytes: int = 0  # of activation_bytes, what lives only inside a backward or a loss chunk
    transient_bytes: int = 0  # a quantized base's dequantized weights (hfpipe.plan.quant)
    all_to_all_bytes: int = 0  # expert-parallel traffic one GPU sends per step (not memory)
    tp_bytes: int = 0  # tensor-parallel traffic one GPU moves per step (not memory)
    fsdp_bytes: int = 0  # FSDP2's all-gather + reduce-scatter traffic one GPU moves per step
    cp_bytes: int = 0  # context-parallel K/V gathers one GPU receives per step (not memory)
    apart_bytes: int = 0  # of grads + activations, what never exists at once (hfpipe.plan.peak)
    reduce_bytes: int = 0  # FSDP2's reduce-scatter after the last backward, beside the whole grads (plan.memory)

    @property
    def total_bytes(self) -> int:  # activations are gone when FSDP2 reduce-scatters
        return (self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.transient_bytes
                + max(self.activation_bytes - self.apart_bytes, self.reduce_bytes))


@dataclass(frozen=True)
class PlanReport:
    """A plan priced per stage and per rank, with its balance and bubble."""

    model: str
    total_params: int  # of the transformers model (MTP layers it lacks not included)
    num_layers: int
    plan: object  # hfpipe.plan.split.Plan
    schedule: str
    microbatches: int
    microbatch_size: int  # sequences per microbatch
    seq_len: int
    dtype: str
    activation_checkpointing: str
    stages: tuple[StageReport, ...]
    ranks: tuple[RankReport, ...]
    balance: float  # max / mean stage cost
    bubble: float  # idle share of a step (analytic)
    actions: tuple  # per rank, the (kind, stage, microbatch) steps of the schedule
    dp: int = 1  # data-parallel pipelines; > 1 shards each rank's state with FSDP2
    lora: str | None = None  # a LoRA run's adapters, in words (memory columns are then LoRA's)
    layer_act: tuple[int, int] = (0, 0)  # fewest and most activation bytes a layer keeps per token
    hidden: int = 0
    ep: int = 1  # expert-parallel degree (hfpipe.plan.experts)
    notes: tuple[str, ...] = ()  # lines about expert parallelism, a quantized base, idle ranks
    tp: int = 1  # tensor-parallel degree (hfpipe.plan.tensor)
    sequence_parallel: bool = True
    reshard_per_microbatch: bool = False  # FSDP2 reshards weights and gradients every microbatch
    cp: int = 1  # context-parallel degree (hfpipe.plan.context)
    method: str = "sft"  # dpo: microbatches hold both sequences of their pairs (hfpipe.plan.preference)
    reference: object = None  # dpo: the reference pass's hfpipe.plan.preference.ReferencePass

    @property
    def gpus(self) -> int:
        return self.plan.pp * self.dp * self.cp * self.tp


def plan_report(config, pp: int, *, vpp: int = 1, schedule: str | None = None, layout: str | None = None,
                method: str = "balanced", microbatches: int | None = None, seq_len: int = 4096,
                batch_size: int | None = None, dtype: str = "bf16-mixed",
                activation_checkpointing: str = "none", name: str | None = None,
                dp: int = 1, lora_rank: int | None = None, lora_targets: str = "all-linear",
                ep: int = 1, quantize_base: str | None = None, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                reshard_per_microbatch: bool = False, quantize_block_size: int | None = None,
                train_method: str = "sft", fp8: str | None = None) -> PlanReport:
    """Plan ``config`` into pipeline stages and price every stage and rank.

    Args:
        config: A transformers ``PretrainedConfig`` of a supported causal LM.
        pp: Pipeline ranks.
        vpp: Stages per rank; left at 1 it becomes 2 for the interleaved and V schedules.
        schedule: One of :data:`hfpipe.parallel.rules.SCHEDULES`; default ``1f1b``, or
            ``interleaved-1f1b`` when ``vpp > 1``.
        layout: Megatron-style layout (overrides ``method``).
        method: ``balanced``, ``even`` or ``weighted``.
        microbatches: Microbatches per step; default ``pp * vpp``.
        seq_len: Tokens per sequence.
        batch_size: Sequences per step; default one per microbatch.
        dtype: ``fp32``, ``bf16-mixed``, ``bf16`` or ``fp64``.
        activation_checkpointing: ``none``, ``selective`` or ``full``.
        name: What to call the model in the report; default the config's own name.
        dp: Data-parallel degree; above 1, weights, gradients and AdamW state priced as FSDP2 shards them.
        lora_rank, lora_targets: Price a LoRA run instead (frozen base, fp32 adapters).
        ep: Expert-parallel degree: routed experts sharded over ep ranks of dp (hfpipe.plan.experts).
        quantize_base: ``nf4`` or ``fp8``: a LoRA run's frozen base quantized (plan.quant; MoE layers as ep's).
        quantize_block_size: Its block size, checked on the model as finetune checks it (priced at
            the defaults: the scales are a fraction of a percent of the bytes).
        cp: Context-parallel degree: each sequence split over cp ranks, FSDP2 over dp x cp
            (hfpipe.plan.context).
        tp, sequence_parallel: Tensor-parallel degree, and whether activations split over the
            sequence too (hfpipe.plan.tensor).
        reshard_per_microbatch: FSDP2 reshards weights and reduce-scatters gradients every
            microbatch instead of once per step (hfpipe.plan.tensor).
        train_method: ``sft``, or ``dpo``: ``batch_size`` counts pairs of two sequences, and the reference pass
            before training is priced too (hfpipe.plan.preference).
        fp8: Float8's recipe: torchao's priced as bf16-mixed; ``blockwise``, an FP8 base's tile products (plan.quant).

    Raises:
        PlanError, ParallelError, UnsupportedModelError: the plan cannot be made (the message
            names the option to change).
    """
    from hfpipe.config.options import require_positive
    from hfpipe.models.support import get_adapter
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout
    from hfpipe.plan.split import PlanError, bubble_fraction, idle_ranks, layer_costs, plan_pipeline

    if dtype not in BYTES_PER_PARAM:
        raise PlanError(f"--dtype must be one of {', '.join(BYTES_PER_PARAM)}; got {dtype!r}")
    if activation_checkpointing not in _AC_MODES:
        raise PlanError(f"--activation-checkpointing must be one of {', '.join(_AC_MODES)}; "
                        f"got {activation_checkpointing!r}")
    dims = ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
    check_quant(quantize_base, lora_rank, config, quantize_block_size, tp, fp8=fp8, dtype=dtype)
    get_adapter(config)
    sp, reshard = sequence_parallel and tp > 1, reshard_per_microbatch
    tensor.check_tp(config, tp, dp=dp, reshard=reshard, lora=lora_rank is not None)
    require_positive(seq_len=seq_len, microbatches=microbatches, batch_size=batch_size)
    schedule = schedule or ("interleaved-1f1b" if vpp and vpp > 1 else "1f1b")
    checked = check_layout(dims, schedule, vpp=vpp, microbatches=microbatches, batch_size=batch_size,
                           model_config=config, reshard_per_microbatch=reshard, lora=lora_rank is not None,
                           quantize_base=quantize_base, seq_len=seq_len)
    vpp, m = checked.vpp, checked.microbatches
    batch = (batch_size or m) * sequences_per_pair(train_method)  # sequences: a dpo pair is two
    plan = plan_pipeline(config, pp, vpp=vpp, style=checked.style, method=method, layout=layout, seq_len=seq_len)
    costs = layer_costs(config, seq_len)
    actions = schedule_actions(schedule, pp, vpp, m)
    tokens, shards = batch // m * seq_len // cp, dp * cp  # a cp rank's tokens; FSDP2 over dp x cp
    lora_key = (lora_rank, lora_targets) if lora_rank is not None else None
    own = ep > 1 or bool(quantize_base and any(costs.layer_routed_params))  # hfpipe's experts forward
    layouts = layer_layouts(config, dtype, lora_key, ep > 1 and tp > 1, shards > 1, dispatched=own)
    measured = tuple(sum(held) for held in layouts)
    per_layer = context.layer_bytes(tensor.layer_bytes(layouts, tp, sp), config, cp, tp, dtype, seq_len)
    head = _Head(head_bytes_per_token(config, dtype, lora_key, tp, fsdp=shards > 1),
                 lora_rank is None or _adapted_head(config, lora_key))
    # a LoRA run's adapters on the expert stacks: each microbatch keeps its experts' weights with their delta
    fixed = tuple(b // ep for b in expert_adapter_bytes(config, dtype, lora_key, fsdp=shards > 1, dispatched=own))
    parts = [_stage_parts(config, s, tokens, dtype, activation_checkpointing, per_layer, costs, tp, sp, head, fixed)
             for s in plan.stages]
    per_mb = [sum(a for a, _ in p) for p in parts]
    counts, peaks = in_flight(actions, per_mb)
    extra = tokens * max(per_layer, default=0) + max(fixed, default=0) if activation_checkpointing != "none" else 0
    kv = context.held_kv(config, tokens, cp, tp, dtype)  # one layer's whole-sequence dK/dV
    mean_cost = sum(s.cost for s in plan.stages) / len(plan.stages) or 1.0
    stages = tuple(StageReport(
        s.index, plan.rank_of_stage(s.index), _holds(s), _stage_params(s, costs),
        s.cost / mean_cost, counts[s.index], per_mb[s.index],
        counts[s.index] * per_mb[s.index] + (extra + kv if s.layers else 0)) for s in plan.stages)
    recomputes = [_recompute(plan.stages_of_rank(r), extra, head.unchunked(config, tokens)) + kv
                  if any(s.layers for s in plan.stages_of_rank(r)) else 0 for r in range(pp)]
    passing = [rank_transient(plan.stages_of_rank(r), config, dtype, lora_key, shards > 1, tokens, tp, head.unchunked(
        config, tokens), head.trains, extra, own, split=any(a[0] == "I" for a in actions[r])) for r in range(pp)]
    ranks = tuple(_rank_report(r, plan, stages, costs, config, param_bytes(dtype, shards, reshard),
                               peaks[r] + recomputes[r] + passing[r], passing[r]) for r in range(pp))
    # tp first: under ep the routed experts stay whole over tp, and price_ep then prices each rank's 1 / ep of
    # them as FSDP2 shards over the dp / ep x tp ranks that hold them (hfpipe.plan.experts)
    ranks = price_ep(tensor.price_ranks(ranks, plan, costs, tp, ep), plan, costs, dtype, shards, ep, reshard, tp)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    total = costs.embed_params + sum(costs.layer_params) + costs.head_params
    lora, notes, adapters = None, [], None
    if lora_rank is not None:
        from hfpipe.plan.lora import describe_plan, tp_adapters

        ranks, lora = describe_plan(ranks, plan, config, dtype, lora_rank, lora_targets,
                                    total - costs.embed_params * tied, shards, tp, bool(quantize_base))
        adapters = tp_adapters(config, lora_rank, lora_targets, tp) if tp > 1 else None
        if ep > 1 or quantize_base:
            ranks = price_base(ranks, plan, config, quantize_base, dtype, shards, ep, tp, fp8 == "blockwise" and tokens)
    ranks, lines = _tensor_and_fsdp(ranks, plan, costs, config, dtype, shards, ep, tp, sp, reshard, m, tokens,
                                    activation_checkpointing, adapters)
    ranks = tuple(_apart(r, actions[r.rank], {s.index: parts[s.index] for s in plan.stages_of_rank(r.rank)},
                         recomputes[r.rank] + r.backward_bytes) for r in ranks)
    cp_bytes = context.cp_traffic(plan, config, cp, tp, m, batch // m, seq_len, dtype, activation_checkpointing)
    fsdp = shards > 1 and not reshard and lora_rank is None  # bf16-mixed at 1 replica: no reduce; LoRA's: adapters'
    ranks = tuple(dataclasses.replace(r, cp_bytes=c, reduce_bytes=reduce_scatter_bytes(
        r.grad_bytes, fsdp_units(plan.stages_of_rank(r.rank), costs, ep)) if fsdp else 0) for r, c in zip(ranks, cp_bytes))
    notes += lines + context.describe(cp, dp, cp_bytes, [r.fsdp_bytes for r in ranks], _size)
    if ep > 1:
        a2a = all_to_all_bytes(plan, costs, config, ep, m, tokens, dtype, activation_checkpointing, tp)
        ranks = tuple(dataclasses.replace(r, all_to_all_bytes=a) for r, a in zip(ranks, a2a))
        notes.append(describe_ep(config, ep, dp, a2a, _size, dtype, frozen=lora_rank is not None, tp=tp))
    if quantize_base:
        notes.append(describe_quant(quantize_base, ranks, _size, tiles=fp8 == "blockwise"))
    reference = None
    if train_method == "dpo":
        reference = reference_pass(plan, ranks, config, tokens=tokens, per_layer=per_layer, dtype=dtype,
                                   hidden_elements=_hidden_elements(config), microbatches=m, tp=tp, sp=sp,
                                   activation_checkpointing=activation_checkpointing, lora=lora_rank is not None)
        notes.append(describe_reference(reference, _size))
    notes += idle_ranks(plan)
    return PlanReport(
        model=name or getattr(config, "_name_or_path", "") or config.model_type,
        total_params=total - costs.embed_params * tied, num_layers=len(costs.layers), plan=plan,
        schedule=schedule, microbatches=m, microbatch_size=batch // m, seq_len=seq_len,
        dtype=dtype, activation_checkpointing=activation_checkpointing, stages=stages,
        ranks=ranks, balance=plan.balance, bubble=bubble_fraction(schedule, pp, vpp, m),
        actions=actions, dp=dp, lora=lora, layer_act=(min(measured, default=0), max(measured, default=0)),
        hidden=config.hidden_size, ep=ep, notes=tuple(notes), tp=tp, sequence_parallel=sp,
        reshard_per_microbatch=reshard, cp=cp, method=train_method, reference=reference)


def _tensor_and_fsdp(ranks, plan, costs, config, dtype, dp, ep, tp, sp, reshard, m, tokens, ac, adapters):
    """``ranks`` (already one tensor-parallel rank's share) with FSDP2's gathered unit when it reshards
    per microbatch, and the traffic of both (:mod:`hfpipe.plan.tensor`); and the lines that say so."""
    if reshard:
        ranks = tensor.gathered_unit(ranks, plan, costs, dtype, tp, ep)
    tp_bytes = tensor.tp_traffic(plan, costs, config, tp, m, tokens, dtype, ac, sequence_parallel=sp, ep=ep,
                                 adapters=adapters, reshard=reshard)
    traffic = [tensor.fsdp_traffic(plan, costs, dtype, dp, ep, tp, m, r) for r in (False, reshard)]
    ranks = tuple(dataclasses.replace(r, tp_bytes=t, fsdp_bytes=f) for r, t, f in zip(ranks, tp_bytes, traffic[1]))
    return ranks, tensor.describe(tp, sp, dp, reshard, tp_bytes, *traffic, _size, ep=ep,
                                  mla=bool(getattr(config, "kv_lora_rank", None)))


def _hidden_elements(config) -> int:
    """Elements per token of the hidden states a layer takes (``h``; ``hc * h`` for DeepSeek-V4's streams)."""
    from hfpipe.models.support import get_adapter

    return math.prod(get_adapter(config).hidden_shape(config, 1, 1)[2:])


def _stage_params(stage, costs) -> int:
    # MTP layers cost nothing: the loader skips them (transformers has no module to run them)
    return (costs.embed_params * stage.embed + sum(costs.layer_params[i] for i in stage.layers)
            + costs.head_params * stage.head)


@dataclass(frozen=True)
class _Head:
    """What the last stage's head keeps per token when the loss is not chunked (measured:
    :func:`hfpipe.plan.activations.head_bytes_per_token`), and whether its weight trains."""

    bytes_per_token: int
    trains: bool

    def unchunked(self, config, tokens: int) -> int:
        """The head's bytes for one microbatch of ``tokens`` (on one tp rank), or 0 when the loss is chunked
        (then it keeps gradients, which its backward hands on rather than frees)."""
        return 0 if 0 < chunk_tokens(config.vocab_size) < tokens else int(tokens * self.bytes_per_token)


def _adapted_head(config, lora: tuple[int, str]) -> bool:
    from hfpipe.plan.lora import adapter_params

    return adapter_params(config, *lora).get("head", 0) > 0


def _recompute(stages, extra: int, head: int) -> int:
    """What recomputing one checkpointed layer adds to a rank's peak (``extra``: the largest layer's bytes).

    The recompute runs in a microbatch's backward, which on the last stage starts by freeing the
    head's log-probabilities (``head``): the rank's peak counts that microbatch whole, so the
    recompute adds only what it keeps beyond them.
    """
    return max(0, extra - head) if any(s.head for s in stages) else extra


def _stage_parts(config, stage, tokens: int, dtype: str, ac: str, per_layer: tuple[int, ...], costs,
                 tp: int = 1, sp: bool = False, head: _Head | None = None,
                 fixed: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """Per part of ``stage`` in backward order (head, layers last to first, embedding): the activation
    bytes one microbatch of ``tokens`` tokens leaves in it until backward, on one tensor-parallel rank
    (``per_layer`` already is that rank's; a residual splits only with ``sp``; ``fixed``: what a layer keeps
    per microbatch whatever its tokens), and the part's parameters."""
    act = _ACT_BYTES[dtype]
    residual = tp if sp else 1
    boundary = _hidden_elements(config) * act / residual  # a layer's input
    checkpointed = {"none": 0, "full": 1, "selective": 2}[ac]  # every layer, or every other one
    layers = [(int(tokens * boundary if checkpointed and j % checkpointed == 0 else
                   tokens * per_layer[i] + (fixed[i] if fixed else 0)), i) for j, i in enumerate(stage.layers)]
    head = head or _Head(config.vocab_size * 4 + config.hidden_size * 3 * act, True)
    h = config.hidden_size
    top = (8 * tokens + 64) * bool(checkpointed and stage.layers)  # checkpointing keeps the positions, scalars
    if stage.head and 0 < chunk_tokens(config.vocab_size) < tokens:
        # hfpipe.loss.chunked: no logits kept, but the hidden states' gradient and, where the head trains,
        # the head's (vocab x hidden) gradient wait for the backward (one chunk's logits are transient),
        # and the int64 targets
        top += tokens * h * act / residual + config.vocab_size * h * act / tp * head.trains + 8 * tokens
    elif stage.head:
        top += head.unchunked(config, tokens)
    out = [(int(top), costs.head_params * stage.head)]
    out += [(a, costs.layer_params[i]) for a, i in reversed(layers)]
    return out + [(8 * tokens * stage.embed, costs.embed_params * stage.embed)]  # the embedding keeps the ids


def _apart(rank: RankReport, steps, parts: dict[int, list[tuple[int, int]]], recompute: int) -> RankReport:
    """``rank`` with what its gradients and activations never hold at once (:func:`hfpipe.plan.peak.rank_peak`);
    each part's gradients are the rank's gradient bytes shared by its parameters."""
    params = sum(p for stage in parts.values() for _, p in stage) or 1
    grads = {s: [(a, rank.grad_bytes * p / params) for a, p in stage] for s, stage in parts.items()}
    peak = rank_peak(steps, grads, recompute)
    return dataclasses.replace(rank, apart_bytes=max(0, int(rank.activation_bytes + rank.grad_bytes - peak)))


def _rank_report(rank: int, plan, stages, costs, config, per_param, activations: int, passing=0) -> RankReport:
    mine = [s for s in stages if s.rank == rank]
    specs = plan.stages_of_rank(rank)
    params = sum(s.params for s in mine)
    if getattr(config, "tie_word_embeddings", False) and any(s.embed for s in specs) and any(
            s.head for s in specs):
        params -= costs.embed_params  # one shared embedding/head matrix on this rank
    w, g, o = per_param
    return RankReport(rank, tuple(s.index for s in mine), params, int(params * w), int(params * g),
                      int(params * o), activations, passing)


def _holds(stage) -> str:
    parts = ["embed"] if stage.embed else []
    for one, many, ids in (("layer", "layers", stage.layers), ("mtp", "mtp", stage.mtp)):
        if ids:
            parts.append(f"{one} {ids[0]}" if len(ids) == 1 else f"{many} {ids[0]}-{ids[-1]}")
    if stage.mtp:
        parts[-1] += " (skipped)"  # the loader skips MTP: transformers has no module to run it
    parts += ["norm, head"] if stage.head else []
    return ", ".join(parts) or "(empty)"
