"""A float8 linear whose frozen weight gets no gradient: LoRA's base under ``--fp8``.

torchao's ``Float8Linear`` multiplies in float8 through an autograd function whose backward always
computes both gradients, the input's and the weight's (``matmul_with_hp_or_float8_args``). A LoRA
base is frozen: its weight's gradient is thrown away, but the float8 GEMM that makes it, and the casts
before it, still run, a third of the base's matmuls. :class:`FrozenAwareFloat8Linear` is torchao's
linear (the same forward, the same parameters and config) whose backward, while its weight does not
require a gradient, computes the input's gradient alone, by the same casts and GEMM torchao's backward
uses for it, so the values are the same bit for bit (``tests/quant/test_quant_fp8_training.py``).
A trainable weight takes torchao's own path.
"""

from __future__ import annotations

import torch
from torchao.float8.config import ScalingType
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

__all__ = ["FrozenAwareFloat8Linear"]


def _to_float8(t: torch.Tensor, cast, mm_config, role: GemmInputRole, dim: int, config) -> torch.Tensor:
    """``t`` cast as torchao's backward casts it for the input's gradient (``cast``: its CastConfig)."""
    if tensor_already_casted_to_fp8(t) or cast.scaling_type is ScalingType.DISABLED:
        return t
    return hp_tensor_to_float8_dynamic(t, cast.target_dtype, mm_config, gemm_input_role=role,
                                       scaling_granularity=cast.scaling_granularity,
                                       axiswise_dim=get_maybe_axiswise_dim(dim, cast.scaling_granularity),
                                       round_scales_to_power_of_2=config.round_scales_to_power_of_2)


class _FrozenWeightMatmul(torch.autograd.Function):
    """``x @ W.T`` as torchao computes it; backward gives the input's gradient only (W is frozen)."""

    @staticmethod
    def forward(ctx, x, weight_t, mm_config, config):
        ctx.save_for_backward(weight_t)  # not x: only the weight's gradient would read it
        ctx.mm_config, ctx.config = mm_config, config
        return matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config)  # no graph: grad is off here

    @staticmethod
    def backward(ctx, grad_output):
        (weight_t,) = ctx.saved_tensors
        c, mm = ctx.config, ctx.mm_config
        shape = grad_output.shape
        grad = _to_float8(grad_output.reshape(-1, shape[-1]), c.cast_config_grad_output, mm,
                          GemmInputRole.GRAD_OUTPUT, -1, c)  # (tokens, out)
        weight = _to_float8(weight_t, c.cast_config_weight_for_grad_input, mm, GemmInputRole.WEIGHT, -1, c)
        grad_input = torch.mm(grad, weight.t())  # (tokens, in)
        return grad_input.reshape(*shape[:-1], grad_input.shape[-1]), None, None, None


class FrozenAwareFloat8Linear(Float8Linear):
    """torchao's ``Float8Linear``; with a frozen weight, backward skips the weight's gradient GEMM."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            return super().forward(input)
        if torch.is_autocast_enabled():  # as torchao's forward: the matmul's inputs in autocast's dtype
            input = input.to(torch.get_autocast_gpu_dtype())
        output = _FrozenWeightMatmul.apply(input, self.weight.t(), self.linear_mm_config, self.config)
        return output if self.bias is None else output + self.bias.to(output.dtype)
