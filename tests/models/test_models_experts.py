"""hfpipe's experts forward (``hfpipe.models.experts``, run for LoRA on the routed experts and for quantized
experts) computes what transformers' own eager experts loop computes, in the run's precision: an fp64 run's
expert outputs are summed in fp64 (not rounded through fp32), an fp32 run's in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hfpipe.models.experts import experts_forward


def _experts_and_routing(dtype: torch.dtype):
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    g = torch.Generator().manual_seed(0)
    config._experts_implementation = "eager"  # transformers' own loop (its decorator dispatches on the config)
    experts = MixtralExperts(config).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.2)
    tokens = 24
    x = torch.randn(tokens, 32, generator=g, dtype=dtype)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=g, dtype=dtype), -1)
    return experts, x, index, weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_experts_forward_sums_in_the_runs_precision(dtype):
    experts, x, index, weights = _experts_and_routing(dtype)
    experts.has_gate, experts.has_bias = True, False
    want = MixtralExperts.forward(experts, x, index, weights)  # transformers' eager loop, in the run's dtype
    got = experts_forward(experts, x, index, weights)
    assert got.dtype == dtype
    # fp64: equal to an fp64 ulp of the values (~1e-16), where an fp32 sum would be ~1e-8 off
    tolerance = 1e-13 if dtype == torch.float64 else 1e-6
    assert (got - want).abs().max().item() <= tolerance
