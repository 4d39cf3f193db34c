"""A block-FP8 base multiplied in float8 (``--fp8-recipe blockwise`` with ``--quantize-base fp8``).

The kernel's oracle is fp64 arithmetic on the same codes: the activations' 1 x block codes and scales
times the weight's codes and tile scales, dequantized exactly, in fp64; forward and the input's gradient
agree to fp32's summation noise. The forward's oracle is PEFT in one process on the same model whose
decoder-layer linears are the same FP8 linears multiplying in float8 (fp64 elsewhere): logits to 1e-12.
Training is layout-free: pp 2 trains as pp 1 to 1e-12 (fp64), every step (why not against PEFT:
:func:`assert_layouts_agree`), also a MoE model's routed experts, whose adapters are added to the float8
product (PEFT's fold, to 1e-12 with the product dequantized). Against the same run dequantizing its base, the losses differ (the matmuls
ran in float8) by under 2%; a checkpoint resumes with and without the recipe, and the export is the
dequantizing run's. ``pytest -m slow``: every schedule at pp 2 and 3, dp 2 x pp 2, tp 2, a checkpoint's
own FP8 weights, activation checkpointing, compiled.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import folder_tensors, tiny_checkpoint
from test_lora_equivalence import LORA, lora_config
from test_quant_lora_base import FP8_BLOCK, fp8_checkpoint, quantized_hf_model
from test_train_equivalence import ALL_SCHEDULES

TILES = {"quantize_base": "fp8", "quantize_block_size": FP8_BLOCK, "fp8": "blockwise"}
FP64 = {**TILES, "dtype": "fp64"}


def _dequantized_product(codes, scale, w_codes, w_scale, block: int) -> torch.Tensor:
    """``codes`` (rows, k) with 1 x block scales times the block x block weight ``w_codes`` (n, k).T, in fp64."""
    from hfpipe.quant.fp8 import dequantize_blocks

    k = codes.shape[1]
    rows = codes.double() * scale.double().repeat_interleave(block, 1)[:, :k]
    return rows @ dequantize_blocks(w_codes, w_scale, block, torch.float64).T


@pytest.mark.parametrize("k, n", [(64, 96), (80, 48)])  # whole tiles; a partial last tile both ways (80 = 32+32+16)
def test_forward_and_input_gradient_are_the_codes_products_in_fp32(k, n):
    from hfpipe.quant.fp8 import dequantize_blocks, quantize_blocks
    from hfpipe.quant.fp8_matmul import float8_tile_linear, quantize_row_tiles

    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, s = quantize_blocks(w, FP8_BLOCK)
    x = (torch.randn(2, 5, k, generator=g) * torch.logspace(-3, 2, k)).requires_grad_()  # tiles of unlike ranges
    y = float8_tile_linear(x, q, s, FP8_BLOCK, bias)
    codes, scale = quantize_row_tiles(x.detach().reshape(-1, k), FP8_BLOCK)
    want = _dequantized_product(codes, scale, q, s, FP8_BLOCK) + bias.double()
    assert y.shape == (2, 5, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.reshape(-1, n).double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    full = x.detach() @ dequantize_blocks(q, s, FP8_BLOCK).T + bias
    assert not torch.allclose(y, full, rtol=1e-3, atol=0), "the activations were multiplied as float8 codes"

    grad = torch.randn(2, 5, n, generator=g)
    y.backward(grad)
    g_codes, g_scale = quantize_row_tiles(grad.reshape(-1, n), FP8_BLOCK)  # 1 x block tiles along the output dim
    want_grad = _dequantized_product(g_codes, g_scale, q.T, s.T, FP8_BLOCK)  # W.T's tiles are W's, transposed
    torch.testing.assert_close(x.grad.reshape(-1, k).double(), want_grad, rtol=1e-6,
                               atol=1e-6 * want_grad.abs().max().item())


def test_a_tokens_output_does_not_depend_on_the_tokens_batched_with_it():
    """1 x block tiles are per token: a microbatch computes what the whole batch computes, bit for bit."""
    from hfpipe.quant.fp8 import quantize_blocks
    from hfpipe.quant.fp8_matmul import float8_tile_linear

    g = torch.Generator().manual_seed(1)
    q, s = quantize_blocks(torch.randn(64, 96, generator=g), FP8_BLOCK)
    x = torch.randn(8, 96, generator=g) * torch.rand(8, 1, generator=g) * 50
    whole = float8_tile_linear(x, q, s, FP8_BLOCK, None)
    for lo, hi in ((0, 1), (3, 5), (5, 8)):
        assert torch.equal(float8_tile_linear(x[lo:hi].clone(), q, s, FP8_BLOCK, None), whole[lo:hi])


def test_nothing_full_precision_is_saved_for_backward_and_the_weight_stays_codes():
    from hfpipe.quant.fp8 import FP8Linear, quantize_blocks

    linear = FP8Linear(64, 128, FP8_BLOCK)
    linear.weight, linear.weight_scale_inv = quantize_blocks(torch.randn(128, 64), FP8_BLOCK)
    linear.float8 = True
    x = torch.randn(16, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(x).sum().backward()
    assert [t.dtype for t in saved] == [torch.float8_e4m3fn, torch.float32], "the codes and their tile scales"
    assert saved[0].data_ptr() == linear.weight.data_ptr() and x.grad is not None


def test_logits_are_peft_on_the_same_float8_linears():
    """The forward against the real library: PEFT's LoRA over the same FP8 linears, in one process (fp64)."""
    from peft import get_peft_model

    from hfpipe.api import load_pipeline

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    pm = load_pipeline(path, pp=1, lora=lora_config(LORA), **FP64)
    ref = get_peft_model(quantized_hf_model("fp8", FP8_BLOCK, float8=True)(path, torch.float64), lora_config(LORA))
    theirs = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():  # lora_B starts at zero: random adapters, so that they count
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
            theirs["base_model.model." + name].copy_(p)
    ids = torch.randint(3, pm.vocab_size, (2, 24), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want = ref(**batch, use_cache=False).logits
    torch.testing.assert_close(pm.forward(batch), want, rtol=0, atol=1e-12)
    dequantized = get_peft_model(quantized_hf_model("fp8", FP8_BLOCK)(path, torch.float64), lora_config(LORA))
    dequantized.load_state_dict(ref.state_dict())
    assert (dequantized(**batch, use_cache=False).logits - want).abs().max() > 1e-3, "the oracle ran in float8"


def _runs(layouts, block: int, layers: int, kind: str) -> list[dict]:
    """Each ``(pp, dp, tp, schedules)``'s measurements (fp64, the same tiny model, LoRA over a float8 base)."""
    from _dist import run_ranks
    from test_lora_equivalence import merged, pipeline_worker

    path = str(tiny_checkpoint(kind, num_hidden_layers=layers))
    options = {**FP64, "quantize_block_size": block}
    out = []
    for pp, dp, tp, schedules in layouts:
        ranks = run_ranks(pipeline_worker, pp * dp * tp, path, pp, dp, schedules, LORA,
                          {**options, "tp": tp} if tp > 1 else options)
        for schedule in schedules:
            first = next(iter(ranks.values()))[schedule]
            out.append({"layout": (pp, dp, tp, schedule), "loss": first["loss"], "norm": first["norm"],
                        "final": merged(ranks, schedule, "final")})
    return out


def assert_layouts_agree(layouts, block: int = FP8_BLOCK, layers: int = 4, kind: str = "llama") -> None:
    """Every layout trains as the first: the float8 tiles are per token and per weight tile, so neither a
    pipeline split, a schedule, a microbatch nor a tp split on tile edges changes a code (fp64, 1e-12).

    (Against PEFT over many steps the agreement is not exact: transformers takes the loss of a whole batch in
    fp32, whose rounding of each token's gradient differs from a microbatch's by ~1e-7, and an e4m3 rounding
    of a gradient tile can flip with it: 1e-4 of the loss by the second step at pp 1. The forward is PEFT's to
    1e-12 and each matmul the fp64 product of its codes: the tests above.)"""
    runs = _runs(layouts, block, layers, kind)
    ref = runs[0]
    assert max(abs(a - b) for a, b in zip(ref["loss"], ref["loss"][1:])) > 1e-3, "the adapters learn"
    for run in runs[1:]:
        for what in ("loss", "norm"):
            torch.testing.assert_close(torch.tensor(run[what]), torch.tensor(ref[what]), rtol=0, atol=1e-12,
                                       msg=lambda m: f"{run['layout']} {what}: {m}")
        assert sorted(run["final"]) == sorted(ref["final"])
        for name, t in run["final"].items():
            torch.testing.assert_close(t, ref["final"][name], rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_pp2_trains_as_pp1():
    assert_layouts_agree([(1, 1, 1, ("1f1b",)), (2, 1, 1, ("1f1b",))])


def test_routed_experts_multiply_their_codes_with_their_adapters_and_train_as_pp1_at_pp2():
    """A MoE layer's FP8 experts (with LoRA on them: all-linear takes the routed experts) multiply in float8."""
    from hfpipe.api import load_pipeline
    from hfpipe.models.experts import peek_state

    path = str(tiny_checkpoint("qwen3_moe", num_hidden_layers=2))
    base = {**TILES, "quantize_block_size": 16, "dtype": "bf16", "lora": lora_config(LORA)}
    pm = load_pipeline(path, pp=1, **base)
    states = [st for m in pm.modules for sub in m.modules() if (st := peek_state(sub)) is not None]
    assert len(states) == 2 and all(st.multiply is not None and st.adapters for st in states)
    got, want = _train(pm)[0], _train(load_pipeline(path, pp=1, **{**base, "fp8": None}))[0]
    assert got != want
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.02, atol=0)
    assert_layouts_agree([(1, 1, 1, ("1f1b",)), (2, 1, 1, ("1f1b",))], block=16, layers=2, kind="qwen3_moe")


def test_an_experts_adapter_added_to_its_product_is_peft_s_fold():
    """W + s * lhs @ rhs folded (PEFT's parametrization, hfpipe's dequantizing path) equals the base's product
    plus x @ rhs.T @ lhs.T: checked with the product dequantized, in fp64, so only the adapter's form differs."""
    from hfpipe.api import load_pipeline
    from hfpipe.models.experts import peek_state
    from hfpipe.quant.fp8 import dequantize_blocks

    pm = load_pipeline(str(tiny_checkpoint("qwen3_moe", num_hidden_layers=1)), pp=1, lora=lora_config(LORA),
                       **{**FP64, "quantize_block_size": 16})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in pm.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    (experts,) = [sub for m in pm.modules for sub in m.modules() if peek_state(sub) is not None]
    state = peek_state(experts)
    x = torch.randn(16, experts.gate_up_proj.shape[2], generator=g, dtype=torch.float64)
    top = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(16)])
    weights = torch.rand(16, 2, generator=g, dtype=torch.float64)
    state.multiply = lambda x, codes, scales, block: x @ dequantize_blocks(codes, scales, block, x.dtype).T
    added = experts(x, top, weights)
    state.multiply = None  # the fold
    torch.testing.assert_close(added, experts(x, top, weights), rtol=1e-12, atol=1e-12)


STEPS = 4


def _train(pm, optimizer=None, start: int = 0):
    ids = torch.randint(3, pm.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    opt = optimizer or torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=5e-3)
    trainer = pm.trainer(opt)
    return [trainer.step(batch).loss for _ in range(start, STEPS)], opt


def test_within_2_percent_of_the_dequantizing_run_resumes_either_way_and_exports_the_same_folder(tmp_path):
    from hfpipe.api import load_pipeline
    from hfpipe.quant.fp8 import FP8Linear

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    base = {**TILES, "dtype": "bf16-mixed", "lora": lora_config(LORA)}
    plain = load_pipeline(path, pp=1, **{**base, "fp8": None})
    want, _ = _train(plain)
    assert want[-1] < want[0] - 0.05, "the comparison is made while the adapters learn"
    pm = load_pipeline(path, pp=1, **base)
    linears = [m for m in pm.modules[0].modules() if isinstance(m, FP8Linear)]
    assert len(linears) == 2 * 7 and all(m.float8 for m in linears)
    first, opt = _train(pm)
    assert first != want, "the base multiplied in float8, not dequantized"
    torch.testing.assert_close(torch.tensor(first), torch.tensor(want), rtol=0.02, atol=0)

    pm.save_checkpoint(tmp_path / "ckpt", STEPS, opt)
    straight = _train(pm, opt, start=STEPS - 2)[0]
    pm.save_pretrained(tmp_path / "hf")
    for fp8 in ("blockwise", None):
        again = load_pipeline(path, pp=1, **{**base, "fp8": fp8})
        opt2 = torch.optim.AdamW([p for _, p in again.named_parameters()], lr=5e-3)
        assert again.load_checkpoint(tmp_path / "ckpt", optimizer=opt2).step == STEPS
        resumed = _train(again, opt2, start=STEPS - 2)[0]
        tol = 1e-6 if fp8 else 0.02  # the same run continued; the same adapters over the dequantized base
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=tol, atol=0)
    plain.save_pretrained(tmp_path / "plain")
    ours, theirs = folder_tensors(tmp_path / "hf"), folder_tensors(tmp_path / "plain")
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}


def test_a_linear_whose_dims_do_not_divide_by_16_dequantizes():
    from hfpipe.quant.fp8_matmul import fits_float8_tiles

    assert fits_float8_tiles(64, 128, 32) and fits_float8_tiles(80, 48, 32)
    assert not fits_float8_tiles(72, 128, 32) and not fits_float8_tiles(64, 128, 24)


@pytest.mark.slow
def test_every_schedule_at_pp2_and_pp3_trains_as_pp1():
    assert_layouts_agree([(1, 1, 1, ("1f1b",)), (2, 1, 1, ALL_SCHEDULES), (3, 1, 1, ALL_SCHEDULES)], layers=6)


@pytest.mark.slow
def test_dp2_x_pp2_trains_as_dp2():
    assert_layouts_agree([(1, 2, 1, ("1f1b",)), (2, 2, 1, ("1f1b", "interleaved-1f1b"))])


@pytest.mark.slow
def test_tp2_splits_the_codes_on_their_tiles_and_trains_as_tp1():
    assert_layouts_agree([(1, 1, 1, ("1f1b",)), (1, 1, 2, ("1f1b",)), (2, 1, 2, ("1f1b",))], block=16)


@pytest.mark.slow
def test_a_checkpoints_own_fp8_weights_within_2_percent_of_dequantizing_them():
    from hfpipe.api import load_pipeline

    path = fp8_checkpoint(2)
    base = {"quantize_base": "fp8", "dtype": "bf16-mixed", "lora": lora_config(LORA)}
    want = _train(load_pipeline(path, pp=1, **base))[0]
    got = _train(load_pipeline(path, pp=1, **base, fp8="blockwise"))[0]
    assert got != want
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.02, atol=0)


@pytest.mark.slow
def test_checkpointed_and_compiled_train_as_eager():
    """A recomputed forward casts the same tiles; a compiled layer runs the same tile products."""
    from hfpipe.api import load_pipeline

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    base = {**FP64, "lora": lora_config(LORA)}
    eager = _train(load_pipeline(path, pp=1, **base))[0]
    for options in ({"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"},
                    {"compile": True, "compile_backend": "aot_eager", "activation_checkpointing": "full"}):
        got = _train(load_pipeline(path, pp=1, **base, **options))[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(eager), rtol=1e-9, atol=0, msg=str(options))


def test_quantized_hf_model_is_the_oracles_build():  # the oracle really multiplies in float8
    model = quantized_hf_model("fp8", FP8_BLOCK, float8=True)(str(tiny_checkpoint("llama", num_hidden_layers=1)),
                                                              torch.float64)
    fp8 = [m for m in model.modules() if type(m).__name__ == "FP8Linear"]
    assert fp8 and all(m.float8 for m in fp8) and not any(isinstance(m, nn.Linear) and type(m) is nn.Linear
                                                           for m in model.model.layers.modules())


@pytest.mark.parametrize("m, k, n", [(64, 512, 256), (37, 384, 640), (8, 128, 128)])  # k tiles padded to 4 or not
def test_torchs_one_gemm_kernel_takes_the_layouts_given_it_forward_and_backward(m, k, n):
    """torch's blockwise kernel (SM90 only) cannot run here; its meta kernel checks shapes and strides."""
    from hfpipe.quant.fp8_matmul import _scaled_blockwise, cublas_blockwise

    meta = dict(device="meta")
    a, a_scale = torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta), torch.empty(m, k // 128, **meta)
    w, w_scale = torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta), torch.empty(n // 128, k // 128, **meta)
    assert _scaled_blockwise(a, a_scale, w, w_scale, torch.bfloat16).shape == (m, n)
    g, g_scale = torch.empty(m, n, dtype=torch.float8_e4m3fn, **meta), torch.empty(m, n // 128, **meta)
    assert _scaled_blockwise(g, g_scale, w.t().contiguous(), w_scale.t(), torch.float32).shape == (m, k)
    assert cublas_blockwise(torch.device("cpu")) is False, "a CPU multiplies tile by tile"


def test_a_compiled_layer_keeps_torchs_kernel_as_one_opaque_op():
    """What inductor sees of it: one custom op (its scales' strides stay the eager ones), shaped by its fake."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hfpipe.quant.fp8_matmul import _cublas_matmul

    a, a_scale = torch.zeros(8, 256).to(torch.float8_e4m3fn), torch.ones(8, 2)
    w, w_scale = torch.zeros(128, 256).to(torch.float8_e4m3fn), torch.ones(1, 2)
    graph = make_fx(lambda *t: _cublas_matmul(*t, torch.bfloat16), tracing_mode="fake")(a, a_scale, w, w_scale)
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.hfpipe.blockwise_scaled_mm.default]



@pytest.mark.parametrize("device, cublas, warned", [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)])
def test_the_tile_loop_on_a_gpu_is_said_to_be_slow(caplog, monkeypatch, device, cublas, warned):
    from transformers import AutoConfig

    from hfpipe.models.meta import build_meta_model, model_config
    from hfpipe.quant import linear
    from hfpipe.quant.fp8 import FP8Linear

    monkeypatch.setattr(linear, "cublas_blockwise", lambda _device: cublas)  # (no GPU here to ask)
    config = AutoConfig.from_pretrained(tiny_checkpoint("llama", num_hidden_layers=1))
    model = build_meta_model(model_config(config))
    with caplog.at_level("INFO", logger="hfpipe.quant.linear"):
        linear.apply_quant([model], config, linear.QuantSpec("fp8", FP8_BLOCK), torch.float32, float8=True,
                           device=torch.device(device))
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.float8 and m.cublas == cublas for m in fp8)
    assert any("likely slower than the dequantizing base" in r.getMessage() for r in caplog.records) == warned
