"""Empty stages are legal wherever a layout allows them, and change nothing.

A layout such as ``E||t*8|L`` leaves a stage with no layer at all; under one stage per rank a whole
rank then holds no parameter. Such pipelines must evaluate (logits, eval loss), train with the
user's own ``torch.optim.AdamW(pm.parameters())`` and export exactly like transformers in one
process, under loop and V schedules, with gradient clipping off or engaged (a rank without
gradients takes part in the global norm and has nothing to scale), tied and untied.
"""

from __future__ import annotations

import pytest
import torch

from _dist import AdamDrift, assert_weights_close, run_ranks, tiny_checkpoint

LAYERS = 4
STEPS = 3
TOL = 1e-5
LR = 3e-4  # Adam turns rounding-level gradient differences into lr-sized steps: keep it moderate


def _batches(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        ids = torch.randint(3, vocab, (4, 12 - 2 * step), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


CLIP = 1e-3  # below the tiny model's gradient norm (~5e-3): clipping engages at every step


def _reference(path: str, clip: float | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    batches = _batches(model.config.vocab_size)
    with torch.no_grad():
        model.eval()
        first = model(**batches[0], use_cache=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    drift = AdamDrift(model.named_parameters(remove_duplicate=False), model.config.vocab_size)
    losses = []
    for b in batches:
        loss = model(**b, use_cache=False).loss
        loss.backward()
        losses.append(float(loss.detach()))
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > 2 * clip  # the case under test: clipping scales the gradients down
        opt.step()
        drift.step(opt)
        opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert max((weights[k] - start[k]).abs().max().item() for k in weights) > 50 * TOL  # training moved them
    return {"logits": first.logits, "eval": float(first.loss), "loss": losses, "weights": weights, "drift": drift.drift}


def _worker(path: str, pp: int, cases: list, out_root: str, clip: float | None = None) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(pp)
    results = {}
    for schedule, layout in cases:
        pm = load_pipeline(path, pp=pp, schedule=schedule, layout=layout, microbatches=4, dist=dist)
        batches = _batches(pm.source.config.vocab_size)
        optimizer = torch.optim.AdamW(pm.parameters(), lr=LR, foreach=True)  # the README's own optimizer
        trainer = pm.trainer(optimizer, max_grad_norm=clip)
        logits = pm.forward(batches[0])
        eval_loss = trainer.eval_loss(batches[0])
        losses = [trainer.step(b).loss for b in batches]
        out = f"{out_root}/{schedule}-{pp}"
        pm.save_pretrained(out)
        results[(schedule, layout)] = {"logits": logits, "eval": eval_loss, "loss": losses, "out": out,
                                       "params": len(pm.named_parameters())}
    return results


def _check(tmp_path, pp: int, cases: list, *, kind: str = "llama_tied", clip: float | None = None) -> None:
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint(kind, num_hidden_layers=LAYERS))
    ref = _reference(path, clip)
    ranks = run_ranks(_worker, pp, path, pp, cases, str(tmp_path), clip)
    for case in cases:
        per_rank = [r[case] for r in ranks.values()]
        logits = [r["logits"] for r in per_rank if r["logits"] is not None]
        assert len(logits) == 1, case
        torch.testing.assert_close(logits[0], ref["logits"], atol=TOL, rtol=0)
        for r in per_rank:
            assert abs(r["eval"] - ref["eval"]) <= TOL, (case, r["eval"], ref["eval"])
            torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(ref["loss"]), atol=TOL, rtol=0)
        exported = AutoModelForCausalLM.from_pretrained(per_rank[0]["out"]).state_dict()
        assert set(exported) == set(ref["weights"])
        assert_weights_close(exported, ref["weights"], ref["drift"], TOL, case)


@pytest.mark.slow
def test_a_rank_without_parameters_trains_evaluates_and_exports(tmp_path):
    """pp=3 ``E||t*4L``: rank 1's only stage is empty (no optimizer parameter at all)."""
    _check(tmp_path, 3, [("1f1b", "E||t*4L")])


@pytest.mark.slow
def test_a_rank_without_parameters_when_clipping_engages(tmp_path):
    """The same, with every step's gradient norm above --max-grad-norm: rank 1 has no gradient
    to scale (it crashed the step here once, and the error then named another rank's loss)."""
    _check(tmp_path, 3, [("1f1b", "E||t*4L")], clip=CLIP)


@pytest.mark.slow
@pytest.mark.parametrize("kind, clip", [("llama", None), ("llama", CLIP)])
def test_a_rank_without_parameters_untied(tmp_path, kind, clip):
    _check(tmp_path, 3, [("1f1b", "E||t*4L")], kind=kind, clip=clip)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_an_empty_stage_under_a_v_schedule_when_clipping_engages(tmp_path, kind):
    _check(tmp_path, 2, [("zbv", "E||t*4|L")], kind=kind, clip=CLIP)


def test_an_empty_stage_under_a_v_schedule(tmp_path):
    """pp=2 ``E||t*4|L``: stage 1 is empty; V schedules evaluate stage by stage on one rank."""
    _check(tmp_path, 2, [("zbv", "E||t*4|L")])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b", "dualpipev", "looped-bfs", "interleaved-zb"])
def test_empty_stages_every_schedule(tmp_path, schedule):
    layout = "E||t*4L" if schedule == "gpipe" else "E||t*4|L"
    _check(tmp_path, 3 if schedule == "gpipe" else 2, [(schedule, layout)])


def test_optimizer_over_no_parameters_is_a_no_op():
    from hfpipe.train.optim import build_optimizer

    opt = build_optimizer([torch.nn.Module()], lr=1e-3)
    opt.step()
    assert opt.param_groups[0]["params"] == [] and opt.param_groups[0]["lr"] == 1e-3
