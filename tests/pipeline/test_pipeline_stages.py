"""Pipelined stages give exactly the logits of ``AutoModelForCausalLM.from_pretrained``.

For every supported family, pipeline size 1-4, every plan method, and two stages per rank in loop
and V style, real gloo processes load their stages from a sharded checkpoint and run a batch
through a torch pipelining schedule; the last stage's logits must match transformers' within
1e-5 (fp32), on a batch with left and right padding and on a batch of packed sequences.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from hfpipe.tiny import TINY_KINDS

LAYERS = 8  # enough for pp=4 x 2 stages per rank
TOL = 1e-5


def _layout(pp: int) -> str:
    """A deliberately uneven Megatron layout: one layer on each early stage, the rest last."""
    if pp == 1:
        return "E" + "t" * LAYERS + "L"
    return "Et|" + "t|" * (pp - 2) + "t" * (LAYERS - pp + 1) + "L"


def _cases(pp: int):
    """(label, plan_pipeline kwargs, schedule)."""
    yield "even", {"method": "even"}, "1f1b"
    yield "weighted", {"method": "weighted"}, "gpipe"
    yield "balanced", {"method": "balanced"}, "1f1b"
    yield "layout", {"layout": _layout(pp)}, "gpipe"
    yield "loop-vpp2", {"vpp": 2}, "interleaved-1f1b"
    yield "v-vpp2", {"vpp": 2, "style": "v"}, "zbv"


def logit_batches(vocab: int) -> dict[str, dict]:
    """A padded and a packed batch (left and right padding; several documents per row)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, -5:] = 0  # right padding
    docs = [(5, 7, 4), (16,), (3, 3, 10), (8, 8)]  # packed documents per row
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return {"padded": {"input_ids": ids, "attention_mask": mask}, "packed": {"input_ids": ids, "position_ids": pos}}


@torch.no_grad()
def _reference(path, batches) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return {name: model(**b, use_cache=False).logits for name, b in batches.items()}


def _logits_worker(paths: dict[str, str], pp: int) -> dict:
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.pipeline.schedule import Pipeline
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    dist = init_distributed(pp)
    diffs = {}
    for kind, path in paths.items():
        src = ModelSource.open(path)
        batches = logit_batches(src.config.vocab_size)
        ref = None
        for label, kwargs, schedule in _cases(pp):
            plan = plan_pipeline(src.config, pp, **kwargs)
            modules, _ = load_rank_stages(src, plan, dist.pp_rank, dist.device)
            pipe = Pipeline(modules, plan.owners, schedule, 4, dist.pp_group, dist.device)
            for bname, batch in batches.items():
                out = pipe.forward(batch)
                if out is not None:
                    ref = ref or _reference(path, batches)
                    diffs[(kind, label, bname)] = (out - ref[bname]).abs().max().item()
    return diffs


# The default suite runs every family at pp 1 and 2 (pp 3 and 4 run in training, in
# test_train_equivalence's default slice); `pytest -m slow` runs every family at every pp.
@pytest.mark.parametrize(
    "pp, kinds",
    [(1, TINY_KINDS), (2, TINY_KINDS),
     pytest.param(3, TINY_KINDS, marks=pytest.mark.slow), pytest.param(4, TINY_KINDS, marks=pytest.mark.slow)],
)
def test_pipelined_logits_equal_transformers(pp, kinds):
    paths = {kind: str(tiny_checkpoint(kind, num_hidden_layers=LAYERS)) for kind in kinds}
    results = run_ranks(_logits_worker, pp, paths, pp)
    diffs = {k: v for rank_diffs in results.values() for k, v in rank_diffs.items()}
    expected = {(k, label, b) for k in kinds for label, _, _ in _cases(pp) for b in ("padded", "packed")}
    assert set(diffs) == expected  # every case ran, on exactly one loss rank
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, f"logits differ from transformers: {bad}"


def test_packed_documents_do_not_attend_to_each_other():
    """The oracle itself: a packed row equals its documents run one by one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", num_hidden_layers=LAYERS)).eval()
    b = logit_batches(model.config.vocab_size)["packed"]
    with torch.no_grad():
        packed = model(**b, use_cache=False).logits[0]
        first = model(input_ids=b["input_ids"][:1, :5], use_cache=False).logits[0]
        second = model(input_ids=b["input_ids"][:1, 5:12], use_cache=False).logits[0]
    torch.testing.assert_close(packed[:5], first, atol=TOL, rtol=0)
    torch.testing.assert_close(packed[5:12], second, atol=TOL, rtol=0)


def _uneven_worker(path: str):
    from hfpipe.api import load_pipeline

    pm = load_pipeline(path, pp=2, schedule="gpipe", microbatches=2)
    ids = torch.randint(3, pm.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    logits = pm.forward({"input_ids": ids})
    return None if logits is None else (ids, logits)


def test_a_batch_that_does_not_divide_into_the_microbatches_gives_exactly_its_own_rows():
    # torch split 3 rows into microbatches of 2 and 1 and returned 4 rows of logits: silently wrong. hfpipe
    # pads the batch with rows that carry no loss (pipeline/inputs.pad_rows) and hands back its 3 rows.
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("llama"))
    got = [r for r in run_ranks(_uneven_worker, 2, path).values() if r is not None]
    assert len(got) == 1  # the loss rank's
    ids, logits = got[0]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids, use_cache=False).logits
    assert logits.shape == want.shape and logits.shape[0] == 3
    torch.testing.assert_close(logits, want, atol=TOL, rtol=0)
