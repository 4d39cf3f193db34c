"""hfpipe.hf.PipelineDPOTrainer: the user's own TRL DPO script, pipelined.

The spec (issue 35's bar): one script (``tests/hf/scripts/train_dpo.py``) run in one process with TRL's
``DPOTrainer`` and under ``torchrun`` with ``PipelineDPOTrainer``: at every logging step the loss, the grad norm
and the rewards (chosen, rejected, margins, accuracies) agree within 1e-5, and so do ``save_model()``'s tensors
(fp32, CPU). The logged log-probs and the reference log-probs of every pair (sums over a completion, ~1e2) agree
within 1e-5 plus 2 fp32 ulps of their size: their last bit depends on the order of the sum.
"""

from __future__ import annotations

import json

import pytest
import torch

from _dist import folder_tensors
from test_hf_trainer import ATOL, history, run_pair

pytest.importorskip("trl", reason="PipelineDPOTrainer needs the optional extra trl")

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected")
SUM_ULPS = 2 * 2.0 ** -23  # 2 fp32 ulps, relative: a completion's summed log-prob in another order


def sum_tolerance(value) -> float:
    return ATOL + SUM_ULPS * abs(value)


def dpo_pair(tmp_path, nprocs: int = 2, plain: dict | None = None, **spec):
    """TRL's DPOTrainer in one process and PipelineDPOTrainer under torchrun on the same spec: ``(got, want)``."""
    plain = {**spec, **(plain or {}), "script": "train_dpo.py"}
    spec = {"pp": 2, **spec, "script": "train_dpo.py"}
    for key in ("pp", "dp", "tp", "microbatches"):
        plain.pop(key, None)
    return run_pair(tmp_path, plain, spec, nprocs=nprocs)


def assert_same_dpo(got, want) -> dict:
    """Every logged step's loss, grad norm, rewards and log-probs, the reference log-probs and the saved
    tensors agree with TRL's; returns the largest differences seen."""
    g, w = history(got), history(want)
    assert [h.get("step") for h in g] == [h.get("step") for h in w] and len(w) > 1
    worst: dict = {}
    for hg, hw in zip(g, w):
        for key in ("loss", "grad_norm", "eval_loss", *REWARDS, *(f"eval_{k}" for k in REWARDS)):
            if key in hw:
                diff = abs(hg[key] - hw[key])
                assert diff <= ATOL, f"{key} at step {hw.get('step')}: {hg[key]} vs TRL's {hw[key]}"
                worst[key] = max(worst.get(key, 0.0), diff)
        for key in LOGPS:
            if key in hw:
                assert abs(hg[key] - hw[key]) <= sum_tolerance(hw[key]), f"{key}: {hg[key]} vs {hw[key]}"
        if "num_tokens" in hw:
            assert hg["num_tokens"] == hw["num_tokens"]
    assert any(k in h for h in w for k in REWARDS), "TRL logged no rewards"
    ref_g, ref_w = (json.loads((out / "ref_logps.json").read_text()) for out in (got, want))
    for key in ref_w:
        a, b = torch.tensor(ref_g[key]), torch.tensor(ref_w[key])
        assert a.shape == b.shape and bool(((a - b).abs() <= sum_tolerance(b)).all()), f"{key}: {a} vs TRL's {b}"
        worst[key] = float((a - b).abs().max())
    tg, tw = folder_tensors(got / "final"), folder_tensors(want / "final")
    assert sorted(tg) == sorted(tw), f"exported keys differ: {sorted(set(tg) ^ set(tw))[:5]}"
    for k in tw:
        torch.testing.assert_close(tg[k], tw[k], rtol=0, atol=ATOL, msg=lambda m: f"{k}: {m}")
    worst["weights"] = max(float((tg[k] - tw[k]).abs().max()) for k in tw)
    start = folder_tensors(json.loads((got.parent / "pipeline.json").read_text())["model"])
    moved = max((float((tw[k] - start[k]).abs().max()) for k in tw if k in start), default=None)
    assert moved is None or moved > 10 * ATOL, f"training moved no weight past the tolerance ({moved})"
    print("measured vs TRL: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))
    return worst


def test_the_bar_sigmoid_at_pp2_equals_trl_every_step(tmp_path):
    """3 steps of 4 pairs (2 microbatches of 2 pairs), evaluated at step 2 and at the end; both read the
    reference log-probs before training (precompute_ref_log_probs=True), TRL in one process, hfpipe pipelined."""
    got, want = dpo_pair(tmp_path, loss_type="sigmoid", eval=True)
    assert_same_dpo(got, want)


# ---- refused in one line, before anything loads ---------------------------------------------------------
@pytest.mark.parametrize("change, match", [
    (dict(use_weighting=True), r"^DPOConfig\(use_weighting=True\) does not run under a pipeline"),
    (dict(sync_ref_model=True), r"^DPOConfig\(sync_ref_model=True\) does not run under a pipeline"),
    (dict(loss_type=["aot"]), r"^loss_type='aot' sorts the log-ratios over the whole batch"),
    (dict(loss_type=["nope"]), r"^loss_type='nope' is not one of TRL's"),
])
def test_a_dpo_setting_the_pipeline_cannot_run_is_refused_by_name(tmp_path, change, match):
    from trl import DPOConfig

    from hfpipe.errors import ConfigError
    from hfpipe.hf import PipelineDPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False)
    for key, value in change.items():
        object.__setattr__(args, key, value)  # as set by the user (DPOConfig checks some only at construction)
    with pytest.raises(ConfigError, match=match):
        PipelineDPOTrainer("unused", args=args, pp=2)


@pytest.mark.parametrize("argument, match", [
    (dict(ref_model=torch.nn.Linear(2, 2)), r"^PipelineDPOTrainer\(ref_model=...\): a second resident model"),
    (dict(cp=2), r"^PipelineDPOTrainer\(cp=2\)"),
])
def test_a_second_model_or_cp_is_refused_with_the_fix(tmp_path, argument, match):
    from trl import DPOConfig

    from hfpipe.errors import ConfigError
    from hfpipe.hf import PipelineDPOTrainer

    with pytest.raises(ConfigError, match=match):
        PipelineDPOTrainer("unused", args=DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False), **argument)


# ---- slow: the rest of the matrix ------------------------------------------------------------
@pytest.mark.slow
def test_the_bar_ipo_at_pp2_equals_trl_every_step(tmp_path):
    """IPO normalises by each completion's length (TRL's completion mask): 3 steps, evaluated. TRL's default
    precompute_ref_log_probs=False: TRL reads the reference batch by batch from a frozen copy of the model, the
    pipeline by its pass before training (no second model)."""
    got, want = dpo_pair(tmp_path, loss_type="ipo", beta=0.5, precompute=False, eval=True)
    assert_same_dpo(got, want)


LOSS_TYPES = [("hinge", {}), ("exo_pair", dict(label_smoothing=1e-3)), ("nca_pair", {}),
              ("robust", dict(label_smoothing=0.1)), ("bco_pair", {}), ("sppo_hard", {}), ("apo_zero", {}),
              ("apo_down", {}), ("discopop", {}), ("sft", {}), ("sigmoid_norm", {}),
              (["sigmoid", "sft"], dict(loss_weights=[1.0, 0.5])), ("sigmoid", dict(ld_alpha=0.5)),
              ("sigmoid", dict(f_divergence_type="js_divergence"))]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, extra", LOSS_TYPES, ids=lambda v: str(v))
def test_every_loss_type_at_pp2_equals_trl_after_one_step(tmp_path, loss_type, extra):
    got, want = dpo_pair(tmp_path, loss_type=loss_type, max_steps=1, **extra)
    assert_same_dpo(got, want)


@pytest.mark.slow
def test_dp2_x_pp2_with_accumulation_equals_trl(tmp_path):
    """Each dp replica takes 2 of the 4 pairs, 2 accumulation batches: TRL's per-batch means, averaged. The
    reference pass shares its 15 batches over the replicas (8 and 7: the second runs one more, unused, since
    FSDP2 gathers over both), each batch padded to its own length."""
    got, want = dpo_pair(tmp_path, nprocs=4, plain=dict(batch=4), dp=2, batch=2, ga=2, microbatches=2, pairs=30)
    assert_same_dpo(got, want)


@pytest.mark.slow
def test_pp2_x_tp2_equals_trl(tmp_path):
    """Every tp rank of the last stage takes the vocabulary-parallel log-probs of its slice of the head."""
    got, want = dpo_pair(tmp_path, nprocs=4, tp=2, eval=True)
    assert_same_dpo(got, want)


@pytest.mark.slow
def test_lora_equals_trl_with_peft_whose_reference_is_the_base(tmp_path):
    """TRL reads the reference batch by batch with the adapters off (precompute_ref_log_probs=False); the
    pipeline reads the same numbers once, before training, with its adapters off."""
    got, want = dpo_pair(tmp_path, lora=True, precompute=False, eval=True)
    assert_same_dpo(got, want)
    assert (got / "final" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_chunked_head_takes_the_log_probs_16_tokens_at_a_time(tmp_path, monkeypatch):
    """The last stage never holds a microbatch's whole logits: log-probs read chunk by chunk without gradients,
    then the head's backward run chunk by chunk with TRL's gradient of each token's log-prob."""
    monkeypatch.setenv("HFPIPE_LOSS_CHUNK_TOKENS", "16")
    got, want = dpo_pair(tmp_path, loss_type="sigmoid", eval=True)
    assert_same_dpo(got, want)
