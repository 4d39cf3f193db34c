"""The model test table: every family hfpipe calls *tested* is exact, pipelined, against transformers.

Each row is a tiny random checkpoint of one ``model_type`` (several safetensors shards, norms and
biases randomised). Real gloo processes load it at pp 2 (even split, 1F1B) and at pp 3 with an
uneven layout (GPipe); the logits of a padded and of a packed batch must equal
``from_pretrained``'s within 1e-5, and a 3-step training run (AdamW, warmup, clipping, padded and
prompt-masked rows) must match transformers' losses, grad norms and final weights.

The default suite runs a slice (two families with pieces on both ends, at the uneven pp);
``pytest -m slow`` runs every row at both pipeline sizes.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from hfpipe.tiny import TABLE_KINDS, TINY_KINDS
from test_pipeline_stages import logit_batches
from test_train_equivalence import HP, check_equal, first_gradients, make_batches, train_reference

LAYERS = 4
TOL = 1e-5
STEPS = 3
TABLE = tuple(k for k in TINY_KINDS if k != "llama_tied") + tuple(TABLE_KINDS)
SLICE = ("gemma3_text", "granite")  # per-type rope + soft-cap; embedding, residual and logit multipliers
UNEVEN = "Et|t|ttL"  # pp 3: one layer, one layer, two layers + head


# Adam divides by sqrt(v) + eps: a gradient that is rounding noise (a key bias, which softmax
# ignores; an embedding row a token barely touches) becomes an lr-sized step of random sign with
# eps=1e-8, and two exact implementations then differ by more than 1e-5. eps=1e-6 leaves every
# real gradient's step as it is and keeps noise-level ones from being amplified.
EPS = 1e-6


def _optimizer(named, lr_total_steps: int):
    from hfpipe.train.optim import build_scheduler, param_groups

    opt = torch.optim.AdamW(param_groups(named, HP["weight_decay"]), lr=HP["lr"], betas=HP["betas"], eps=EPS,
                            foreach=True)
    return opt, build_scheduler(opt, warmup_steps=HP["warmup"], total_steps=lr_total_steps, lr=HP["lr"])


def _reference(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = {n: model.eval()(**b, use_cache=False).logits for n, b in logit_batches(model.config.vocab_size).items()}
    opt, sched = _optimizer(list(model.named_parameters()), lr_total_steps=STEPS)
    run = train_reference(model, (b for (b,) in make_batches(model.config.vocab_size, steps=STEPS)), opt, sched)
    assert run["moved"] > 100 * TOL, "training did not move the weights: agreement would be trivial"
    return {"logits": logits, **run}


def _worker(paths: dict[str, str], pp: int, schedule: str, layout: str | None) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(pp)
    out = {}
    for kind, path in paths.items():
        pm = load_pipeline(path, pp=pp, schedule=schedule, layout=layout, method="even", microbatches=4, dist=dist)
        vocab = pm.source.config.vocab_size
        logits = {n: pm.forward(b) for n, b in logit_batches(vocab).items()}
        opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
        grads = first_gradients(opt, pm.named_parameters())
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        losses, norms = [], []
        for (batch,) in make_batches(vocab, steps=STEPS):
            step = trainer.step(batch)
            losses.append(step.loss)
            norms.append(step.grad_norm)
        weights = {k: v.detach().clone() for k, v in pm.model_state_dict().items()}
        out[kind] = {"logits": logits, "train": {"loss": losses, "norm": norms, "grads": grads, "weights": weights}}
    return out


def _run(kinds, pp: int, schedule: str, layout: str | None) -> None:
    paths = {k: str(tiny_checkpoint(k, num_hidden_layers=LAYERS)) for k in kinds}
    ranks = run_ranks(_worker, pp, paths, pp, schedule, layout)
    for kind, path in paths.items():
        ref = _reference(path)
        per_rank = {r: res[kind] for r, res in ranks.items()}
        for name, expected in ref["logits"].items():
            got = [res["logits"][name] for res in per_rank.values() if res["logits"][name] is not None]
            assert len(got) == 1, f"{kind}: logits on {len(got)} ranks"
            diff = (got[0] - expected).abs().max().item()
            assert diff <= TOL, f"{kind} {name} logits differ from transformers by {diff}"
        check_equal(ref, {r: {schedule: res["train"]} for r, res in per_rank.items()}, (schedule,))


PIPES = {"pp2": (2, "1f1b", None), "pp3-uneven": (3, "gpipe", UNEVEN)}


def test_table_slice():
    _run(SLICE, *PIPES["pp3-uneven"])


@pytest.mark.slow
@pytest.mark.parametrize("pipe", list(PIPES))
@pytest.mark.parametrize("kind", TABLE)
def test_table_full(kind, pipe):
    _run((kind,), *PIPES[pipe])


def test_table_has_the_required_families():
    required = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "olmo2",
                "smollm3", "gemma", "gemma2", "gemma3_text", "granite", "starcoder2", "gpt_oss", "deepseek_v2",
                "deepseek_v3", "deepseek_v32", "deepseek_v4"}
    assert required <= set(TABLE) and len(TABLE) >= 25


def test_every_table_row_is_a_tested_adapter_and_back():
    from hfpipe.models.registry import SUPPORTED_MODEL_TYPES
    from hfpipe.models.support import get_adapter
    from hfpipe.tiny import tiny_config

    for kind in TABLE:
        assert get_adapter(tiny_config(kind)).tested, kind
    assert set(SUPPORTED_MODEL_TYPES) == set(TABLE)  # "tested" means a row here


@pytest.mark.parametrize("kind", [k if k == "granite" else pytest.param(k, marks=pytest.mark.slow) for k in TABLE])
def test_hfpipe_verify_passes(kind, tmp_path):
    from hfpipe.verify import verify

    result = verify(tiny_checkpoint(kind, num_hidden_layers=LAYERS), pp=2, schedule="1f1b", tolerance=TOL)
    assert result.passed, result.summary()
