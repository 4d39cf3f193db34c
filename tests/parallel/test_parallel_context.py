"""Context parallelism (``--cp``) trains exactly as transformers does in one process.

Each microbatch's sequence is split head-tail over cp ranks; attention gathers K and V over them
(:mod:`hfpipe.parallel.context`). The oracle and the comparison are ``tests/train/test_train_equivalence.py``'s:
full-batch AdamW with clipping, logits (gathered over cp) and loss and grad norm per step within 1e-5,
step-1 gradients within reordering noise, every weight after the last step within 1e-5 plus AdamW's
derived drift. Two kinds
of rows: padded and prompt-masked (``make_batches``, a sequence length that changes between steps),
and packed rows whose documents restart ``position_ids`` and straddle the chunk seams, fed without an
attention mask as hfpipe's packing feeds them (transformers then keeps documents apart).
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_train_equivalence import (BATCH, HP, SEQ, TOL, _full, _optimizer, check_equal, first_gradients,
                                    make_batches, train_reference)

STEPS_CP = 3
LAYERS, MICRO = 4, 4  # the default run's two cases stay small: 4 layers, 4 microbatches of 2 rows


def packed_batches(vocab: int, steps: int = STEPS_CP, dp: int = 1) -> list[list[dict]]:
    """Packed rows: documents of random lengths back to back (positions restart at each), crossing the
    seams of the 2*cp chunks, trailing padding with labels -100; no attention mask."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (BATCH * dp, SEQ), generator=g)
        labels, pos = ids.clone(), torch.zeros_like(ids)
        for row in range(ids.shape[0]):
            t = 0
            while t < SEQ:
                n = int(torch.randint(2, 8, (1,), generator=g))
                pos[row, t:t + n] = torch.arange(min(n, SEQ - t))
                labels[row, t] = -100  # a document's first token predicts nothing from the one before
                t += n
            pad = int(torch.randint(0, 4, (1,), generator=g))
            if pad:
                labels[row, -pad:] = -100
        full = {"input_ids": ids, "labels": labels, "position_ids": pos}
        out.append([{k: v[d * BATCH:(d + 1) * BATCH] for k, v in full.items()} for d in range(dp)])
    return out


def _batches(kind: str, vocab: int, dp: int):
    return packed_batches(vocab, dp=dp) if kind == "packed" else make_batches(vocab, STEPS_CP, dp=dp)


def cp_worker(path: str, pp: int, dp: int, cp: int, schedules: tuple[str, ...], rows: str, options: dict) -> dict:
    """Train with each schedule on a pp x dp x cp mesh; every cp rank is handed the same whole rows."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(ParallelDims(pp=pp, dp=dp, cp=cp, ep=options.get("ep", 1)))
    results = {}
    for schedule in schedules:
        pm = load_pipeline(path, pp=pp, dp=dp, cp=cp, schedule=schedule, microbatches=MICRO, dist=dist, **options)
        opt, sched = _optimizer(pm.named_parameters(), STEPS_CP)
        grads = first_gradients(opt, pm.named_parameters())
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        losses, norms = [], []
        batches = _batches(rows, pm.source.config.vocab_size, dp)
        logits = pm.forward(batches[0][0])  # the whole rows' logits, gathered over cp, on the loss rank
        for shards in batches:
            out = trainer.step(shards[dist.dp_rank])
            losses.append(out.loss)
            norms.append(out.grad_norm)
        weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
        results[schedule] = {"loss": losses, "norm": norms, "grads": grads, "weights": weights,
                             "gathered": pm.pipe.context.received_bytes, "logits": logits}
    return results


def reference(path: str, rows: str, dp: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    every = _batches(rows, model.config.vocab_size, dp)
    with torch.no_grad():
        logits = model(**every[0][0], use_cache=False).logits
    batches = ({k: torch.cat([s[k] for s in shards]) for k in shards[0]} for shards in every)
    return {**train_reference(model, batches, *_optimizer(list(model.named_parameters()), STEPS_CP)), "logits": logits}


def _run(kind: str, pp: int, cp: int, rows: str = "padded", schedules=("1f1b",), dp: int = 1, config=None,
         **options) -> dict:
    path = str(tiny_checkpoint(kind, num_hidden_layers=LAYERS, **(config or {})))
    ref = reference(path, rows, dp)
    results = run_ranks(cp_worker, pp * dp * cp, path, pp, dp, cp, tuple(schedules), rows, options)
    check_equal(ref, results, schedules)
    for s in schedules:
        assert all(r[s]["gathered"] > 0 for r in results.values())  # attention really gathered K/V
        logits = [r[s]["logits"] for r in results.values() if r[s]["logits"] is not None]
        assert len(logits) == cp * dp  # every cp rank of the loss stage holds the whole rows' logits
        for got in logits:
            torch.testing.assert_close(got, ref["logits"], atol=TOL, rtol=0, msg=lambda m: f"{s} logits: {m}")
    return results


def test_cp2_matches_transformers():
    _run("llama", 1, 2)


def test_pp2_x_cp2_with_packed_documents_across_the_seams_matches_transformers():
    """Documents straddle the chunk seams; attention must keep them apart as transformers does."""
    _run("llama", 2, 2, "packed")


@pytest.mark.slow
def test_dp2_x_cp2_matches_transformers():
    _run("llama", 1, 2, "packed", dp=2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_tied", "qwen3", "mistral"])
def test_families_at_pp2_x_cp2(kind):
    """Tied embeddings across stages, GQA and q/k norms (Qwen3), a sliding window (Mistral)."""
    _run(kind, 2, 2, "packed")


@pytest.mark.slow
def test_a_sliding_window_is_kept_under_cp():
    """Mistral with a window of 6 over rows of 16: the mask keeps q - k < 6 across the chunk seams."""
    _run("mistral", 2, 2, "packed", config={"sliding_window": 6})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
def test_moe_with_ep_at_dp2_x_cp2(kind):
    """Routed experts over ep ranks of dp while the sequence is split over cp; DeepSeek-V3's MLA attention
    (per-head K of qk_nope + qk_rope, V of v_head_dim) gathered as it is."""
    _run(kind, 1, 2, "packed", dp=2, ep=2)


@pytest.mark.slow
def test_lora_at_cp2_matches_peft():
    """PEFT's adapters on the stages, base frozen, against PEFT in one process (test_lora_equivalence's oracle)."""
    from _dist import assert_weights_close
    from test_lora_equivalence import LORA, TOL, merged, reference_run

    path = str(tiny_checkpoint("llama", num_hidden_layers=LAYERS))
    ranks = run_ranks(lora_worker, 2, path, 2, LORA)
    ref = reference_run(path, LORA, merged(ranks, "cp", "start"))
    assert ref["moved"] > 100 * TOL
    for r in ranks.values():
        for what in ("loss", "norm"):
            torch.testing.assert_close(torch.tensor(r["cp"][what]), torch.tensor(ref[what]), atol=TOL, rtol=0)
        assert r["cp"]["gathered"] > 0
    assert_weights_close(merged(ranks, "cp", "final"), ref["final"], ref["drift"], TOL, "lora cp2")


def lora_worker(path: str, cp: int, kw: dict) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from test_lora_equivalence import _full as full, lora_config, start_adapters

    dist = init_distributed(ParallelDims(cp=cp))
    pm = load_pipeline(path, pp=1, cp=cp, microbatches=MICRO, dist=dist, lora=lora_config(kw))
    start = start_adapters(pm)
    opt, sched = _optimizer(pm.named_parameters())
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for shards in make_batches(pm.source.config.vocab_size):
        out = trainer.step(shards[0])
        losses.append(out.loss)
        norms.append(out.grad_norm)
    final = {n: full(p) for n, p in pm.named_parameters()}
    return {"cp": {"loss": losses, "norm": norms, "start": start, "final": final,
                   "gathered": pm.pipe.context.received_bytes}}


@pytest.mark.slow
def test_every_schedule_at_pp2_x_cp2():
    _run("llama", 2, 2, "packed", schedules=("gpipe", "interleaved-1f1b", "looped-bfs"))


@pytest.mark.slow
def test_the_zero_bubble_schedules_at_pp2_x_cp2():
    """Their split backward under FSDP2 over cp alone (at dp > 1 they are refused, as without cp)."""
    _run("llama", 2, 2, "packed", schedules=("interleaved-zb", "zbv", "dualpipev"))


@pytest.mark.slow
def test_activation_checkpointing_under_cp():
    """A recomputed layer gathers K and V again in backward, under the same context mask."""
    _run("llama", 2, 2, "packed", activation_checkpointing="full")


@pytest.mark.slow
def test_cp4_matches_transformers():
    """Eight chunks of two tokens on packed rows of 16 (the padded rows' 12 would not split into 8)."""
    _run("llama", 1, 4, "packed")


def test_the_split_is_head_tail_and_undone_exactly():
    from hfpipe.parallel.context import chunk_index, split_sequence, unsplit_sequence

    assert chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    t = torch.arange(24).view(1, 24)
    parts = torch.cat([split_sequence(t, 3, r) for r in range(3)], dim=1)
    assert torch.equal(unsplit_sequence(parts, 3), t)


@pytest.mark.parametrize("args, match", [
    (dict(cp=2, tp=2), "--cp 2 with --tp 2: tensor parallelism's sequence-parallel"),
    (dict(cp=2, dp=2, schedule="zbv"), "--schedule zbv with --dp 2: zero-bubble schedules"),
    (dict(cp=2, seq_len=30), "--seq-len 30 does not split into 4 equal chunks"),
])
def test_layouts_cp_cannot_run_are_refused_in_one_line(args, match):
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    schedule = args.pop("schedule", "1f1b")
    seq_len = args.pop("seq_len", None)
    with pytest.raises(ParallelError, match=match) as e:
        check_layout(ParallelDims(pp=2, **args), schedule, seq_len=seq_len)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind, why", [("gemma2", "softcapping"), ("gpt_oss", "attention sinks")])
def test_families_whose_attention_cp_cannot_express_are_refused(kind, why):
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout
    from hfpipe.tiny import tiny_config

    with pytest.raises(ParallelError, match=f"--cp 2: {kind} has .*{why}"):
        check_layout(ParallelDims(pp=1, cp=2), model_config=tiny_config(kind))


def test_documents_start_where_transformers_starts_them():
    """Packed rows (no attention mask): a document starts where positions do not go up by one; with a mask,
    only its padding is kept out."""
    from transformers.masking_utils import find_packed_sequence_indices

    from hfpipe.parallel.context import document_ids

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2]])
    keys = document_ids(pos, None, tuple(pos.shape))
    assert torch.equal(keys[:, 0], find_packed_sequence_indices(pos))
    assert bool(keys[:, 1].all())
    mask = torch.tensor([[1] * 9 + [0] * 3, [1] * 12])
    keys = document_ids(pos, mask, tuple(pos.shape))
    assert not keys[:, 0].any() and torch.equal(keys[:, 1], mask)
