"""LoRA training through the pipeline equals PEFT's single-process LoRA training.

The oracle is ``get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(...))``
trained on the full batch with the same AdamW groups, LR schedule and ``clip_grad_norm_`` over its
trainable parameters. Both start from the same adapters: the pipeline's PEFT-initialised ones with
every ``lora_B`` set to seeded random values (PEFT starts B at zero, which would leave A's first
gradient zero and the test weaker), copied into the ``PeftModel`` by name. Per step, loss and grad
norm must agree within 1e-5 (the same on every rank, to the bit), and every adapter after the last
step within 1e-5 plus the drift AdamW's normalised step can make of rounding noise
(``_dist.AdamDrift``); base weights must not move, and only adapters may be trainable.

The default suite runs a slice; ``pytest -m slow`` runs every schedule at pp 2 on tied Llama and
pp 3 and 4 on Llama and DeepSeek-V3.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from _dist import AdamDrift, assert_weights_close, run_ranks, tiny_checkpoint
from test_train_equivalence import ALL_SCHEDULES, HP, LAYERS, MICRO, _optimizer, make_batches

TOL = 1e-5
BF16_TOL = 2e-3  # bf16 matmuls over 1-row microbatches round unlike one 8-row batch (3e-4 seen)
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
# DeepSeek-V3: attention and the dense/shared-expert MLPs (nn.Linear), and the fused routed
# experts (3-D parameters, through PEFT's target_parameters).
DSV3_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0,
                 target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def lora_config(kw: dict):
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **kw)


def seeded_b(name: str, shape) -> torch.Tensor:
    """Non-zero starting values for a ``lora_B`` tensor, from its name alone."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.05 * torch.randn(shape, generator=g)


def start_adapters(pm) -> dict[str, torch.Tensor]:
    """Set every ``lora_B`` of a pipeline to :func:`seeded_b`; return all adapters as they start."""
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_B." in name:
                b = seeded_b(name, p.shape)
                if hasattr(p, "to_local"):  # FSDP: this dp rank's rows
                    from torch.distributed.tensor import distribute_tensor

                    b = distribute_tensor(b, p.device_mesh, p.placements).to_local()
                p.to_local().copy_(b) if hasattr(p, "to_local") else p.copy_(b)
    return {n: _full(p) for n, p in pm.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(getattr(t, "_local_tensor", t), "get_original_weight"):  # a frozen NF4 base weight (dp: its shard)
        return getattr(t, "_local_tensor", t).get_original_weight().detach().cpu()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def pipeline_worker(path: str, pp: int, dp: int, schedules: tuple[str, ...], kw: dict, options: dict) -> dict:
    """Train LoRA ``len(batches)`` steps with each schedule; return measurements of this rank."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(ParallelDims(pp=pp, dp=dp, tp=options.get("tp", 1)))
    results = {}
    for schedule in schedules:
        pm = load_pipeline(path, pp=pp, dp=dp, schedule=schedule, microbatches=MICRO, dist=dist,
                           lora=lora_config(kw), **options)
        named = pm.named_parameters()
        assert named and all(".lora_" in n for n, _ in named), "only adapters are trainable"
        base = {k: v for k, v in pm.view().state_dict().items()}
        frozen = {n: _full(p) for m in pm.modules for n, p in m.named_parameters() if not p.requires_grad}
        start = start_adapters(pm)
        opt, sched = _optimizer(named)
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        losses, norms = [], []
        for shards in make_batches(pm.source.config.vocab_size, dp=dp):
            out = trainer.step(shards[dist.dp_rank])
            losses.append(out.loss)
            norms.append(out.grad_norm)
        still = all(torch.equal(_full(p), frozen[n]) for m in pm.modules for n, p in m.named_parameters()
                    if not p.requires_grad)
        results[schedule] = {"loss": losses, "norm": norms, "start": start, "view_keys": sorted(base),
                             "final": {n: _full(p) for n, p in pm.named_parameters()}, "base_frozen": still,
                             "dtypes": ({p.dtype for p in frozen.values()}, {p.dtype for _, p in named},
                                        {t.dtype for s in opt.state.values() for t in s.values()})}
    return results


def hf_model(path: str, dtype: torch.dtype = torch.float32):
    """The oracle's base model: transformers' ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def reference_run(path: str, kw: dict, start: dict[str, torch.Tensor], dp: int = 1,
                  dtype: torch.dtype = torch.float32, build=hf_model) -> dict:
    """PEFT in one process on ``build(path, dtype)``, starting from the adapters ``start`` (stage names)."""
    from peft import get_peft_model

    model = get_peft_model(build(path, dtype), lora_config(kw)).train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ours = {"base_model.model." + k: v for k, v in start.items()}
    assert sorted(n for n, _ in named) == sorted(ours), "the pipeline's adapters are PEFT's, by name"
    with torch.no_grad():
        for n, p in named:
            p.copy_(ours[n])
    opt, sched = _optimizer(named)
    drift = AdamDrift([(n.removeprefix("base_model.model."), p) for n, p in named], model.config.vocab_size)
    losses, norms = [], []
    for shards in make_batches(model.config.vocab_size, dp=dp):
        batch = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], HP["max_grad_norm"])))
        losses.append(float(loss.detach()))
        opt.step()
        drift.step(opt)
        sched.step()
        opt.zero_grad()
    final = {n.removeprefix("base_model.model."): p.detach().clone() for n, p in named}
    moved = max((final[k] - start[k]).abs().max().item() for k in final)
    return {"loss": losses, "norm": norms, "final": final, "drift": drift.drift, "moved": moved}


def merged(ranks: dict, schedule: str, key: str) -> dict[str, torch.Tensor]:
    out = {}
    for r in ranks.values():
        out.update(r[schedule][key])
    return out


def run_and_check(kind: str, pp: int, schedules, kw: dict = LORA, options: dict | None = None,
                  dp: int = 1, dtype: torch.dtype = torch.float32, tol: float = TOL, build=hf_model,
                  path: str | None = None) -> dict:
    path = path or str(tiny_checkpoint(kind, num_hidden_layers=LAYERS))
    options = options or {}
    ranks = run_ranks(pipeline_worker, pp * dp * options.get("tp", 1), path, pp, dp, tuple(schedules), kw, options)
    start = merged(ranks, schedules[0], "start")
    ref = reference_run(path, kw, start, dp, dtype, build)
    assert ref["moved"] > 100 * TOL  # the adapters really move: agreement is not trivial
    for schedule in schedules:
        # the same adapters start every run: their initialisation does not depend on the layout
        for name, t in merged(ranks, schedule, "start").items():
            assert torch.equal(t, start[name]), f"{schedule} {name}: another initial adapter"
        first = next(iter(ranks.values()))[schedule]
        for r in ranks.values():
            got = r[schedule]
            assert got["base_frozen"], f"{schedule}: a base weight moved"
            assert all(".lora_" in k for k in got["view_keys"]), "checkpoint view holds only adapters"
            assert (got["loss"], got["norm"]) == (first["loss"], first["norm"]), f"{schedule}: ranks disagree"
            for what in ("loss", "norm"):
                torch.testing.assert_close(torch.tensor(got[what]), torch.tensor(ref[what]), atol=tol, rtol=0,
                                           msg=lambda m: f"{schedule} {what}: {m}")
        final = merged(ranks, schedule, "final")
        assert sorted(final) == sorted(ref["final"]), f"{schedule}: adapters not covered"
        assert_weights_close(final, ref["final"], ref["drift"], tol, schedule)
    return ranks


def test_lora_matches_peft_every_schedule_pp2_tied_llama():
    run_and_check("llama_tied", 2, ALL_SCHEDULES)


@pytest.mark.slow
def test_lora_matches_peft_pp3_deepseek_v3_attention_shared_and_routed_experts():
    run_and_check("deepseek_v3", 3, ("1f1b",), DSV3_LORA)


@pytest.mark.slow
def test_bf16_base_stays_frozen_in_bf16_while_adapters_and_adam_state_are_fp32():
    """Against PEFT on the same bf16 base (adapters fp32 by PEFT's autocast_adapter_dtype)."""
    ranks = run_and_check("llama", 2, ("1f1b",), options={"dtype": "bf16"}, dtype=torch.bfloat16, tol=BF16_TOL)
    for r in ranks.values():
        assert r["1f1b"]["dtypes"] == ({torch.bfloat16}, {torch.float32}, {torch.float32})


@pytest.mark.slow
def test_lora_dp2_x_pp2_matches_peft():
    run_and_check("llama_tied", 2, ("1f1b", "interleaved-1f1b"), dp=2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("pp", [3, 4])
def test_lora_matrix(kind, pp):
    run_and_check(kind, pp, ALL_SCHEDULES, DSV3_LORA if kind == "deepseek_v3" else LORA)
