"""MoE router aux loss (``output_router_logits``) pipelined equals transformers' (hfpipe.pipeline.router_loss).

The oracle is transformers' own ``*ForCausalLM`` with ``output_router_logits=True``: its ``loss``
(token loss + ``router_aux_loss_coef * aux_loss``) and ``aux_loss``. The pipeline computes the
aux loss per microbatch, so the oracle runs transformers microbatch by microbatch on the same rows
(``num_items_in_batch`` = the step's token count) and counts each microbatch's aux loss 1/(all
microbatches of the step); with one microbatch that is ``model(**batch).loss`` itself. Logits,
step-1 gradients, and losses, grad norms and weights over 3 AdamW steps must agree within 1e-5.
Batches hold left and right padding (excluded from the aux loss as transformers excludes it) and
prompt masking. DeepSeek-V2's causal LM returns router logits but adds no aux loss: its row checks
that the pipeline adds none either.

The default suite runs one case; ``pytest -m slow`` runs every family at pp 2 and 3 under 1F1B,
interleaved 1F1B and ZBV, plus dp 2, gradient accumulation and activation checkpointing.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_model_table import _optimizer
from test_train_equivalence import HP

TOL = 1e-5
STEPS = 3
LAYERS = 6
ROWS, SEQ = 2, 12  # rows per microbatch
COEF = 0.5  # large, so that the aux term moves routers and weights far beyond the tolerance
KINDS = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v2")
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")


def _checkpoint(kind: str) -> str:
    return str(tiny_checkpoint(kind, num_hidden_layers=LAYERS, output_router_logits=True, router_aux_loss_coef=COEF))


def _batches(vocab: int, rows: int, steps: int = STEPS) -> list[dict]:
    """Padded (left and right) and prompt-masked rows; every step a different sequence length."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        seq = SEQ - 2 * step
        ids = torch.randint(3, vocab, (rows, seq), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        for r in range(rows):
            pad = int(torch.randint(0, seq // 2, (1,), generator=g))
            if pad and r % 3 == 1:
                mask[r, :pad] = 0
                labels[r, :pad] = -100
            elif pad:
                mask[r, -pad:] = 0
                labels[r, -pad:] = -100
            labels[r, pad: pad + 2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def reference(path: str, microbatches: int, steps: int = STEPS, rows: int | None = None) -> dict:
    """transformers, microbatch by microbatch: HF's loss, the aux term counted once per step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    coef = getattr(model, "router_aux_loss_coef", 0.0)
    opt, sched = _optimizer(list(model.named_parameters()), lr_total_steps=steps)
    losses, norms, grads = [], [], None
    for batch in _batches(model.config.vocab_size, rows or ROWS * microbatches, steps):
        loss = 0.0
        for mb in _split(batch, microbatches):
            out = model(**mb, use_cache=False, num_items_in_batch=_tokens(batch))
            aux = out.aux_loss if out.aux_loss is not None else 0.0  # DeepSeek-V2 adds none
            loss = loss + out.loss + coef * aux * (1 / microbatches - 1)  # HF adds coef * aux per call
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), HP["max_grad_norm"])))
        losses.append(float(loss.detach()))
        opt.step()
        sched.step()
        opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = max((weights[k] - start[k]).abs().max().item() for k in weights)
    return {"loss": losses, "norm": norms, "grads": grads, "weights": weights, "moved": moved}


def _split(batch: dict, n: int) -> list[dict]:
    rows = batch["input_ids"].shape[0] // n
    return [{k: v[i * rows:(i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def worker(path: str, pp: int, dp: int, schedule: str, microbatches: int, accum: int = 1,
           options: dict | None = None) -> dict:
    """Logits, step-1 gradients, then ``STEPS`` trainer steps; this rank's view of each."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(pp, dp)
    pm = load_pipeline(path, pp=pp, dp=dp, schedule=schedule, microbatches=microbatches // (dp * accum),
                       dist=dist, **(options or {}))
    vocab = pm.source.config.vocab_size
    rows = ROWS * microbatches
    batches = _batches(vocab, rows)
    logits = pm.forward({k: v for k, v in batches[0].items() if k != "labels"})
    shard = rows // dp
    mine = [{k: v[dist.dp_rank * shard:(dist.dp_rank + 1) * shard] for k, v in b.items()} for b in batches]
    grads = {}
    if accum == 1:  # one batch: the trainer's first step without the optimizer
        pm.pipe.train_step(mine[0], _tokens(batches[0]) / dp)
        grads = {n: _full(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
    for _, p in pm.named_parameters():
        p.grad = None
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for b in mine:
        out = trainer.step(_split(b, accum))
        losses.append(out.loss)
        norms.append(out.grad_norm)
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    return {"logits": logits, "grads": grads, "loss": losses, "norm": norms, "weights": weights}


def _close(got, want, what: str) -> None:
    diff = (torch.as_tensor(got) - torch.as_tensor(want)).abs().max().item()
    assert diff <= TOL, f"{what} differs from transformers by {diff:.3g}"


def check(kind: str, pp: int, schedule: str, microbatches: int, dp: int = 1, accum: int = 1,
          options: dict | None = None) -> None:
    from transformers import AutoModelForCausalLM

    path = _checkpoint(kind)
    ref = reference(path, microbatches)
    assert ref["moved"] > 100 * TOL, "training did not move the weights: agreement would be trivial"
    ranks = run_ranks(worker, pp * dp, path, pp, dp, schedule, microbatches, accum, options)
    case = f"{kind} pp{pp} dp{dp} {schedule} x{microbatches}"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        batch = _batches(model.config.vocab_size, ROWS * microbatches)[0]
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    got = [r["logits"] for r in ranks.values() if r["logits"] is not None]
    assert len(got) == dp, f"{case}: logits on {len(got)} ranks"
    _close(got[0], want, f"{case} logits")
    seen = set()
    for r in ranks.values():
        _close(r["loss"], ref["loss"], f"{case} loss")
        _close(r["norm"], ref["norm"], f"{case} grad norm")
        for name, g in r["grads"].items():
            _close(g, ref["grads"][name], f"{case} step-1 gradient of {name}")
            seen.add(name)
        for name, w in r["weights"].items():
            _close(w, ref["weights"][name], f"{case} weight {name} after {STEPS} steps")
    if accum == 1:
        assert seen == set(ref["grads"]), f"{case}: gradients not compared: {set(ref['grads']) ^ seen}"


def test_one_microbatch_is_transformers_own_loss_on_the_whole_batch():
    """The anchor: with one microbatch the oracle above is ``model(**batch).loss`` itself."""
    from transformers import AutoModelForCausalLM

    from test_train_equivalence import train_reference

    path = _checkpoint("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    opt, sched = _optimizer(list(model.named_parameters()), lr_total_steps=STEPS)
    plain = train_reference(model, _batches(model.config.vocab_size, 4), opt, sched)
    ours = reference(path, 1, rows=4)
    _close(ours["loss"], plain["loss"], "one-microbatch oracle loss")
    for name, w in plain["weights"].items():
        _close(ours["weights"][name], w, f"one-microbatch oracle weight {name}")


def test_router_aux_loss_matches_transformers_pp2_1f1b():
    check("qwen3_moe", 2, "1f1b", 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_router_aux_loss_matrix(kind, pp, schedule):
    check(kind, pp, schedule, 6)


@pytest.mark.slow
def test_router_aux_loss_one_microbatch_gpipe():
    check("mixtral", 2, "gpipe", 1)


@pytest.mark.slow
def test_router_aux_loss_dp2_accumulation_and_checkpointing():
    check("mixtral", 2, "1f1b", 4, dp=2, options={"activation_checkpointing": "full"})
    check("gpt_oss", 2, "1f1b", 4, accum=2, options={"activation_checkpointing": "selective"})


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "looped-bfs", "interleaved-zb", "dualpipev"])
def test_router_aux_loss_other_schedules(schedule):
    check("qwen2_moe", 2, schedule, 4, options={"loss_chunk_tokens": 3})  # and the chunked head loss


def _sums_dtype_worker(path: str) -> list:
    from hfpipe.api import load_pipeline
    from hfpipe.pipeline.router_loss import RouterSums

    seen, start = [], RouterSums.start

    def spy(self, sums, device):
        seen.append(None if sums is None else str(sums.dtype))
        return start(self, sums, device)

    RouterSums.start = spy
    pm = load_pipeline(path, pp=2, schedule="1f1b", microbatches=2, dtype="bf16-mixed")
    batch = _batches(pm.source.config.vocab_size, 4)[0]
    pm.pipe.train_step(batch, _tokens(batch))
    return seen


@pytest.mark.slow
def test_bf16_mixed_keeps_the_router_sums_in_fp32():
    """FSDP2's mixed precision casts a module's float inputs: the stage must receive fp32 sums."""
    ranks = run_ranks(_sums_dtype_worker, 2, _checkpoint("mixtral"))
    first, second = ranks[0], ranks[1]  # (torch's shape inference runs one more forward)
    assert first and set(first) == {None} and second and set(second) == {"torch.float32"}, ranks
