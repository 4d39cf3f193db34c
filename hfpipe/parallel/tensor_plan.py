"""Which module of a stage is split how over the tp ranks (``--tp``): a pure plan from the config.

The plan is transformers' own ``config.base_model_tp_plan`` with its style names mapped to torch's
``ParallelStyle`` classes (``parallelize_module`` applies them, see :mod:`hfpipe.parallel.tensor`),
plus what transformers leaves out: the embedding and the head split over the vocabulary,
DeepSeek-V3's attention (MLA), and sequence parallelism. Every stage takes and returns plain, whole
tensors, so nothing tp-sharded crosses a pipeline boundary.

Only families whose plan was checked against one-process transformers (tests/parallel/test_parallel_tensor.py)
are planned; any other is refused in one line rather than run approximately.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from hfpipe.errors import ParallelError

__all__ = ["TensorParallelError", "TP_FAMILIES", "check_tp_config", "stage_tp_plan"]

#: Families whose shipped plan (with hfpipe's additions) was checked exact; others are refused.
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

# DeepSeek-V3 ships a plan for its MLPs only and leaves MLA replicated: every tp rank would run the
# whole attention. MLA shards by heads exactly as DeepSeek-V2's shipped plan does (the query and the
# key/value up-projections by heads, the output by rows); the shared rope key needs its gradient
# summed over the ranks (``mla_kv_a_proj``), since each rank's heads see only their part of it.
# MLA keeps plain inputs (no one sum per block, see _block_inputs): its column-split projections read
# the whole down-projections' latents, not the hidden states, so their input sums (q_lora_rank +
# kv_lora_rank + the rope key: 2,112 wide on DeepSeek-V3, against h = 7,168) already move less than
# Megatron's one of h per block; Megatron's own MLA splits the same way.
_MLA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
_EXTRA_PLANS = {"deepseek_v3": _MLA_PLAN}
# Parameter entries of the shipped plans: the fused experts' stacks, split by _Experts itself.
_EXPERT_PARAMS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


class TensorParallelError(ParallelError):
    """A model or setting that tensor parallelism cannot split exactly (one line: what and the fix)."""


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tp ranks (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # a strided incoming gradient is unsafe in gloo collectives
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _HeadNorm(ParallelStyle):
    """Qwen3's ``q_norm``/``k_norm``: a norm over ``head_dim`` applied to this rank's heads only.

    The weight stays whole (a replicated DTensor) and the input is read as heads-sharded, so DTensor
    sums the weight's gradient over the ranks. A gradient hook that all-reduces ``param.grad`` (what
    transformers' ``replicated_with_grad_allreduce`` does) would re-add the already summed gradient
    of earlier microbatches at every accumulation.
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            whole = distribute_tensor(p, mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(whole, requires_grad=p.requires_grad))

        def heads_in(_module, args):  # (B, T, heads_local, head_dim)
            x = args[0]
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *args[1:])

        module.register_forward_pre_hook(heads_in)
        module.register_forward_hook(lambda _m, _a, out: out.to_local())
        return module


class _MlaKvA(ParallelStyle):
    """``kv_a_proj_with_mqa`` stays whole; the rope key it emits is shared by all heads.

    Its latent part flows into ``kv_b_proj`` (colwise, which sums its input gradient over the ranks),
    but the rope part goes straight into each rank's heads: sum its gradient here.
    """

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        group, rope = mesh.get_group(), self.rope_dim

        def sum_rope_grad(_module, _args, out):
            latent, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, _SumGrad.apply(rot, group)], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module


class _VocabEmbedding(ParallelStyle):
    """The embedding split over the vocabulary: each rank looks up the ids it holds, zeros the
    others, and the ranks' partial rows are summed (all-reduce; reduce-scatter by sequence under SP).

    Written out because torch's ``RowwiseParallel`` on an ``nn.Embedding`` returns a replicated,
    whole (V, H) weight gradient on every rank (measured, torch 2.13), which at a 128k vocabulary
    costs each rank the memory the split was meant to save. Here the gradient is this rank's rows.
    """

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        weight = module.weight
        split = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(split, requires_grad=weight.requires_grad))
        rows = -(-module.num_embeddings // mesh.size())  # as torch.chunk splits them
        start, layout = mesh.get_local_rank() * rows, self.output_layout

        def forward(ids):
            local = module.weight.to_local()  # (V/tp, H); its gradient stays this rank's rows
            idx = ids - start
            outside = (idx < 0) | (idx >= local.shape[0])
            pad = module.padding_idx  # its row gets no gradient, as in nn.Embedding
            pad = pad - start if pad is not None and 0 <= pad - start < local.shape[0] else None
            rows_ = F.embedding(idx.masked_fill(outside, 0), local, pad, module.max_norm, module.norm_type,
                                module.scale_grad_by_freq, module.sparse)
            out = DTensor.from_local(rows_.masked_fill(outside.unsqueeze(-1), 0), mesh, [Partial()],
                                     run_check=False).redistribute(mesh, [layout])
            return out if isinstance(layout, Shard) else out.to_local()

        module.forward = forward
        return module


class _Experts(ParallelStyle):
    """Fused MoE expert stacks split along the intermediate size: transformers' own styles (without ``--ep``;
    with it the experts stay whole on each tp rank, :mod:`hfpipe.parallel.expert`).

    ``gate_up_proj`` [E, 2I, H] is packed (gate then up), so each rank takes its rows of both halves
    (``packed_colwise``); ``down_proj`` [E, H, I] by its last dim; the forward runs on the local
    stacks and sums the ranks' partial outputs (``moe_tp_experts``). Its input is summed as transformers'
    style sums it, but for the block's replicated DTensor (:func:`_block_inputs`): there the gradient this
    rank's experts leave is a partial one, which the block sums once with its shared experts'.
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        from transformers.distributed import tensor_parallel as hf

        hf.PackedColwiseParallel().shard_param(module, "gate_up_proj", mesh)
        hf.RowwiseParallel().shard_param(module, "down_proj", mesh)
        style, forward, group = hf.MoeExpertsParallel(), module.forward, mesh.get_group()

        def tp_forward(hidden, top_k_index, top_k_weights, *rest):
            if isinstance(hidden, DTensor):
                hidden = hidden.to_local(grad_placements=[Partial()])
            else:
                hidden = _SumGrad.apply(hidden, group)
            top_k_weights = _SumGrad.apply(top_k_weights, group)  # each rank's partial outputs: partial gradients
            with style.context_around_forward(module, mesh):  # the local stacks
                out = forward(hidden, top_k_index, top_k_weights, *rest)
            return style.transform_output_post_forward(module, out, mesh)  # the ranks' partial outputs summed

        module.forward = tp_forward
        return module


class _Router(ParallelStyle):
    """A MoE router, whole on every rank, reads the block's replicated input as a plain tensor."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        module.register_forward_pre_hook(_whole_local_input)
        return module


def _whole_local_input(_module, args):
    """A whole module on a block's replicated DTensor input (a MoE router, a LoRA ``lora_A``) runs on the
    plain tensor. The gradient it hands back is whole on every rank (its output's gradient was summed over
    the ranks first: the top-k weights', ``lora_B``'s input's), so it joins the block's partial sums as a
    replicated one."""
    x = args[0]
    if isinstance(x, DTensor):
        return (x.to_local(grad_placements=[Replicate()]), *args[1:])
    return None


def check_tp_config(config, tp_size: int) -> None:
    """Refuse a model that ``tp_size`` ranks cannot split exactly (call it before any process starts).

    Raises:
        TensorParallelError: an unchecked family, or a size that does not divide by ``tp_size``.
    """
    family = config.model_type
    if family not in TP_FAMILIES:
        raise TensorParallelError(f"--tp {tp_size}: tensor parallelism is not checked exact for {family!r} "
                                  f"(checked: {', '.join(TP_FAMILIES)}); run it with --tp 1")
    sizes = {"num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size,
             "intermediate_size": config.intermediate_size}
    if family != "deepseek_v3":  # MLA keeps one shared latent key/value: no kv heads to split
        sizes["num_key_value_heads"] = config.num_key_value_heads
    if getattr(config, "moe_intermediate_size", None):
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    for field, size in sizes.items():
        if size % tp_size:
            common = math.gcd(*sizes.values())
            fits = [t for t in range(1, common + 1) if common % t == 0]
            raise TensorParallelError(f"--tp {tp_size}: {family} has {field}={size}, which {tp_size} tp ranks "
                                      f"cannot split evenly; the --tp this model takes: {', '.join(map(str, fits))}")


def stage_tp_plan(config, stage_module_names, sequence_parallel: bool, tp_size: int,
                  experts_whole: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one stage, keyed by the stage's own module names.

    Args:
        config: The model's transformers config.
        stage_module_names: Every module name of the stage (``name for name, _ in stage.named_modules()``),
            under the full model's names (``model.layers.17.mlp``, ``lm_head``).
        sequence_parallel: Shard the residual stream by sequence inside the stage's layers (norms
            run on 1/tp of the tokens; the all-reduces become reduce-scatter + all-gather).
        tp_size: Ranks of the tp mesh.
        experts_whole: The routed experts are sharded over ep (``--ep``): leave them out, each tp rank
            holds whole experts and dispatches its own slice of the tokens (Megatron's expert tensor
            parallelism 1; transformers' ``AllToAllEP`` with a tp mesh, :mod:`hfpipe.parallel.expert`).

    Raises:
        TensorParallelError: see :func:`check_tp_config`.
    """
    check_tp_config(config, tp_size)
    names = set(stage_module_names)
    layers = sorted((n for n in names if n.count(".") == 2 and n.startswith("model.layers.")),
                    key=lambda n: int(n.rsplit(".", 1)[1]))
    plan: dict[str, ParallelStyle] = {}
    if "model.embed_tokens" in names:  # vocab-parallel: each rank looks up its rows, the ranks' sums add up
        plan["model.embed_tokens"] = _VocabEmbedding(Shard(1) if sequence_parallel else Replicate())
    shipped = {**config.base_model_tp_plan, **_EXTRA_PLANS.get(config.model_type, {})}
    for layer in layers:
        plan.update(_layer_plan(config, shipped, layer, names, sequence_parallel, experts_whole))
    if sequence_parallel and layers:
        plan.update(_boundaries(layers[0], layers[-1], first_stage="model.embed_tokens" in names))
    if "lm_head" in names:  # the logits stay split over the vocabulary: the loss never gathers them
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                          use_local_output=False)
    return plan


def _layer_plan(config, shipped: dict, layer: str, names: set, sp: bool,
                experts_whole: bool) -> dict[str, ParallelStyle]:
    """One decoder layer's entries: the shipped styles, and sequence parallelism around them."""
    moe = f"{layer}.mlp.experts" in names
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in shipped.items():
        name = f"{layer}.{pattern.removeprefix('layers.*.')}"
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".experts") and _EXPERT_PARAMS.get(leaf) == style:
            continue  # a parameter of the experts' stacks: _Experts on their module splits it
        if name not in names:
            continue  # a part this layer lacks (a dense layer's experts, a MoE layer's dense MLP)
        if experts_whole and style == "moe_tp_experts":
            continue  # sharded over ep instead, whole on each tp rank
        plan[name] = _style(config, style, sp and _feeds_residual(layer, name, moe))
    plan.update(_block_inputs(config, layer, names, sp, moe, experts_whole))
    if sp:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{layer}.{norm}"] = SequenceParallel()
    return plan


def _block_inputs(config, layer: str, names: set, sp: bool, moe: bool, experts_whole: bool) -> dict:
    """How attention and the MLP take the residual stream: Megatron's ``f``, one input-gradient sum per block.

    A folded block takes its input as one replicated DTensor (gathered by sequence under SP), which every
    column-split projection reads as it is: each leaves a partial input gradient on that same DTensor,
    autograd adds them up, and the block's input redistribution sums them once in backward (an
    all-reduce; a reduce-scatter under SP). Handed plain tensors instead, each ``ColwiseParallel`` would
    sum its own (q, k, v, gate, up: 5 sums of h per layer where Megatron has 2).
    """
    plan: dict[str, ParallelStyle] = {}
    seq = Shard(1) if sp else Replicate()
    if not getattr(config, "kv_lora_rank", None):
        plan[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False)
    elif sp:  # MLA stays plain: see _MLA_PLAN for why its sums are already under one of h
        plan[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True)
    mlp = f"{layer}.mlp"
    if moe and experts_whole:
        return {**plan, **_ep_block(mlp, names, seq)}
    if moe:  # the router, the routed and the shared experts share the block's one sum
        plan[f"{mlp}.gate"] = _Router()
    if moe and sp:  # experts and shared experts return whole, summed outputs: keep this rank's tokens
        plan[mlp] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=False,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=False)
    else:
        plan[mlp] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                       use_local_output=False)
    return plan


def _ep_block(mlp: str, names: set, seq) -> dict[str, ParallelStyle]:
    """Under ep the routed experts' block stays plain: transformers' AllToAllEP slices the tokens over the tp
    ranks on plain tensors, and its backward gathers their gradients. The shared experts' gate and up share
    one sum."""
    plan: dict[str, ParallelStyle] = {}
    if isinstance(seq, Shard):  # experts, shared experts return whole outputs (gathered, summed): keep our tokens
        plan[mlp] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=False)
    if f"{mlp}.shared_experts" in names:
        plan[f"{mlp}.shared_experts"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
    return plan


def _feeds_residual(layer: str, name: str, moe: bool) -> bool:
    """Whether a rowwise module's output is added to the residual stream directly (SP: reduce-scatter)."""
    return name == f"{layer}.self_attn.o_proj" or (not moe and name == f"{layer}.mlp.down_proj")


def _style(config, style: str, to_sequence: bool) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        if to_sequence:
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel()
    if style == "replicated_with_grad_allreduce":
        return _HeadNorm()
    if style == "mla_kv_a_proj":
        return _MlaKvA(config.qk_rope_head_dim)
    if style == "moe_tp_experts":
        return _Experts()
    raise TensorParallelError(f"--tp: {config.model_type}'s tp plan uses the style {style!r}, which hfpipe does "
                              "not map; run it with --tp 1")


def _boundaries(first: str, last: str, first_stage: bool) -> dict[str, ParallelStyle]:
    """Scatter the whole hidden states by sequence into the first layer, gather them after the last.

    Only plain, whole tensors may cross a pipeline boundary (DTensors do not survive torch's P2P),
    and the last stage's final norm and chunked head loss read whole hidden states too, so every
    stage gathers after its last layer; a first stage's embedding already hands out sequence shards.
    """
    gather = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
    scatter = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
    if first_stage:
        return {last: PrepareModuleOutput(**gather)}
    if first == last:
        return {first: PrepareModuleInputOutput(**scatter, use_local_input=False, **gather)}
    return {first: PrepareModuleInput(**scatter, use_local_output=False), last: PrepareModuleOutput(**gather)}
