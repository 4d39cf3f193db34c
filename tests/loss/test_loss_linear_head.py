"""The chunked head loss's fast path equals the full logits, and is taken exactly where it can be.

For a plain ``nn.Linear`` head whose logit transforms are constant factors (most families; Granite and
Cohere scale), the loss runs the head's matmuls itself (hfpipe.loss.linear_head). Its loss and the
gradients of the hidden states, the norm and the head equal those of ``cross_entropy`` over the whole
logits; a soft-capped family, a LoRA head and an autocast region keep the generic path.
"""

from __future__ import annotations

import pytest
import torch

from hfpipe.loss.chunked import chunked_loss_sum, head_path
from hfpipe.loss.linear_head import LinearHead, _chunk_loss_and_grad, _fused_loss_and_grad
from hfpipe.loss.tokens import shift_labels, token_loss_sum
from hfpipe.models.registry import adapter_for
from hfpipe.models.spec import StageSpec
from hfpipe.models.stage import build_stage_modules
from hfpipe.tiny import tiny_config
from test_pipeline_head_loss import _Largest  # records the largest tensor any op makes

B, T = 2, 24


def _last_stage(kind: str, dtype=torch.float32, bias: bool = False):
    """The last stage (norm + head, no layers) of a tiny model of ``kind``, with random weights."""
    config = tiny_config(kind, tie_word_embeddings=False)
    (stage,) = build_stage_modules(config, [StageSpec(1, (), embed=False, head=True)], adapter=adapter_for(config))
    if bias:
        stage.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True, device="meta")
    stage.to_empty(device="cpu").to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.5 if p.ndim == 1 else 0.0, 0.3)
    return stage


def _data(stage, dtype):
    torch.manual_seed(1)
    hidden = torch.randn(B, T, stage.config.hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, stage.config.vocab_size, (B, T))
    labels[0, :5] = -100  # a prompt carries no loss
    return hidden, shift_labels(labels)


def _loss_and_grads(stage, hidden, run):
    """``run()``'s loss and, after ``2.5 * loss`` is backpropagated onto gradients already there, every gradient."""
    params = [hidden, *stage.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)  # a second microbatch: the loss's gradients add to these
    loss = run()
    (2.5 * loss).backward()
    return [loss.detach()] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("kind,dtype,bias", [("llama", torch.float32, False), ("llama", torch.float64, True),
                                             ("granite", torch.float32, False), ("cohere", torch.float64, False)])
@pytest.mark.parametrize("chunk", [7, 10_000])
def test_the_fast_path_equals_the_full_logits(kind, dtype, bias, chunk):
    stage = _last_stage(kind, dtype, bias)
    hidden, targets = _data(stage, dtype)
    linear = LinearHead(*stage.head_parts())
    assert head_path(linear, hidden) == "linear"
    want = _loss_and_grads(stage, hidden, lambda: token_loss_sum(stage.logits(hidden), targets) / 29.0)
    got = _loss_and_grads(stage, hidden, lambda: chunked_loss_sum(stage.logits, hidden, targets, chunk, 29.0,
                                                                  linear=linear))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(chunked_loss_sum(stage.logits, hidden, targets, chunk, 29.0, linear=linear),
                                   want[0], atol=1e-5, rtol=0)


def _with_lora_head(stage):
    """PEFT's LoRA adapter on the stage's head (as hfpipe's LoRA puts one there when it targets ``lm_head``)."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"], init_lora_weights=False), stage)
    return stage


def test_a_plain_head_takes_the_fast_path_and_every_other_head_the_generic_one():
    llama = _last_stage("llama")
    hidden, _ = _data(llama, torch.float32)
    assert head_path(LinearHead(*llama.head_parts()), hidden) == "linear"
    assert _last_stage("gemma2").head_parts() is None, "tanh soft-capping is no constant factor"
    lora = _with_lora_head(_last_stage("llama"))
    assert head_path(LinearHead(*lora.head_parts()), hidden) == "generic"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_path(LinearHead(*llama.head_parts()), hidden) == "generic"
    assert head_path(LinearHead(*llama.head_parts()), hidden.double()) == "generic", "dtypes that differ"
    assert head_path(None, hidden) == "generic"


def test_a_lora_head_on_the_generic_path_still_equals_the_full_logits():
    stage = _with_lora_head(_last_stage("llama"))
    hidden, targets = _data(stage, torch.float32)
    linear = LinearHead(*stage.head_parts())
    want = _loss_and_grads(stage, hidden, lambda: token_loss_sum(stage.logits(hidden), targets) / 29.0)
    got = _loss_and_grads(stage, hidden, lambda: chunked_loss_sum(stage.logits, hidden, targets, 7, 29.0,
                                                                  linear=linear))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_the_fast_path_holds_one_chunk_of_logits_at_most():
    stage = _last_stage("llama")
    hidden, targets = _data(stage, torch.float32)
    vocab = stage.config.vocab_size
    with _Largest() as seen:
        chunked_loss_sum(stage.logits, hidden, targets, 8, 1.0, linear=LinearHead(*stage.head_parts())).backward()
    assert seen.largest <= max(8 * vocab, stage.lm_head.weight.numel()), "one chunk's logits, or the head's gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_form_computes_what_the_in_place_form_does(dtype):
    """The form torch.compile fuses on a GPU, run eagerly here, against the in-place form the CPU runs."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(9, 50)).to(dtype)
    targets = torch.randint(0, 50, (9,))
    targets[2] = -100
    weights = (targets != -100).float() / 7.0
    loss, grad = _fused_loss_and_grad(logits, targets, weights, -100)
    want_loss, want_grad = _chunk_loss_and_grad(logits.clone(), targets, weights, -100)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-5 if dtype == torch.float32 else 4e-3, rtol=0)
    assert grad.dtype == dtype and _fused_loss_and_grad(logits, targets, None, -100)[1] is None


@pytest.mark.slow
def test_the_compiled_form_equals_the_in_place_form():
    """torch.compile on the CPU (the GPU's Triton kernels are checked by bench/head_cuda.py against plain)."""
    compiled = torch.compile(_fused_loss_and_grad, dynamic=True)
    torch.manual_seed(0)
    for n in (9, 13):  # one graph for every chunk length
        logits, targets = 3 * torch.randn(n, 50), torch.randint(0, 50, (n,))
        weights = torch.full((n,), 1 / 7.0)
        got, want = compiled(logits, targets, weights, -100), _chunk_loss_and_grad(logits.clone(), targets, weights, -100)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast", [True, False])
def test_the_only_backward_hands_on_the_kept_gradients_and_a_retained_graph_keeps_them(fast):
    """The loss's forward makes the head's gradient; without a retained graph its backward hands that tensor on
    (AccumulateGrad takes it over: the same storage, nothing held twice), with one it keeps it for a second
    backward (zero-bubble schedules), which gives the same gradients again."""
    stage = _last_stage("llama")
    hidden, targets = _data(stage, torch.float32)

    def run():
        linear = LinearHead(*stage.head_parts()) if fast else None
        return chunked_loss_sum(stage.logits, hidden, targets, 7, 11.0, linear=linear)

    loss = run()
    kept = loss.grad_fn.grads  # the autograd node is the Function's context
    where = {g.data_ptr() for g in kept if g is not None and g.shape == stage.lm_head.weight.shape}
    del kept  # (a reference held here would make AccumulateGrad copy)
    loss.backward()
    assert loss.grad_fn.grads is None, "the only backward handed its gradients on"
    # a copy would be made while the kept tensor still lives, so at another address
    assert stage.lm_head.weight.grad.data_ptr() in where, "taken over, not copied"
    once = stage.lm_head.weight.grad.clone()

    stage.zero_grad(set_to_none=True)
    loss = run()
    loss.backward(retain_graph=True)
    assert loss.grad_fn.grads is not None, "kept for a second backward"
    first = stage.lm_head.weight.grad.clone()
    stage.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(first, once) and torch.equal(stage.lm_head.weight.grad, once)
