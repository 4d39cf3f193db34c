"""Routed MoE experts kept block-FP8 on their ranks (``--quantize-base fp8`` on a MoE model).

transformers holds a MoE layer's routed experts as fused 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, or ``up_proj``; GPT-OSS stores them transposed), which its conversion
tables build from the checkpoint's per-expert 2-D weights. Under ``--quantize-base fp8`` each becomes two
buffers in the layout of transformers' own ``FP8Experts``: the codes ``[E_local, N, K]`` and
``<name>_scale_inv`` ``[E_local, ceil(N/b), ceil(K/b)]``, one tile grid per expert. A checkpoint's own FP8
experts are stacked (gate and up concatenated) as stored, so no value is rounded twice; a bf16 checkpoint's
are quantized expert by expert as they load. With ``--ep`` a rank holds only its experts' rows.

Why the forward is hfpipe's and not transformers' ``FP8Experts``: that one quantizes the activations too
(W8A8 through a Triton/DeepGEMM kernel, CUDA only), so it neither runs on CPU nor equals the dequantized
model that is the oracle. Each family's gating (GPT-OSS's clamped, interleaved SwiGLU; biases) is already
written in its experts class, so the class stays transformers' and only its forward changes, through
transformers' own hook for another experts kernel (``ExpertsInterface``, name :data:`IMPLEMENTATION`): the
eager loop over the experts that got tokens, dequantizing one expert's weight at a time, in forward and
again in backward (the autograd function saves only that expert's codes and scales).
"""

from __future__ import annotations

import torch
from torch import nn

from hfpipe.quant.fp8 import FP8, dequantize_blocks, quantize_blocks
from hfpipe.quant.nf4 import QuantError

__all__ = ["IMPLEMENTATION", "STACKS", "FP8ExpertStacks", "fused_experts", "experts_forward", "routed_expert_key"]

#: The name hfpipe's experts forward is registered under in transformers' ``ExpertsInterface``.
IMPLEMENTATION = "hfpipe_fp8"
#: The fused 3-D weights of an experts module (transformers' names).
STACKS = ("gate_up_proj", "up_proj", "down_proj")


def fused_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Name -> each fused-experts module of ``module`` (transformers' ``@use_experts_implementation``)."""
    return {name: m for name, m in module.named_modules()
            if hasattr(m, "has_gate") and any(_stack(m, s) is not None for s in STACKS)}


def routed_expert_key(key: str) -> bool:
    """Whether checkpoint key ``key`` is a routed expert's weight (per expert 2-D, or a fused 3-D stack)."""
    return ".experts." in key and "shared_expert" not in key and not key.endswith(("bias", "_scale_inv"))


def _stack(module: nn.Module, name: str):
    """``module``'s fused weight ``name``: a 3-D parameter, or its FP8 buffer once quantized."""
    t = module._parameters.get(name, module._buffers.get(name))
    return t if t is not None and t.dim() == 3 else None


class FP8ExpertStacks:
    """Swaps one experts module's 3-D weights for FP8 buffers (on meta) and fills them while loading.

    Args:
        module: A fused-experts module (its stacks may be ep-sharded DTensors: only local rows are kept).
        name: Its full-model name.
        block: The FP8 tile edge.
    """

    def __init__(self, module: nn.Module, name: str, block: int) -> None:
        self.module, self.block = module, block
        self.rows: dict[str, tuple[int, int]] = {}  # full-model weight name -> the experts [lo, hi) held here
        for attr in STACKS:
            old = module._parameters.get(attr)
            if old is None or old.dim() != 3:
                continue
            local = old.to_local() if hasattr(old, "to_local") else old
            lo = _first_row(old)
            self.rows[f"{name}.{attr}"] = (lo, lo + local.shape[0])
            e, n, k = local.shape
            del module._parameters[attr]
            module.register_buffer(attr, torch.empty(e, n, k, dtype=FP8, device="meta"))
            module.register_buffer(attr + "_scale_inv", torch.empty(e, -(-n // block), -(-k // block),
                                                                    dtype=torch.float32, device="meta"))
        module.fp8_block = block
        module.config._experts_implementation = IMPLEMENTATION
        _register()

    def place(self, target: str, tensor: torch.Tensor, scale: torch.Tensor | None, device) -> None:
        """Set stack ``target`` from the checkpoint's codes and ``scale`` (FP8), or quantize it here."""
        attr = target.rpartition(".")[2]
        want = tuple(self.module._buffers[attr].shape)
        if tuple(tensor.shape) != want:
            raise QuantError(f"{target}: the checkpoint gives shape {tuple(tensor.shape)}, this rank holds {want}; "
                             "config.json does not match the weights")
        if scale is None:  # full precision: one expert at a time, so one fp32 expert is the transient
            parts = [quantize_blocks(w.to(device), self.block) for w in tensor]
            tensor, scale = torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
        if tuple(scale.shape) != tuple(self.module._buffers[attr + "_scale_inv"].shape):
            raise QuantError(f"{target}_scale_inv has shape {tuple(scale.shape)}, but {self.block}x{self.block} tiles "
                             f"of {want} need {tuple(self.module._buffers[attr + '_scale_inv'].shape)}; "
                             "weight_block_size in config.json does not match the scales")
        self.module._buffers[attr] = tensor.to(device)
        self.module._buffers[attr + "_scale_inv"] = scale.to(device=device, dtype=torch.float32)


def _first_row(t) -> int:
    """The first expert of ``t`` this rank holds (0 unless ``t`` is an ep-sharded DTensor). Asked of torch
    directly, not of :func:`hfpipe.parallel.expert.local_rows`: the quantizer stays a floor below it."""
    if getattr(t, "device_mesh", None) is None:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0]


class _DequantExpert(torch.autograd.Function):
    """One expert's ``x @ W.T`` (``x @ W`` when stored transposed) from its FP8 codes; backward dequantizes again."""

    @staticmethod
    def forward(ctx, x, q, scale, block: int, transposed: bool):
        ctx.save_for_backward(q, scale)
        ctx.block, ctx.transposed = block, transposed
        w = dequantize_blocks(q, scale, block, x.dtype)
        return x @ w if transposed else nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad):  # the experts are frozen: only the input gets a gradient
        q, scale = ctx.saved_tensors
        w = dequantize_blocks(q, scale, ctx.block, grad.dtype)
        return (grad @ w.T if ctx.transposed else grad @ w), None, None, None, None


def _project(self, attr: str, e: int, x: torch.Tensor) -> torch.Tensor:
    y = _DequantExpert.apply(x, self._buffers[attr][e], self._buffers[attr + "_scale_inv"][e], self.fp8_block,
                             bool(getattr(self, "is_transposed", False)))
    if getattr(self, "has_bias", False):
        y = y + getattr(self, attr + "_bias")[e]
    return y


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop over FP8 stacks (``self`` is the experts module).

    ``top_k_index`` holds this rank's expert ids (``num_experts`` marks a slot another rank serves).
    """
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
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


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
