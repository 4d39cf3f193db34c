"""``--dtype fp64``: a run trains, saves, resumes and exports in float64 end to end.

fp64 is for checking numerics (summation order's noise near 1e-16; the loss itself, as transformers' does,
is taken in fp32). The weights, gradients, optimizer state and checkpoints are fp64; the gradient norm is
summed in fp64, as ``clip_grad_norm_`` sums fp64 gradients. The export keeps the source checkpoint's dtype
(``auto``, as for every run: a drop-in for the model the run started from); ``export --dtype fp64`` keeps the
trained fp64 weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _dist import folder_tensors, run_ranks, tiny_checkpoint
from test_train_equivalence import _optimizer, check_equal, make_batches, pipeline_worker, train_reference
from test_train_faults import assert_same_state, dcp_state

RUN = dict(pp=2, batch_size=2, seq_len=32, max_steps=2, save_every=1, lr=1e-3, warmup_steps=0, threads_per_rank=1,
           dtype="fp64")


def test_the_plan_prices_an_fp64_run_at_eight_bytes_a_value():
    from transformers import LlamaConfig

    from hfpipe.plan.report import plan_report

    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    fp32, fp64 = (plan_report(cfg, 2, seq_len=64, batch_size=2, dtype=d).ranks for d in ("fp32", "fp64"))
    for a, b in zip(fp32, fp64):
        assert (b.weight_bytes, b.grad_bytes, b.optimizer_bytes) == (2 * a.weight_bytes, 2 * a.grad_bytes,
                                                                   2 * a.optimizer_bytes)


@pytest.mark.slow
def test_an_fp64_run_saves_resumes_bitwise_and_exports_in_the_dtype_asked(tmp_path):
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.export.hf_folder import export_checkpoint
    from hfpipe.train.runner import run_finetune

    model = tiny_checkpoint("llama", num_hidden_layers=2)
    out = tmp_path / "out"
    first = run_finetune(FinetuneConfig(model=str(model), output_dir=str(out), **RUN))
    assert [r["step"] for r in first["history"]] == [1, 2]
    step1, step2 = (out / "checkpoints" / f"step-0000000{s}" for s in (1, 2))
    state = dcp_state(step2)
    weights = state["model"]
    moments = [v for k, v in state["optim"].items() if k.endswith((".exp_avg", ".exp_avg_sq"))]  # flattened
    assert moments and {v.dtype for v in [*weights.values(), *moments]} == {torch.float64}
    assert json.loads((step2 / "hfpipe.json").read_text())["config"]["dtype"] == "fp64"

    again = tmp_path / "again"  # resumed from step 1: step 2 is the uninterrupted run's, bit for bit
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(step1, again / "checkpoints" / step1.name)
    run_finetune(FinetuneConfig(model=str(model), output_dir=str(again), resume="auto", **RUN))
    resumed = dcp_state(again / "checkpoints" / step2.name)
    assert_same_state(resumed, state)

    source = folder_tensors(model)
    auto = folder_tensors(export_checkpoint(step2, tmp_path / "auto", progress=False))
    assert auto.keys() == source.keys() and all(auto[k].dtype == source[k].dtype == torch.float32 for k in auto)
    assert all(torch.equal(auto[k], weights[k].float()) for k in auto)
    kept = export_checkpoint(step2, tmp_path / "fp64", dtype="fp64", progress=False)
    assert all(torch.equal(v, weights[k]) for k, v in folder_tensors(kept).items())
    assert json.loads((kept / "config.json").read_text())["dtype"] == "float64"


@pytest.mark.slow
def test_an_fp64_pipeline_equals_transformers_in_fp64_to_fp64_rounding():
    """pp2 x 1F1B against transformers in float64 in one process: gradients, grad norms and weights after 5 steps
    within 1e-12 (measured: 2e-17, 4e-16, 1.4e-15), both taking the loss in fp64."""
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("llama", num_hidden_layers=8))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model.loss_function = _fp64_causal_lm_loss  # transformers' own rounds the logits to fp32 (.float())
    ref = train_reference(model, (s[0] for s in make_batches(model.config.vocab_size)),
                          *_optimizer(list(model.named_parameters())))
    ranks = run_ranks(pipeline_worker, 2, path, 2, 1, ("1f1b",), 1, {"dtype": "fp64"})
    check_equal(ref, ranks, ["1f1b"])
    for rank in ranks.values():
        run = rank["1f1b"]
        assert {w.dtype for w in run["weights"].values()} == {torch.float64}
        assert max(abs(a - b) for a, b in zip(run["norm"], ref["norm"])) < 1e-12
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], atol=1e-12, rtol=0)
        for name, weight in run["weights"].items():
            torch.testing.assert_close(weight, ref["weights"][name], atol=1e-12, rtol=0)


def _fp64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **_):
    """transformers' ``ForCausalLMLoss`` without its ``.float()``: an fp64 pipeline takes its loss in fp64."""
    import torch.nn.functional as F

    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(logits.device)
    summed = num_items_in_batch is not None
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index=ignore_index,
                           reduction="sum" if summed else "mean")
    return loss / num_items_in_batch if summed else loss
