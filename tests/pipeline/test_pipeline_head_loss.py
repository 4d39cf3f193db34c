"""The last stage's loss in token chunks equals the plain loss and never holds the full logits.

The whole exactness suite also runs with tiny chunks: ``HFPIPE_LOSS_CHUNK_TOKENS=5 pytest
tests/train/test_train_equivalence.py tests/pipeline/test_pipeline_precision.py`` (tiny models never chunk by default).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _dist import run_ranks, tiny_checkpoint
from hfpipe.loss.budget import chunk_tokens
from hfpipe.loss.chunked import chunked_loss_sum
from test_train_equivalence import check_equal, pipeline_worker, reference_run

B, T, H, V = 2, 64, 8, 1000


def _head(seed: int = 0):
    """Norm -> head -> a soft-capping transform, as ``stage.logits`` may be."""
    torch.manual_seed(seed)
    norm, head = torch.nn.LayerNorm(H), torch.nn.Linear(H, V, bias=False)
    return (lambda h: 30.0 * torch.tanh(head(norm(h)) / 30.0)), [*norm.parameters(), head.weight]


def _data():
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    targets[0, :10] = -100  # prompt and padding carry no loss
    targets[1, -7:] = -100
    return hidden, targets


def _grads(loss_fn, hidden, params):
    """The loss and, after one backward, the gradients of ``hidden`` and every parameter."""
    for t in [hidden, *params]:
        t.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in [hidden, *params]]


@pytest.mark.parametrize("chunk", [7, 128, 10_000])
def test_chunked_loss_and_gradients_equal_the_plain_loss(chunk):
    logits_fn, params = _head()
    hidden, targets = _data()
    plain, want = _grads(lambda: F.cross_entropy(logits_fn(hidden).flatten(0, 1), targets.flatten(),
                                                 reduction="sum") / 37.0, hidden, params)
    got_loss, got = _grads(lambda: chunked_loss_sum(logits_fn, hidden, targets, chunk, 37.0), hidden, params)
    torch.testing.assert_close(got_loss, plain, atol=1e-5, rtol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(chunked_loss_sum(logits_fn, hidden, targets, chunk, 37.0), plain,
                                   atol=1e-5, rtol=0)


def test_gradients_accumulate_like_backward():
    """A second microbatch adds to the gradients already there (grad accumulation)."""
    logits_fn, params = _head()
    hidden, targets = _data()
    plain = lambda: F.cross_entropy(logits_fn(hidden).flatten(0, 1), targets.flatten(), reduction="sum") / 9.0
    for t in params:
        t.grad = None
    plain().backward()
    plain().backward()
    want = [p.grad.clone() for p in params]
    for t in params:
        t.grad = None
    chunked_loss_sum(logits_fn, hidden, targets, 16, 9.0).backward()
    chunked_loss_sum(logits_fn, hidden, targets, 16, 9.0).backward()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, atol=1e-5, rtol=0)


def test_a_scaled_loss_scales_the_gradients():
    logits_fn, params = _head()
    hidden, targets = _data()
    _, want = _grads(lambda: 3.0 * F.cross_entropy(logits_fn(hidden).flatten(0, 1), targets.flatten(),
                                                   reduction="sum") / 37.0, hidden, params)
    _, got = _grads(lambda: 3.0 * chunked_loss_sum(logits_fn, hidden, targets, 16, 37.0), hidden, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op makes."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits_is_made():
    logits_fn, params = _head()
    hidden, targets = _data()
    with _Largest() as plain:
        F.cross_entropy(logits_fn(hidden).flatten(0, 1), targets.flatten(), reduction="sum").backward()
    with _Largest() as chunked:
        chunked_loss_sum(logits_fn, hidden, targets, 16, 1.0).backward()
    assert plain.largest == B * T * V
    assert chunked.largest <= 16 * V, "one chunk's logits at most"


def test_chunks_follow_a_logits_budget_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("HFPIPE_LOSS_CHUNK_TOKENS", raising=False)
    assert chunk_tokens(128256) * 128256 * 4 <= 512 * 2**20 < (chunk_tokens(128256) + 1) * 128256 * 4
    assert chunk_tokens(128256, 0) == 0 and chunk_tokens(128256, 300) == 300
    monkeypatch.setenv("HFPIPE_LOSS_CHUNK_TOKENS", "5")
    assert chunk_tokens(128256) == 5 and chunk_tokens(128256, 0) == 0


@pytest.mark.parametrize("chunk", [None, 0, 28])
@pytest.mark.parametrize("split", [False, True])
def test_every_rank_of_a_pipeline_makes_the_same_head_choice(chunk, split, monkeypatch):
    """The head's choice (chunked loss or whole logits) keys the kept schedules, so every rank of the pipeline
    makes it alike, for any batch shape, from what every rank knows: a choice made on the loss rank alone sets
    the stages up for a new length on some ranks and not on others (gloo: "Received data size doesn't match
    expected size"; tests/train/test_train_equivalence.py trains through such lengths)."""
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.pipeline.schedule import Pipeline
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    monkeypatch.delenv("HFPIPE_LOSS_CHUNK_TOKENS", raising=False)  # None: the budget, which a tiny vocab never fills
    src = ModelSource.open(tiny_checkpoint("llama"))
    plan = plan_pipeline(src.config, 3)
    ranks = [load_rank_stages(src, plan, rank, torch.device("cpu"))[0] for rank in range(3)]
    pipes = [Pipeline(modules, plan.owners, "1f1b", 2, None, torch.device("cpu"), loss_chunk_tokens=chunk,
                      vocab_split=split if rank < 2 else None) for rank, modules in enumerate(ranks)]
    pipes[-1].vocab_split = split  # as if its head were split over tp ranks
    choices = {(rows, seq, mode): [p._set_head((rows, seq), mode) for p in pipes]
               for rows in (2, 4) for seq in (10, 14, 16, 28, 64) for mode in ("train", "loss", "logits")}
    assert all(len(set(c)) == 1 for c in choices.values()), choices
    seen = {c[0] for (_, _, mode), c in choices.items() if mode != "logits"}
    assert seen == ({True} if split else {True, False} if chunk else {False})
    last = ranks[-1][-1]  # and the loss rank does what it chose
    assert pipes[-1]._set_head((4, 64), "loss") == last.head_in_loss == (pipes[-1].loss.head is not None)


def chunked_worker(*args) -> dict:
    """:func:`pipeline_worker`, failing unless the loss really ran in chunks."""
    import hfpipe.loss.objective as objective

    calls = []
    plain = objective.chunked_loss_sum

    def counted(*a, **k):
        calls.append(a[3])
        return plain(*a, **k)

    objective.chunked_loss_sum = counted
    out = pipeline_worker(*args)
    out["chunk calls"] = calls
    return out


def _run_chunked(kind: str, pp: int, schedules, dp: int = 1, options: dict | None = None) -> None:
    path = str(tiny_checkpoint(kind, num_hidden_layers=8))
    ref = reference_run(path, dp=dp)
    results = run_ranks(chunked_worker, pp * dp, path, pp, dp, tuple(schedules), 1,
                        {"loss_chunk_tokens": 5, **(options or {})})
    calls = [c for r in results.values() for c in r.pop("chunk calls")]
    assert calls and set(calls) == {5}, "the loss ran in chunks of 5 tokens"
    check_equal(ref, results, schedules)


@pytest.mark.parametrize("schedules", [("1f1b",), pytest.param(("zbv", "gpipe"), marks=pytest.mark.slow)])
def test_pipelined_training_with_a_chunked_loss_matches_transformers(schedules):
    """Tied head: gradient summed across ranks (1F1B) or on one rank (ZBV, split backward)."""
    _run_chunked("llama_tied", 2, schedules)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_chunked_loss_every_schedule(kind):
    from test_train_equivalence import ALL_SCHEDULES

    _run_chunked(kind, 2, ALL_SCHEDULES, options={"activation_checkpointing": "selective"})


def test_plan_counts_the_chunked_head(monkeypatch):
    """Llama-3 8B at 4096 tokens: the head stage keeps hidden and head gradients, not the logits."""
    from transformers import LlamaConfig

    import hfpipe.loss.budget as budget  # the chunk budget the head loss and the plan share
    from hfpipe.plan.report import plan_report

    monkeypatch.delenv("HFPIPE_LOSS_CHUNK_TOKENS", raising=False)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)

    def head_stage():
        return plan_report(cfg, 4, seq_len=4096, batch_size=4, dtype="bf16-mixed").stages[-1]

    chunked = head_stage().activation_bytes_per_microbatch
    monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES", 1 << 62)  # one chunk: the plain head
    plain = head_stage().activation_bytes_per_microbatch
    from hfpipe.plan.activations import head_bytes_per_token

    tokens, v, h = 4096, 128256, 4096
    head = head_bytes_per_token(cfg, "bf16-mixed")  # fp32 log-probs, targets, the norm's and head's inputs
    assert v * 4 < head < v * 4 + 16 * h
    assert plain - chunked == tokens * head - (tokens * h * 2 + v * h * 2 + 8 * tokens)  # chunked: + targets
