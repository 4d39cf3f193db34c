"""hfpipe's forward for a MoE layer's fused routed experts, where transformers' and PEFT's cannot run.

transformers holds a layer's routed experts as fused 3-D stacks (``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``, or ``up_proj``; GPT-OSS stores them transposed, with biases), and PEFT
adapts them (``target_parameters``) by folding ``W + s * lhs @ rhs`` into the whole stack through a
parametrization before the experts run. Two of hfpipe's settings break that:

- ``--quantize-base`` keeps the stacks quantized (:mod:`hfpipe.quant.experts`): FP8 codes and tile
  scales, or one NF4 tensor per expert; transformers' own ``FP8Experts`` quantizes the activations too
  (W8A8, a CUDA kernel), so it neither runs on CPU nor equals the dequantized model that is the oracle;
- ``--ep`` leaves a rank ``E / ep`` experts (a DTensor shard), which PEFT's fold cannot add to.

So the experts class stays transformers' (each family's gating, e.g. GPT-OSS's clamped interleaved
SwiGLU, is written there) and only its forward changes, through transformers' own hook for another
experts kernel (``ExpertsInterface``, name :data:`IMPLEMENTATION`): the eager loop over the experts
that got tokens, building one expert's weight at a time: its codes dequantized (or its local rows),
plus its adapter delta for the expert's *global* index. :class:`_ExpertLinear` saves only what the
weight is made from (codes, scales, the expert's adapter factors) and builds it again in backward.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["IMPLEMENTATION", "ExpertsState", "attach_adapter", "experts_forward", "experts_state", "first_expert",
           "peek_state", "register"]

#: The name hfpipe's experts forward is registered under in transformers' ``ExpertsInterface``.
IMPLEMENTATION = "hfpipe"
#: The fused 3-D weights of an experts module (transformers' names).
STACKS = ("gate_up_proj", "up_proj", "down_proj")


@dataclass
class ExpertsState:
    """hfpipe's state on one transformers experts module: one dataclass under one attribute, ``_hfpipe``.

    Attributes:
        first: The global index of the first expert this rank holds (0 unless ep-sharded).
        shapes: Stack name -> its global shape, for a stack the quantizer swapped for codes.
        nf4: Stack name -> one tuple of torchao ``NF4Tensor`` per local expert (``--quantize-base nf4``).
        adapters: Stack name -> the PEFT ``ParamWrapper`` whose adapter this forward applies.
        block: The FP8 tile edge of the stacks' scales (0: none).
        dequantize: ``(codes, scales, block, dtype) -> weight`` for FP8 stacks, set by the quantizer
            (:mod:`hfpipe.quant`), so that this module need not know the format.
        multiply: ``(x, codes, scales, block) -> x @ W.T`` computed from an FP8 expert's codes without
            dequantizing them (``--fp8-recipe blockwise``: :mod:`hfpipe.quant.fp8_matmul`), or ``None``; set by
            the quantizer where every stack's dims allow it. An expert's adapter is then added, not folded.
    """

    first: int = 0
    shapes: dict = field(default_factory=dict)
    nf4: dict = field(default_factory=dict)
    adapters: dict = field(default_factory=dict)
    block: int = 0
    dequantize: Callable | None = None
    multiply: Callable | None = None


def peek_state(module: nn.Module) -> ExpertsState | None:
    """``module``'s :class:`ExpertsState`, or ``None`` if hfpipe has none on it."""
    return module.__dict__.get("_hfpipe")


def experts_state(module: nn.Module) -> ExpertsState:
    """``module``'s :class:`ExpertsState`, created on first use: the one place it is set.

    The first expert is read off the stacks as they stand then (an ep shard's DTensor), before a
    quantizer swaps them for codes. A plain attribute: the adapters in it are not submodules twice.
    """
    state = peek_state(module)
    if state is None:
        stack = next((t for n in STACKS if (t := module._parameters.get(n)) is not None and t.dim() == 3), None)
        state = ExpertsState(first=0 if stack is None else first_expert(stack))
        module.__dict__["_hfpipe"] = state
    return state


def register(experts: nn.Module) -> None:
    """Run ``experts`` (and every experts module sharing its config) through :func:`experts_forward`.

    transformers' documented hook: an implementation registered under a new name. The registry is
    transformers' own (process-wide), so the entry is additive and idempotent: no existing name changes
    meaning; only the stage's own config points at it.
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    experts.config._experts_implementation = IMPLEMENTATION


def first_expert(t) -> int:
    """The first expert of stack ``t`` this rank holds (0 unless ``t`` is an ep-sharded DTensor)."""
    if getattr(t, "device_mesh", None) is None:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0]


def attach_adapter(experts: nn.Module, wrapper: nn.Module) -> None:
    """Let :func:`experts_forward` apply PEFT ``ParamWrapper`` ``wrapper``'s adapter on ``experts``.

    The wrapper's own fold (a parametrization of the whole stack) is switched off; its parameters stay
    where PEFT put them, under PEFT's names, so checkpoints and exports are PEFT's.
    """
    wrapper._activate_lora = lambda adapters: nullcontext()
    experts_state(experts).adapters[wrapper.parameter_name] = wrapper
    register(experts)


def _factors(wrapper, e: int, dtype: torch.dtype):
    """Expert ``e``'s ``(lhs, rhs, scaling)``: PEFT's ``ParamWrapper.get_delta_factors`` for one expert,
    cast to the compute dtype (PEFT casts to the stored weight's, FP8 codes here)."""
    (name,) = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    r = a.shape[0] // wrapper.num_experts
    a_e, b_e = a[e * r:(e + 1) * r], b.view(b.shape[0], r, wrapper.num_experts)[:, :, e]  # (r, in), (out, r)
    lhs, rhs = (b_e, a_e) if wrapper._did_swap_in_out_features else (a_e.T, b_e.T)
    return lhs.to(dtype), rhs.to(dtype), wrapper.scaling[name]


def _weight(stored, scale, block, dequantize, lhs, rhs, s, dtype):
    """One expert's weight as stored (``[out, in]``, or ``[in, out]`` transposed): dequantized (FP8 codes
    and scales, or a tuple of NF4 row blocks), plus ``s * lhs @ rhs`` folded as PEFT folds it (``baddbmm``)."""
    if isinstance(stored, tuple):
        w = torch.cat([p.get_original_weight() for p in stored]).to(dtype)
    else:
        w = stored.to(dtype) if scale is None else dequantize(stored, scale, block, dtype)
    if lhs is not None:
        w = torch.baddbmm(w[None], lhs[None], rhs[None], alpha=s)[0]
    return w


class _ExpertLinear(torch.autograd.Function):
    """``x @ W.T`` (``x @ W`` transposed) of one expert; saves what ``W`` is made of, not ``W``."""

    @staticmethod
    def forward(ctx, x, stored, scale, lhs, rhs, s: float, block: int, dequantize, transposed: bool):
        nf4 = isinstance(stored, tuple)  # the module's own NF4 tensors: held by reference, not saved
        ctx.save_for_backward(None if lhs is None else x, None if nf4 else stored, scale, lhs, rhs)  # x: for dW
        ctx.nf4, ctx.s, ctx.block, ctx.transposed = stored if nf4 else None, s, block, transposed
        ctx.dequantize = dequantize
        w = _weight(stored, scale, block, dequantize, lhs, rhs, s, x.dtype)
        return x @ w if transposed else nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad):  # the base is frozen: the input and the adapter factors get gradients
        x, stored, scale, lhs, rhs = ctx.saved_tensors
        w = _weight(ctx.nf4 or stored, scale, ctx.block, ctx.dequantize, lhs, rhs, ctx.s, grad.dtype)
        gx = grad @ w.T if ctx.transposed else grad @ w
        glhs = grhs = None
        if lhs is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            gw = x.T @ grad if ctx.transposed else grad.T @ x  # dL/dW in the stored layout
            glhs, grhs = ctx.s * gw @ rhs.T, ctx.s * lhs.T @ gw
        return gx, None, None, glhs, grhs, None, None, None, None


def _project(self, attr: str, e: int, x: torch.Tensor) -> torch.Tensor:
    state = experts_state(self)
    nf4 = state.nf4.get(attr)
    stored, scale = self._buffers.get(attr), self._buffers.get(attr + "_scale_inv")
    if nf4 is not None:  # one expert's NF4 tensors (hfpipe.quant.experts)
        stored = nf4
    elif stored is None:  # a full-precision stack (this rank's rows, local inside the ep forward)
        stored = getattr(self, attr)
    wrapper = state.adapters.get(attr)
    lhs = rhs = None
    s = 1.0
    if wrapper is not None:
        lhs, rhs, s = _factors(wrapper, state.first + e, x.dtype)
    if state.multiply is not None and scale is not None:  # FP8 codes multiplied as they are ([out, in] stacks)
        y = state.multiply(x, stored[e], scale[e], state.block)
        if lhs is not None:  # W + s * lhs @ rhs, the adapter's part added: x @ rhs.T @ lhs.T
            y = y + s * ((x @ rhs.T) @ lhs.T)
    else:
        y = _ExpertLinear.apply(x, stored[e], None if scale is None else scale[e], lhs, rhs, s, state.block,
                                state.dequantize, bool(getattr(self, "is_transposed", False)))
    if getattr(self, "has_bias", False):
        y = y + getattr(self, attr + "_bias")[e]
    return y


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop, one expert's weight built at a time (``self``: the experts module).

    ``top_k_index`` holds this rank's expert ids (``num_experts`` marks a slot another rank serves).
    """
    # The sum over a token's experts in fp32 at least (transformers' grouped kernels reduce bf16 in fp32), and in
    # the run's own precision above it: an fp64 run's outputs do not round through fp32.
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    out = torch.zeros(hidden_states.shape, dtype=acc, device=hidden_states.device)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    up = "gate_up_proj" if self.has_gate else "up_proj"
    for e in hit:
        if e == self.num_experts:
            continue
        pos, tok = torch.where(mask[e])
        h = _project(self, up, e, hidden_states[tok])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _project(self, "down_proj", e, h)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        out.index_add_(0, tok, (h * top_k_weights[tok, pos, None].to(h.dtype)).to(out.dtype))
    return out.to(hidden_states.dtype)
