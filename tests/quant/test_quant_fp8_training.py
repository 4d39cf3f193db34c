"""Float8 training (``fp8=``, ``--fp8``): the decoder layers' linears multiply in float8, everything a run
keeps (weights, optimizer state, checkpoints, exports) stays in its dtypes and names.

The oracle for float8 is the same run in bf16-mixed: torchao's float8 matmuls round more, so the losses
must stay within 2% of bf16-mixed's while visibly differing from them (the matmuls really ran in float8).
One process at pp 1 here (both recipes, a resume with and without ``fp8`` and an export);
``tests/quant/test_quant_fp8_layouts.py`` runs the layouts (``pytest -m slow``).
"""

from __future__ import annotations

import pytest
import torch

from _dist import folder_tensors, tiny_checkpoint

pytest.importorskip("torchao", reason="--fp8 needs torchao (pip install 'hfpipe[qlora]')")

STEPS, ROWS, SEQ, LR = 4, 4, 32, 5e-3
#: Llama with every decoder-layer dim a multiple of 16 (hidden 64, MLP 128, 4 x 16 heads, 2 kv heads).
SHAPE = dict(num_hidden_layers=2)


def batches(vocab: int, steps: int = STEPS) -> list[dict]:
    """The same ``ROWS x SEQ`` batch every step: the loss falls, so the runs are compared while learning."""
    ids = torch.randint(3, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}] * steps


def train(pm, steps: int = STEPS, optimizer=None, start: int = 0) -> tuple[list[float], object]:
    opt = optimizer or torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=LR)
    trainer = pm.trainer(opt)
    return [trainer.step(b).loss for b in batches(pm.vocab_size, steps)[start:]], opt


def float8_names(pm) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {n for m in pm.modules for n, sub in m.named_modules() if isinstance(sub, Float8Linear)}


@pytest.fixture(scope="module")
def llama() -> str:
    return str(tiny_checkpoint("llama", **SHAPE))


def test_fp8_trains_within_2_percent_of_bf16_mixed_and_keeps_names_and_dtypes(llama, tmp_path):
    from hfpipe.api import load_pipeline

    bf16 = load_pipeline(llama, pp=1, dtype="bf16-mixed")
    want, _ = train(bf16)
    keys = {k: (v.dtype, tuple(v.shape)) for k, v in bf16.model_state_dict().items()}
    assert want[-1] < want[0] - 0.5, "the comparison is made while the model learns"
    for recipe in ("rowwise", "tensorwise"):
        pm = load_pipeline(llama, pp=1, dtype="bf16-mixed", fp8=recipe)
        names = float8_names(pm)
        assert len(names) == 2 * 7, "every decoder-layer linear (q, k, v, o, gate, up, down) of both layers"
        assert not any(n.startswith("lm_head") for n in names), "the head stays in bf16"
        got, opt = train(pm)
        assert got != want, f"{recipe}: the matmuls ran in float8, not bf16"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.02, atol=0)
        state = pm.model_state_dict()
        assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == keys, "names and fp32 masters"
        assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


def test_an_fp8_run_resumes_without_fp8_and_with_it_and_exports_an_ordinary_folder(llama, tmp_path):
    from hfpipe.api import load_pipeline

    pm = load_pipeline(llama, pp=1, dtype="bf16-mixed", fp8="rowwise")
    losses, opt = train(pm, steps=2)
    pm.save_checkpoint(tmp_path / "ckpt", 2, opt)
    straight, _ = train(pm, steps=STEPS, optimizer=opt, start=2)
    for fp8 in ("rowwise", None):
        again = load_pipeline(llama, pp=1, dtype="bf16-mixed", fp8=fp8)
        opt2 = torch.optim.AdamW([p for _, p in again.named_parameters()], lr=LR)
        assert again.load_checkpoint(tmp_path / "ckpt", optimizer=opt2).step == 2
        resumed, _ = train(again, steps=STEPS, optimizer=opt2, start=2)
        if fp8:
            torch.testing.assert_close(resumed, straight, rtol=1e-6, atol=0)  # the same run, continued
        else:  # the same weights, now multiplied in bf16
            torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=0.02, atol=0)
    pm.save_pretrained(tmp_path / "hf")
    exported, source = folder_tensors(tmp_path / "hf"), folder_tensors(llama)
    assert {k: (v.dtype, v.shape) for k, v in exported.items()} == {k: (v.dtype, v.shape) for k, v in source.items()}


@pytest.mark.parametrize("options, words", [
    (dict(dtype="fp32", fp8="rowwise"), "use dtype bf16-mixed (or bf16), not fp32"),
    (dict(dtype="bf16-mixed", fp8="delayed"), "fp8 must be one of rowwise, tensorwise, blockwise; got 'delayed'"),
    (dict(dtype="bf16-mixed", fp8="blockwise"), "fp8 blockwise multiplies a block-FP8 base's own tiles"),
])
def test_fp8_refuses_in_one_line(llama, options, words):
    from hfpipe.api import load_pipeline
    from hfpipe.errors import HfpipeError

    with pytest.raises(HfpipeError) as info:
        load_pipeline(llama, pp=1, **options)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_frozen_float8_base_gives_torchaos_input_gradient_bit_for_bit_and_no_weight_gradient(recipe):
    """LoRA's frozen base skips the weight-gradient GEMM; its output and input gradient are torchao's own."""
    import copy

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from hfpipe.quant.float8_frozen import FrozenAwareFloat8Linear

    torch.manual_seed(0)
    plain, config = torch.nn.Linear(64, 32).to(torch.bfloat16), Float8LinearConfig.from_recipe_name(recipe)
    reference = Float8Linear.from_float(copy.deepcopy(plain), config=config)  # trainable: torchao's backward
    frozen = FrozenAwareFloat8Linear.from_float(copy.deepcopy(plain), config=config)
    frozen.weight.requires_grad_(False)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    results = []
    for linear in (reference, frozen):
        xi = x.clone().requires_grad_()
        out = linear(xi)
        out.float().square().sum().backward()
        results.append((out, xi.grad))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    assert not torch.equal(results[0][0], plain(x)), "the reference multiplied in float8"
    assert reference.weight.grad is not None and frozen.weight.grad is None


@pytest.mark.parametrize("compiled, device, warned", [(False, "cuda", True), (True, "cuda", False),
                                                       (False, "cpu", False)])
def test_fp8_without_compile_on_a_gpu_says_it_is_slower(caplog, compiled, device, warned):
    from hfpipe.quant.float8 import warn_if_uncompiled

    with caplog.at_level("WARNING", logger="hfpipe.quant.float8"):
        warn_if_uncompiled("rowwise", compiled, torch.device(device))
        warn_if_uncompiled(None, False, torch.device(device))  # no --fp8: nothing to say
    assert ["add --compile" in r.getMessage() for r in caplog.records] == ([True] if warned else [])
