"""MoE router aux loss (``output_router_logits``) pipelined equals transformers' (hfpipe.models.router_loss).

The oracle is transformers' own ``*ForCausalLM`` with ``output_router_logits=True``: its ``loss``
(token loss + ``router_aux_loss_coef * aux_loss``) and ``aux_loss``. The pipeline computes the
aux loss per microbatch, so the oracle runs transformers microbatch by microbatch on the same rows
(``num_items_in_batch`` = the step's token count) and counts each microbatch's aux loss 1/(all
microbatches of the step); with one microbatch that is ``model(**batch).loss`` itself. Logits,
step-1 gradients, and losses, grad norms and weights over 3 AdamW steps must agree within 1e-5 (the
weights plus the drift AdamW's normalised step can make of rounding noise, ``_dist.AdamDrift``).
Batches hold left and right padding (excluded from the aux loss as transformers excludes it) and
prompt masking. Families: Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS, GraniteMoE, DeepSeek-V4, and
DeepSeek-V2, whose causal LM returns router logits but adds no aux loss (the pipeline adds none).

The default suite checks the sums against ``load_balancing_loss_func``, a 3-stage chain of every
family in one process (HF's loss and every gradient), and one pipelined case (Qwen3-MoE, pp 2,
1F1B). ``pytest -m slow`` runs every family at pp 2 and 3 under 1F1B, interleaved 1F1B and ZBV;
the other schedules with the chunked head loss; one microbatch under GPipe (transformers' own
whole-batch loss); dp 2 and gradient accumulation with activation checkpointing; dense-only and
empty stages; fp32 sums under bf16-mixed; LoRA against PEFT; and ep 2 once it is merged.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _dist import AdamDrift, assert_weights_close, run_ranks, tiny_checkpoint
from test_models_table import _optimizer
from test_train_equivalence import HP

TOL = 1e-5
STEPS = 3
LAYERS = 6
ROWS, SEQ = 2, 12  # rows per microbatch
COEF = 0.5  # large, so that the aux term moves routers and weights far beyond the tolerance
KINDS = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "granitemoe", "deepseek_v4", "deepseek_v2")
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")


def _checkpoint(kind: str, **config) -> str:
    config = {"num_hidden_layers": LAYERS, "output_router_logits": True, "router_aux_loss_coef": COEF, **config}
    return str(tiny_checkpoint(kind, **config))


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
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = train_microbatches(model, list(model.named_parameters()), microbatches, steps, rows)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = max((weights[k] - start[k]).abs().max().item() for k in weights)
    return {**run, "weights": weights, "moved": moved}


def train_microbatches(model, named, microbatches: int, steps: int = STEPS, rows: int | None = None) -> dict:
    """The oracle's loop: per step, HF's loss per microbatch (``num_items_in_batch`` = the step's
    tokens) with its ``coef * aux_loss`` replaced by ``coef * aux_loss / microbatches``; AdamW."""
    model.train()
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT
    coef = getattr(hf, "router_aux_loss_coef", 0.0)
    opt, sched = _optimizer(named, lr_total_steps=steps)
    drift = AdamDrift(named, model.config.vocab_size)
    params = [p for _, p in named]
    losses, norms, grads = [], [], None
    for batch in _batches(model.config.vocab_size, rows or ROWS * microbatches, steps):
        loss = 0.0
        for mb in _split(batch, microbatches):
            out = model(**mb, use_cache=False, num_items_in_batch=_tokens(batch))
            aux = out.aux_loss if out.aux_loss is not None else 0.0  # DeepSeek-V2 adds none
            loss = loss + out.loss + coef * aux * (1 / microbatches - 1)  # HF adds coef * aux per call
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, HP["max_grad_norm"])))
        losses.append(float(loss.detach()))
        opt.step()
        drift.step(opt)
        sched.step()
        opt.zero_grad()
    return {"loss": losses, "norm": norms, "grads": grads, "drift": drift.drift}


def _split(batch: dict, n: int) -> list[dict]:
    rows = batch["input_ids"].shape[0] // n
    return [{k: v[i * rows:(i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def worker(paths: dict[str, str], pp: int, dp: int, schedule: str, microbatches: int, accum: int = 1,
           options: dict | None = None) -> dict:
    """Per checkpoint: logits, step-1 gradients, then ``STEPS`` trainer steps (this rank's view)."""
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(pp, dp)
    return {kind: _train(path, dist, schedule, microbatches, accum, options) for kind, path in paths.items()}


def _train(path: str, dist, schedule: str, microbatches: int, accum: int, options: dict | None) -> dict:
    from hfpipe.api import load_pipeline

    dp = dist.dp
    pm = load_pipeline(path, pp=dist.pp, dp=dp, schedule=schedule, microbatches=microbatches // (dp * accum),
                       dist=dist, **(options or {}))
    rows = ROWS * microbatches
    batches = _batches(pm.source.config.vocab_size, rows)
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


def check(kinds, pp: int, schedule: str, microbatches: int, dp: int = 1, accum: int = 1,
          options: dict | None = None, config: dict | None = None) -> None:
    """Run ``kinds`` (one launch) and compare each with its transformers oracle."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    paths = {kind: _checkpoint(kind, **(config or {})) for kind in kinds}
    ranks = run_ranks(worker, pp * dp, paths, pp, dp, schedule, microbatches, accum, options)
    for kind, path in paths.items():
        _compare(path, {r: res[kind] for r, res in ranks.items()}, f"{kind} pp{pp} dp{dp} {schedule} x{microbatches}",
                 microbatches, dp, accum)


def _compare(path: str, ranks: dict, case: str, microbatches: int, dp: int, accum: int) -> None:
    from transformers import AutoModelForCausalLM

    ref = reference(path, microbatches)
    assert ref["moved"] > 100 * TOL, "training did not move the weights: agreement would be trivial"
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
        assert_weights_close(r["weights"], ref["weights"], ref["drift"], TOL, f"{case} after {STEPS} steps:")
    if accum == 1:
        assert seen == set(ref["grads"]), f"{case}: gradients not compared: {set(ref['grads']) ^ seen}"


def _hf_model(kind: str, **config):
    from transformers import AutoModelForCausalLM

    from hfpipe.tiny import tiny_config

    config = {"num_hidden_layers": 4, "output_router_logits": True, "router_aux_loss_coef": COEF, **config}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **config), dtype=torch.float32)


def test_sums_reproduce_load_balancing_loss_func():
    """Per-layer sums added stage by stage, finished once: transformers' function, masked or not."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from hfpipe.models.router_loss import RouterLossSpec, finish_router_loss, layer_sums

    g = torch.Generator().manual_seed(0)
    spec = RouterLossSpec(torch.nn.Linear, 0, num_experts=6, top_k=2, coef=0.3, layers=5)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, -4:] = 0
    mask[2, :2] = 0
    for m in (mask, None):
        logits = tuple(torch.randn(21, 6, generator=g) for _ in range(spec.layers))
        sums = torch.zeros(spec.size)
        for layer in logits:
            sums = sums + layer_sums(layer, m, spec)
        want = spec.coef * load_balancing_loss_func(logits, spec.num_experts, spec.top_k, m)
        assert abs(float(finish_router_loss(sums, m, 21, spec)) - float(want)) <= 1e-7


def test_a_microbatch_of_padding_only_adds_zero_with_finite_gradients():
    from hfpipe.models.router_loss import RouterLossSpec, finish_router_loss, layer_sums

    spec = RouterLossSpec(torch.nn.Linear, 0, num_experts=4, top_k=2, coef=1.0, layers=1)
    logits = torch.randn(6, 4, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.long)
    loss = finish_router_loss(layer_sums(logits, mask, spec), mask, 6, spec)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.isfinite(logits.grad).all() and not logits.grad.any()


@pytest.mark.parametrize("kind", KINDS)
def test_stage_chain_equals_transformers_loss_and_gradients(kind):
    """Three stage modules run in one process (no schedule): HF's loss and every gradient, exactly."""
    from hfpipe.models.support import get_adapter
    from hfpipe.loss.objective import StageLoss, TokenMean
    from hfpipe.loss.tokens import shift_labels
    from hfpipe.models.stage import PipelineStageModule
    from hfpipe.models.spec import StageSpec

    model = _hf_model(kind)
    batch = _batches(model.config.vocab_size, 3)[0]
    out = model(**batch, use_cache=False)
    out.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    specs = [StageSpec(0, (0,), True, False), StageSpec(1, (1, 2), False, False), StageSpec(2, (3,), False, True)]
    stages = [PipelineStageModule(s, model.config, model, get_adapter(model.config)) for s in specs]
    stages[-1].lm_head.weight = model.lm_head.weight  # keep the model's own (tied or not)
    x = (batch["input_ids"],)
    for stage in stages:
        stage.carry_router_sums = True
        x = stage(*x, attention_mask=batch["attention_mask"], input_ids=batch["input_ids"])  # V4's layers read ids
        x = x if isinstance(x, tuple) else (x,)
    assert len(x) == (1 if kind == "deepseek_v2" else 2)  # DeepSeek-V2 adds no aux loss, as in HF
    loss_fn = StageLoss(TokenMean())
    loss_fn.denominator = float(_tokens(batch))
    loss = loss_fn(x if len(x) == 2 else x[0], shift_labels(batch["labels"]))
    loss.backward()
    assert abs(float(loss.detach()) - float(out.loss.detach())) <= TOL
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for name, g in got.items():
        _close(g, want[name], f"{kind} gradient of {name}")
    routers = [n for n in got if n.endswith(("router.weight", "gate.weight"))]
    assert routers and all(got[n].abs().max() > 0 for n in routers), "every router gets a gradient"


def test_the_table_families_are_accepted_and_others_refused_in_one_line_before_their_proof():
    """A family outside the table is proven at load on its logits only: its aux loss is refused."""
    from transformers import OlmoeConfig

    from hfpipe.models.adapter import UnsupportedModelError
    from hfpipe.models.support import get_adapter
    from hfpipe.tiny import tiny_config

    for kind in KINDS:
        get_adapter(tiny_config(kind, output_router_logits=True))
    with pytest.raises(UnsupportedModelError, match="set output_router_logits=false in config.json$") as err:
        get_adapter(OlmoeConfig(output_router_logits=True, num_hidden_layers=1, hidden_size=16,
                                intermediate_size=16, num_attention_heads=2, num_experts=4))
    assert "\n" not in str(err.value)


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
    assert_weights_close(ours["weights"], plain["weights"], plain["drift"], TOL, "one-microbatch oracle")


def test_router_aux_loss_matches_transformers_pp2_1f1b():
    check("qwen3_moe", 2, "1f1b", 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 3])
def test_router_aux_loss_matrix(pp, schedule):
    check(KINDS, pp, schedule, 6)


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
    from hfpipe.models.router_loss import RouterSums

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


@pytest.mark.slow
def test_stages_without_routers_and_empty_stages_pass_the_sums_on():
    """Qwen2-MoE with a dense layer every other one (decoder_sparse_step 2): the first stage holds only
    dense layer 0, the second none. (Each rank keeps some layer: a rank with no parameter at all
    fails gradient clipping in train/step.py, a separate issue.)"""
    check("qwen2_moe", 3, "interleaved-1f1b", 6, config={"decoder_sparse_step": 2},
          options={"layout": "Et||ttt|t|t|L"})


ATTENTION_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _lora_worker(path: str, schedule: str, microbatches: int) -> dict:
    from hfpipe.api import load_pipeline
    from test_lora_equivalence import lora_config, start_adapters

    pm = load_pipeline(path, pp=2, schedule=schedule, microbatches=microbatches, lora=lora_config(ATTENTION_LORA))
    start = start_adapters(pm)
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    steps = [trainer.step(b) for b in _batches(pm.source.config.vocab_size, ROWS * microbatches)]
    return {"loss": [s.loss for s in steps], "norm": [s.grad_norm for s in steps], "start": start,
            "final": {n: _full(p) for n, p in pm.named_parameters()}}


@pytest.mark.slow
def test_lora_with_the_router_aux_loss_matches_peft():
    """LoRA on attention (the routers and fused experts stay frozen): the aux loss trains the adapters."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from test_lora_equivalence import lora_config

    path = _checkpoint("mixtral")
    ranks = run_ranks(_lora_worker, 2, path, "1f1b", 4)
    start, final = {}, {}
    for r in ranks.values():
        start.update(r["start"])
        final.update(r["final"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config(ATTENTION_LORA))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(n.removeprefix("base_model.model.") for n, _ in named) == sorted(start)
    with torch.no_grad():
        for n, p in named:
            p.copy_(start[n.removeprefix("base_model.model.")])
    ref = train_microbatches(model, named, 4)
    assert max((final[k] - start[k]).abs().max().item() for k in start) > 100 * TOL, "the adapters must move"
    for r in ranks.values():
        _close(r["loss"], ref["loss"], "LoRA loss")
        _close(r["norm"], ref["norm"], "LoRA grad norm")
    for n, p in named:
        _close(final[n.removeprefix("base_model.model.")], p.detach(), f"LoRA adapter {n}")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hfpipe.parallel.expert") is None, reason="expert parallelism not merged")
def test_router_aux_loss_with_expert_parallelism():
    """The hook reads the router's output, before the experts' all-to-all: ep 2 changes nothing."""
    check(("mixtral", "qwen3_moe"), 2, "1f1b", 4, dp=2, options={"ep": 2})
