"""PEFT's LoRA adapters on tensor-parallel stages (``--lora-rank`` with ``--tp``).

PEFT wraps each targeted linear as ``base_layer`` plus ``lora_B(lora_A(dropout(x))) * scaling``. Under
``--tp`` the base layer is already split by torch's styles (:mod:`hfpipe.parallel.tensor_plan`) and
returns this rank's part of the output, so the adapter's output must be the same part. The adapters
are split the way Megatron splits LoRA, with torch's own styles, which do every collective:

- colwise base (``y[:, cols]``): ``lora_B`` colwise too, ``lora_A`` whole. ``lora_B``'s style makes its
  input a replicated DTensor, so the gradient into ``lora_A``'s output is summed over the tp ranks
  (its partial sums are the only ones on this path) and ``lora_A``'s gradient is the same on every
  rank, as is the gradient the adapter adds to ``x``. Where ``x`` is a block's replicated DTensor input
  (:func:`hfpipe.parallel.tensor_plan._block_inputs`), ``lora_A`` reads it as a plain tensor and hands
  back that whole gradient, which autograd adds to the base's partial ones before the block's one sum.
- rowwise base (``x[:, rows]`` in, summed out): ``lora_A`` rowwise (its (B, T, r) output summed over
  the ranks, or reduce-scattered by sequence under SP, as the base's output is), ``lora_B`` whole
  (under SP a replicated DTensor, so its gradient from this rank's tokens is summed; it multiplies row
  by row, :func:`_rows_times_weight`, which ``--compile`` can trace at every sequence length).
- a base the plan leaves whole (MLA's ``q_a_proj``): whole adapters on a whole, replicated input.
- an FP8 base (``--quantize-base fp8``) split by :mod:`hfpipe.quant.tensor`: the same as a plain
  colwise or rowwise base (it returns the same part of the output), so its adapters split alike.
- MLA's ``kv_a_proj_with_mqa`` (whole, with the rope key's gradient summed by a hook): the hook moves
  from the base layer to PEFT's wrapper, so it also covers the adapter's part of the output.

Splitting the adapters, rather than keeping them whole and gathering around them, keeps the
collectives of a LoRA layer to one of (B, T, r) elements, and each rank's adapter memory to 1/tp of
the split side. Every rank initialises the whole adapters from the same seed (:mod:`hfpipe.lora.adapters`)
and keeps its part, so the start is the same at any tp.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from hfpipe.lora.adapters import ADAPTER, LoraError
from hfpipe.parallel.tensor_plan import _MlaKvA, _whole_local_input

__all__ = ["check_tp_lora", "split_adapters"]

#: What the vocabulary-parallel embedding and head (hand-written forwards) cannot carry an adapter on.
_VOCAB_SPLIT = ("embed_tokens", "lm_head")


def check_tp_lora(config, tp: int, dropout: float | None = None) -> None:
    """Refuse a resolved ``LoraConfig`` that tensor-parallel stages cannot train exactly (one line).

    Raises:
        LoraError: adapters on the fused experts, the embedding or the head, or dropout.
    """
    if tp == 1:
        return
    if config.target_parameters:
        raise LoraError(f"--tp {tp} with LoRA on the routed experts ({', '.join(config.target_parameters)}): "
                        "adapters on the experts of tensor-parallel stages are not built; name the attention and dense "
                        "MLP layers in --lora-targets (e.g. q_proj,k_proj,v_proj,o_proj) or use --tp 1")
    targets = config.target_modules
    named = [targets] if isinstance(targets, str) else sorted(targets or ())
    hit = [t for t in named if any(v in t for v in _VOCAB_SPLIT)]
    if hit:
        raise LoraError(f"--tp {tp} with --lora-targets {','.join(hit)}: the vocabulary-split embedding and head "
                        "take no adapter; target the decoder layers or use --tp 1")
    dropout = config.lora_dropout if dropout is None else dropout
    if dropout:
        # A whole adapter on a replicated input draws its dropout mask on each tp rank: nothing but
        # the ranks' random state keeps the masks, and so the replicas of lora_A, the same.
        raise LoraError(f"--tp {tp} with --lora-dropout {dropout}: dropout masks are not kept equal across "
                        "tp ranks; use --lora-dropout 0 with --tp, or --tp 1")


def split_adapters(modules: list[nn.Module], plans: list[dict], tp_mesh) -> None:
    """Split every LoRA adapter of this rank's stages as its base layer is split (module docstring).

    Args:
        modules: The stage modules after PEFT's injection (whole adapters, identical on every tp rank).
        plans: Each stage's tp plan (:func:`hfpipe.parallel.tensor_plan.stage_tp_plan`), keyed by the
            names the targeted modules had before PEFT wrapped them.
        tp_mesh: The 1-D tp mesh the bases are split over.
    """
    from peft.tuners.lora import Linear

    for module, plan in zip(modules, plans, strict=True):
        for name, layer in list(module.named_modules()):
            if not hasattr(layer, "lora_A") or ADAPTER not in layer.lora_A:
                continue
            if type(layer) is not Linear:  # check_tp_lora let through what this cannot split
                raise LoraError(f"--tp with LoRA: {name} is a {type(layer).__name__} adapter, which tp-split "
                                "stages do not carry; leave it out of --lora-targets or use --tp 1")
            _split(layer, plan.get(name), tp_mesh, name)


def _rows_times_weight(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for a sequence-sharded DTensor ``x`` of (B, T, r) and a replicated weight, as one matmul per row.

    ``F.linear`` flattens (B, T) into one dim, and DTensor's sharding rule for that view of a sequence-sharded
    tensor cannot be traced by torch 2.13 once T is symbolic (``--compile`` at a second length: its proxies
    refer to each other without end, tests/models/test_models_compile_tp.py). ``bmm`` keeps T a dim of its own:
    the same products, summed in the kernel's own order (within fp32 rounding of ``F.linear``'s, 1e-7 measured),
    and the weight's gradient is the same partial sum over this rank's tokens.
    """
    if x.dim() != 3:
        return nn.functional.linear(x, linear.weight, linear.bias)
    weight = linear.weight.t()  # (r, out)
    out = torch.bmm(x, weight.unsqueeze(0).expand(x.shape[0], *weight.shape))  # (B, T, out)
    return out if linear.bias is None else out + linear.bias


def _split(layer: nn.Module, style, mesh, name: str) -> None:
    a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
    if style is None:
        return  # a whole base on a whole input: whole adapters compute the same on every rank
    if isinstance(style, _MlaKvA):
        base = layer.base_layer
        if len(base._forward_hooks) != 1:
            raise LoraError(f"--tp with LoRA: {name} carries {len(base._forward_hooks)} hooks, expected the "
                            "rope-gradient hook alone")
        base._forward_hooks.clear()
        style._apply(layer, mesh)  # the summed rope gradient now covers base and adapter together
    elif isinstance(style, ColwiseParallel):
        parallelize_module(b, mesh, ColwiseParallel(), src_data_rank=None)
        a.register_forward_pre_hook(_whole_local_input)  # the block's replicated input
    elif isinstance(style, RowwiseParallel):
        to = style.output_layouts[0]
        parallelize_module(a, mesh, RowwiseParallel(output_layouts=to, use_local_output=style.use_local_output),
                           src_data_rank=None)
        if isinstance(to, Shard):  # SP: this rank's tokens of r-wide rows; B's gradient summed over ranks
            parallelize_module(b, mesh, SequenceParallel(sequence_dim=to.dim, use_local_output=False),
                               src_data_rank=None)
            b.forward = partial(_rows_times_weight, b)
        elif not isinstance(to, Replicate):
            raise LoraError(f"--tp with LoRA: {name}'s output layout {to} has no adapter split")
    else:
        raise LoraError(f"--tp with LoRA: {name} is split by {type(style).__name__}, which has no adapter split; "
                        "leave it out of --lora-targets or use --tp 1")
