"""``hfpipe plan`` prices each decoder layer's activations by measuring transformers' own layer.

The oracle: transformers' whole model, run forward under a saved-tensors hook at two depths;
the difference is what its decoder layers keep for backward. hfpipe's one-layer measurement
(zero-stride parameters, 64 tokens) must agree within 5% for dense, MoE, MLA and sliding-window
families, and must cost little memory even for a 256-expert layer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hfpipe.plan.activations import layer_bytes_per_token
from hfpipe.tiny import tiny_config

TOKENS = 64


def saved_bytes(config, tokens: int = TOKENS) -> int:
    """Bytes autograd keeps when transformers' model runs ``tokens`` embedded tokens (fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = model.model.embed_tokens(torch.randint(0, config.vocab_size, (1, tokens))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(inputs_embeds=x)
    return sum(kept.values())


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3", "mixtral", "gemma2", "gpt_oss"])
def test_a_layers_measured_bytes_are_what_transformers_keeps_for_backward(kind):
    shallow, deep = tiny_config(kind, num_hidden_layers=2), tiny_config(kind, num_hidden_layers=4)
    want = (saved_bytes(deep) - saved_bytes(shallow)) / TOKENS  # layers 2 and 3
    got = sum(layer_bytes_per_token(deep, "fp32")[2:4])
    assert abs(got - want) <= 0.05 * want, (got, want)
    assert got > 34 * deep.hidden_size * 2 * 2 * 0.7  # the old formula's ballpark, never far below


MEASURE_V3 = """
import json, resource
from transformers import AutoConfig
from hfpipe.config.run import bundled_config_dir
from hfpipe.plan.activations import layer_bytes_per_token
config = AutoConfig.from_pretrained(bundled_config_dir("deepseek-ai/DeepSeek-V3"))
per_layer = layer_bytes_per_token(config, "bf16-mixed")
print(json.dumps({"per_layer": per_layer, "h": config.hidden_size,
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_a_256_expert_deepseek_v3_layer_is_measured_in_little_memory():
    # in a fresh process, so that its peak memory is the measurement's own
    out = subprocess.run([sys.executable, "-c", MEASURE_V3], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    per_layer, h = got["per_layer"], got["h"]
    dense, moe = per_layer[0], per_layer[-1]  # first_k_dense_replace = 3
    assert per_layer[:3] == [dense] * 3 and set(per_layer[3:]) == {moe}
    assert 2.0 < dense / (34 * h) < 3.0  # 42 h elements against the formula's 17
    assert 3.5 < moe / (34 * h) < 4.5  # the router and 8 experts per token
    assert got["maxrss"] < 2e9  # one MoE layer holds 11e9 parameters; the measurement allocates none


def test_measuring_leaves_the_callers_random_state_alone_and_a_failure_falls_back_to_the_formula(monkeypatch):
    from hfpipe.plan import activations as plan_activations

    plan_activations._measure_all.cache_clear()  # so that this call really measures
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    layer_bytes_per_token(tiny_config("qwen3"), "bf16")
    assert torch.equal(torch.rand(3), want)

    def broken(*args):
        raise RuntimeError("this family's layer needs an input hfpipe does not make")

    monkeypatch.setattr(plan_activations, "_measure_layer", broken)
    config = tiny_config("llama", num_hidden_layers=3, hidden_size=96)
    assert layer_bytes_per_token(config, "bf16") == (34 * 96,) * 3


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_skipping_the_matmuls_keeps_the_same_bytes(kind, dtype, monkeypatch):
    # the measurement returns zeros for matrix products (shapes only); computing them must give
    # the same count, experts' grouped products included
    import contextlib

    from hfpipe.plan import activations as plan_activations

    config = tiny_config(kind, num_hidden_layers=2)
    plan_activations._measure_all.cache_clear()
    skipped = layer_bytes_per_token(config, dtype)
    plan_activations._measure_all.cache_clear()
    monkeypatch.setattr(plan_activations, "_SkipMatmuls", contextlib.nullcontext)
    assert layer_bytes_per_token(config, dtype) == skipped
    plan_activations._measure_all.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V4-Flash-Base",
                                   "deepseek-ai/DeepSeek-V2-Lite", "meta-llama/Llama-3.1-70B"])
def test_skipping_the_matmuls_keeps_the_same_bytes_on_the_bundled_models(model, monkeypatch):
    import contextlib

    from hfpipe.plan import activations as plan_activations
    from hfpipe.plan.report import load_model_config

    config = load_model_config(model)
    plan_activations._measure_all.cache_clear()
    skipped = layer_bytes_per_token(config, "bf16-mixed")
    plan_activations._measure_all.cache_clear()
    monkeypatch.setattr(plan_activations, "_SkipMatmuls", contextlib.nullcontext)
    assert layer_bytes_per_token(config, "bf16-mixed") == skipped
    plan_activations._measure_all.cache_clear()


def test_one_ranks_ep_dispatch_computes_what_the_experts_do_and_runs_hfpipes_experts_under_lora():
    # hfpipe.plan.dispatch: the plan measures an --ep layer through transformers' all-to-all dispatch with the
    # exchanges of one rank; it must be the same computation, or its bytes are not the run's
    from transformers import AutoModelForCausalLM

    from hfpipe.lora.adapters import lora_config, resolve_config
    from hfpipe.lora.experts import attach_expert_adapters
    from hfpipe.models.experts import IMPLEMENTATION
    from hfpipe.plan.dispatch import dispatch_experts

    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # grouped_mm has no fp64
    ids = torch.randint(0, config.vocab_size, (2, 16))
    expected = model(ids).logits
    assert dispatch_experts(model) == config.num_hidden_layers
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)  # rows summed in another order
    lora = resolve_config(lora_config(4, targets="all-linear"), model)
    assert lora.target_parameters  # the experts' stacks are adapted
    from peft.tuners.lora import LoraModel

    LoraModel(model, lora, "default")
    assert attach_expert_adapters([model]) > 0 and config._experts_implementation == IMPLEMENTATION
    got = model(ids).logits  # hfpipe's experts forward, one expert's weight at a time
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # PEFT's B starts at zero
    got.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n and "experts" in n)
