"""Expert parallelism (``--ep``) is exact: pipelined, data-parallel runs with routed experts sharded over
ep ranks equal one-process transformers.

The oracle is the model table's (tests/test_model_table.py): ``from_pretrained`` logits of a padded
and a packed batch, and 3 AdamW steps on padded, prompt-masked batches. Each dp rank takes its rows of
the same global batches, so the ep run must give transformers' logits within 1e-5 and its losses,
grad norms and final weights. The export of the trained run must have the source's keys and shapes
and load in ``from_pretrained`` with those weights.

Also here: the all-to-all dispatch and combine alone against transformers' experts module (one rank
receives no tokens, most experts none); which bytes a rank reads for both checkpoint layouts;
resuming an ep checkpoint at another ep, dp and pp; and the inputs ``--ep`` refuses.

The default suite runs DeepSeek-V3 at pp 2 x dp 2 x ep 2; ``pytest -m slow`` runs the table (8
families x 6 meshes: ep 2 and 4 at pp 2 and 3, two replicas per expert shard, an interleaved
schedule; and a starved router). The V schedules (zbv,
dualpipev) are zero-bubble ones, which torch 2.13 cannot run under FSDP (dp > 1): ep refuses them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_model_table import LAYERS, STEPS, TOL, _optimizer, _reference
from test_stage_equivalence import logit_batches
from test_train_equivalence import HP, check_equal, make_batches

FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
# name -> (pp, dp, ep, schedule, microbatches, layout)
MESHES = {
    "pp2-dp2-ep2": (2, 2, 2, "1f1b", 2, None),
    "pp3-dp2-ep2": (3, 2, 2, "gpipe", 2, "Et|t|ttL"),
    # dp 4: the 4-row logit batches leave one row per rank, so one microbatch (GPipe allows it)
    "pp2-dp4-ep4": (2, 4, 4, "gpipe", 1, None),
    "pp3-dp4-ep4": (3, 4, 4, "gpipe", 1, None),
    "pp2-dp4-ep2": (2, 4, 2, "gpipe", 1, None),  # two replicas of each expert shard (edp 2)
    "pp2-dp2-ep2-interleaved": (2, 2, 2, "interleaved-1f1b", 2, None),
}


def _rows(batch: dict, dp: int, rank: int) -> dict:
    """dp rank ``rank``'s rows of a global batch."""
    n = next(iter(batch.values())).shape[0] // dp
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def _train_worker(path: str, mesh: tuple, export: str | None) -> dict:
    """Logits and 3 training steps at ``mesh``; the export of the result when ``export`` is given."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    pp, dp, ep, schedule, micro, layout = mesh
    dist = init_distributed(pp, dp)
    pm = load_pipeline(path, pp=pp, dp=dp, ep=ep, schedule=schedule, microbatches=micro, layout=layout,
                       method="even", dist=dist)
    vocab = pm.source.config.vocab_size
    logits = {}
    for name, batch in logit_batches(vocab).items():
        out = pm.forward(_rows(batch, dp, dist.dp_rank))
        logits[name] = None if out is None else out.detach().clone()
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for (batch,) in make_batches(vocab, steps=STEPS):
        step = trainer.step(_rows(batch, dp, dist.dp_rank))
        losses.append(step.loss)
        norms.append(step.grad_norm)
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    if export:
        pm.save_pretrained(export)
    return {"logits": logits, "dp_rank": dist.dp_rank, "train": {"loss": losses, "norm": norms, "weights": weights}}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _check_logits(ref: dict, ranks: dict, dp: int, kind: str) -> None:
    for name, expected in ref["logits"].items():
        parts = {r["dp_rank"]: r["logits"][name] for r in ranks.values() if r["logits"][name] is not None}
        assert sorted(parts) == list(range(dp)), f"{kind} {name}: logits from dp ranks {sorted(parts)}"
        got = torch.cat([parts[d] for d in range(dp)])
        diff = (got - expected).abs().max().item()
        assert diff <= TOL, f"{kind} {name}: logits differ from transformers by {diff}"


def _source_specs(folder: Path) -> dict[str, tuple]:
    from hfpipe.source.safetensors_io import read_header

    files = sorted(folder.glob("*.safetensors"))
    return {k: (v["dtype"], tuple(v["shape"])) for f in files for k, v in read_header(f).items()
            if not k.startswith("__")}


def _check_export(src: Path, out: Path, weights: dict) -> None:
    """Same keys, dtypes and shapes as the source; from_pretrained loads the trained weights."""
    from transformers import AutoModelForCausalLM

    assert _source_specs(out) == _source_specs(src)
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, w in model.state_dict().items():
        if name in weights:
            torch.testing.assert_close(w, weights[name], atol=TOL, rtol=0, msg=lambda m: f"export {name}: {m}")


def run_case(path: Path, mesh_name: str, tmp_path: Path, kind: str) -> None:
    mesh = MESHES[mesh_name]
    out = tmp_path / "hf"
    ranks = run_ranks(_train_worker, mesh[0] * mesh[1], str(path), mesh, str(out))
    ref = _reference(str(path))
    _check_logits(ref, ranks, mesh[1], kind)
    check_equal(ref, {r: {mesh_name: res["train"]} for r, res in ranks.items()}, (mesh_name,))
    _check_export(path, out, ref["weights"])


def test_deepseek_v3_pp2_dp2_ep2_matches_transformers_and_exports_the_source_keys(tmp_path):
    run_case(tiny_checkpoint("deepseek_v3", num_hidden_layers=LAYERS), "pp2-dp2-ep2", tmp_path, "deepseek_v3")


def starved_checkpoint(kind: str) -> Path:
    """``kind`` with its router biased so every token picks experts 0 and 1: with ep 2 the second
    rank's experts get no token (DeepSeek's selection bias; GPT-OSS's router bias)."""
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint(kind, num_hidden_layers=LAYERS)
    out = src.parent / f"{src.name}-starved"
    if out.is_dir():
        return out
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("gate.e_score_correction_bias", "router.bias")):
                t.zero_()
                t[:2] = 50.0
    model.save_pretrained(out, max_shard_size="150KB")
    for f in src.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", FAMILIES)
def test_table(kind, mesh_name, tmp_path):
    run_case(tiny_checkpoint(kind, num_hidden_layers=LAYERS), mesh_name, tmp_path, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "gpt_oss"])
def test_a_rank_whose_experts_get_no_token_still_matches(kind, tmp_path):
    run_case(starved_checkpoint(kind), "pp2-dp2-ep2", tmp_path, kind)


# --- dispatch and combine alone -------------------------------------------------------------------

def _experts_worker(path: str, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    probe: torch.Tensor) -> dict:
    """Each of 2 ranks runs its tokens through layer 2's sharded experts (pp 1, dp 2, ep 2)."""
    from hfpipe.parallel.expert import init_expert_mesh
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.load import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    dist = init_distributed(1, 2)
    source = ModelSource.open(path)
    (stage,), stats = load_rank_stages(source, plan_pipeline(source.config, 1), 0, dist.device,
                                       expert_mesh=init_expert_mesh(dist, 2))
    local = [v.to_local() if hasattr(v, "to_local") else v for v in stage.state_dict().values()]
    experts = stage.model.layers["2"].mlp.experts
    r = dist.dp_rank
    x = tokens[r].clone().requires_grad_()
    w = weights[r].clone().requires_grad_()
    out = experts(x, index[r], w)
    (out * probe[r]).sum().backward()
    grads = {n: p.grad.to_local().clone() for n, p in experts.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, "dw": w.grad, "grads": grads, "rows": experts.num_experts,
            "read": stats.bytes_read, "share": sum(t.numel() * t.element_size() for t in local), "keys": stats.keys_read}


def test_all_to_all_dispatch_and_combine_equal_the_experts_module_with_a_rank_receiving_nothing():
    """Rank 1's tokens all pick experts 0 and 1 (rank 0's); rank 0's pick 0..3: experts 4..7 and
    rank 1 receive nothing. Outputs, input and routing-weight gradients and each rank's expert
    gradients must equal transformers' experts module run on all tokens. Each rank read exactly
    its share of the checkpoint."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("deepseek_v3", num_hidden_layers=LAYERS)
    ref = AutoModelForCausalLM.from_pretrained(path).model.layers[2].mlp.experts
    g = torch.Generator().manual_seed(3)
    hidden = ref.gate_up_proj.shape[-1]
    tokens = torch.randn(2, 5, hidden, generator=g)
    index = torch.stack([torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]),
                         torch.tensor([[0, 1], [1, 0]] * 2 + [[0, 1]])])
    weights = torch.rand(2, 5, 2, generator=g)
    probe = torch.randn(2, 5, hidden, generator=g)
    ranks = run_ranks(_experts_worker, 2, str(path), tokens, index, weights, probe)

    x = tokens.flatten(0, 1).clone().requires_grad_()
    w = weights.flatten(0, 1).clone().requires_grad_()
    out = ref(x, index.flatten(0, 1), w)
    (out * probe.flatten(0, 1)).sum().backward()
    for r, got in ranks.items():
        # loading read this rank's share exactly (fp32 source, MTP layer skipped): no other rank's expert
        assert got["read"] == got["share"]
        assert not any(f".experts.{i}." in k for k in got["keys"] for i in range(4 * (1 - r), 4 * (2 - r)))
        rows = slice(5 * r, 5 * (r + 1))
        torch.testing.assert_close(got["out"], out[rows].detach(), atol=TOL, rtol=0)
        torch.testing.assert_close(got["dx"], x.grad[rows], atol=TOL, rtol=0)
        torch.testing.assert_close(got["dw"], w.grad[rows], atol=TOL, rtol=0)
        assert got["rows"] == 4
        for name, grad in got["grads"].items():
            want = getattr(ref, name).grad[4 * r:4 * (r + 1)]
            torch.testing.assert_close(grad, want, atol=TOL, rtol=0, msg=lambda m: f"rank {r} {name}: {m}")
        if r == 1:
            assert all(float(gr.abs().max()) == 0.0 for gr in got["grads"].values())  # nothing arrived


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, ep, dp, says", [
    ("llama", 2, 2, "no routed experts"),
    ("mixtral", 8, 8, "must divide the 4 routed experts"),
    ("mixtral", 2, 3, "must divide --dp"),
    ("mixtral", 2, 2, "zero-bubble"),
])
def test_ep_that_cannot_run_is_refused_naming_the_flag(kind, ep, dp, says):
    from hfpipe.parallel.expert import ExpertParallelError, check_expert_parallel
    from hfpipe.tiny import tiny_config

    with pytest.raises(ExpertParallelError, match=says) as e:
        check_expert_parallel(tiny_config(kind), ep, dp, "zbv" if says == "zero-bubble" else "1f1b")
    assert "--ep" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind, flags, says", [
    ("llama", "--dp 2 --ep 2", "no routed experts"),
    ("mixtral", "--dp 8 --ep 8", "must divide the 4 routed experts"),
    ("mixtral", "--dp 3 --ep 2", "must divide --dp"),
    ("mixtral", "--dp 2 --ep 2 --schedule zbv --vpp 2 --microbatches 4", "zero-bubble"),
    ("mixtral", "--dp 2 --ep 2 --lora-rank 4", "--lora-rank"),
])
def test_finetune_refuses_ep_in_one_line_exit_2_writing_nothing(kind, flags, says, tmp_path):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    model = tiny_checkpoint(kind, num_hidden_layers=LAYERS)
    out = tmp_path / "out"
    args = ["finetune", str(model), "--pp", "2", "--seq-len", "32", "--batch-size", "4", "--output-dir", str(out),
            *flags.split()]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr[-2000:]
    assert "--ep" in lines[0] and not out.exists()


# --- checkpoints ----------------------------------------------------------------------------------

def _resume_worker(path: str, mesh: tuple, root: str, save: bool) -> dict:
    """``save``: train steps 1-2, checkpoint, train step 3. Else: resume the checkpoint, train step 3."""
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from hfpipe.parallel.mesh import init_distributed

    pp, dp, ep, schedule, micro, layout = mesh
    dist = init_distributed(pp, dp)
    pm = load_pipeline(path, pp=pp, dp=dp, ep=ep, schedule=schedule, microbatches=micro, layout=layout,
                       method="even", dist=dist)
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    batches = [b for (b,) in make_batches(pm.source.config.vocab_size, steps=STEPS)]
    if save:
        for batch in batches[:2]:
            trainer.step(_rows(batch, dp, dist.dp_rank))
        pm.save_checkpoint(root, 2, opt)
    else:
        load_checkpoint(latest_checkpoint(root), pm.view(), opt)
        for _ in range(2):
            sched.step()  # a LambdaLR: its state is the step count
    step = trainer.step(_rows(batches[2], dp, dist.dp_rank))
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    return {"loss": [step.loss], "norm": [step.grad_norm], "weights": weights}


RESUME_AT = {"pp1-dp4-ep4": (1, 4, 4, "1f1b", 2, None), "pp2-dp1-ep1": (2, 1, 1, "1f1b", 2, None),
             "pp3-dp2-ep2": MESHES["pp3-dp2-ep2"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_an_ep2_checkpoint_resumes_exactly_at_another_ep_dp_and_pp(kind, tmp_path):
    """Saved at pp 2 x dp 2 x ep 2 after 2 steps; step 3 after resuming at ep 4 (pp 1, dp 4), at
    ep 1 (pp 2, dp 1) and at pp 3 equals step 3 of the run that never stopped."""
    path = str(tiny_checkpoint(kind, num_hidden_layers=LAYERS))
    root = str(tmp_path / "ckpt")
    mesh = MESHES["pp2-dp2-ep2"]
    ranks = run_ranks(_resume_worker, 4, path, mesh, root, True)
    meta = json.loads(next(Path(root).glob("step-*/hfpipe.json")).read_text())
    assert meta["world"]["ep"] == 2
    want = _merged(ranks)
    for name, other in RESUME_AT.items():
        got = run_ranks(_resume_worker, other[0] * other[1], path, other, root, False)
        check_equal(want, {r: {name: res} for r, res in got.items()}, (name,))


def _merged(ranks: dict) -> dict:
    """One run's loss, norm and whole weights from its ranks' parts."""
    first = next(iter(ranks.values()))
    weights = {}
    for res in ranks.values():
        weights.update(res["weights"])
    return {"loss": first["loss"], "norm": first["norm"], "weights": weights}


# --- loading ----------------------------------------------------------------------------------------

def _load_worker(path: str, ep: int) -> dict:
    """Load every layer at pp 1, dp = ep: this rank's tensors (experts: its rows) and what it read."""
    from hfpipe.parallel.expert import init_expert_mesh
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.load import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    dist = init_distributed(1, ep)
    source = ModelSource.open(path)
    (stage,), stats = load_rank_stages(source, plan_pipeline(source.config, 1), 0, dist.device,
                                       expert_mesh=init_expert_mesh(dist, ep))
    tensors = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in stage.state_dict().items()}
    return {"tensors": tensors, "bytes": stats.bytes_read, "keys": stats.keys_read}


def fused_checkpoint(kind: str) -> Path:
    """``kind`` saved with transformers' in-memory keys: fused 3-D experts, as some hub models ship."""
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint(kind, num_hidden_layers=LAYERS)
    out = src.parent / f"{src.name}-fused"
    if not out.is_dir():
        model = AutoModelForCausalLM.from_pretrained(src)
        model.save_pretrained(out, max_shard_size="150KB", save_original_format=False)
    return out


def _share(path: Path, tensors: dict) -> int:
    """Bytes of this rank's tensors as the checkpoint stores them (its dtype)."""
    itemsize = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    dtypes = {v[0] for v in _source_specs(path).values()}
    assert len(dtypes) == 1, dtypes
    return sum(t.numel() for t in tensors.values()) * itemsize[dtypes.pop()]


@pytest.mark.slow  # the default suite checks the bytes in the dispatch test's load
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_a_rank_reads_only_its_experts_in_either_key_layout(layout):
    """At ep 2 each rank's tensors equal the one-process load's, experts cut to its rows, and the
    bytes it read are exactly its share (per-expert keys of the other rank's experts never read)."""
    from hfpipe.pipeline.load import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    path = tiny_checkpoint("mixtral", num_hidden_layers=LAYERS)
    path = fused_checkpoint("mixtral") if layout == "fused" else path
    keys = set(_source_specs(path))
    assert any(".experts.gate_up_proj" in k for k in keys) == (layout == "fused")
    source = ModelSource.open(str(path))
    (whole,), _ = load_rank_stages(source, plan_pipeline(source.config, 1), 0, torch.device("cpu"))
    ranks = run_ranks(_load_worker, 2, str(path), 2)
    for r, got in ranks.items():
        assert got["bytes"] == _share(path, got["tensors"])  # tied/MTP-free fp32: every byte read is kept
        assert not any(f".experts.{2 * (1 - r) + i}." in k for k in got["keys"] for i in range(2))
        for name, t in whole.state_dict().items():
            want = t[2 * r:2 * (r + 1)] if ".experts." in name else t
            torch.testing.assert_close(got["tensors"][name], want, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_fp8_block_scaled_experts_load_sharded(tmp_path):
    """A DeepSeek-V3 block-FP8 checkpoint at ep 2: each rank's dequantised experts are the one-process
    load's rows, and the other rank's FP8 experts and scales are never read."""
    from hfpipe.pipeline.load import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource
    from hfpipe.tiny import make_fp8_checkpoint

    path = make_fp8_checkpoint(tiny_checkpoint("deepseek_v3", num_hidden_layers=LAYERS), tmp_path / "fp8", block=16)
    source = ModelSource.open(str(path))
    (whole,), _ = load_rank_stages(source, plan_pipeline(source.config, 1), 0, torch.device("cpu"))
    ranks = run_ranks(_load_worker, 2, str(path), 2)
    for r, got in ranks.items():
        others = range(4 * (1 - r), 4 * (1 - r) + 4)
        assert not any(f".experts.{i}." in k for k in got["keys"] for i in others)
        assert any(k.endswith("_scale_inv") and ".experts." in k for k in got["keys"])
        for name, t in whole.state_dict().items():
            want = t[4 * r:4 * (r + 1)] if ".mlp.experts." in name else t
            torch.testing.assert_close(got["tensors"][name], want, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_a_fused_layout_source_trains_and_exports_in_its_own_layout(tmp_path):
    run_case(fused_checkpoint("mixtral"), "pp2-dp2-ep2", tmp_path, "mixtral")


# --- the check, through the CLI -------------------------------------------------------------

def _finetune(model: Path, out: Path, *flags) -> list[dict]:
    import os
    import subprocess
    import sys

    args = ["finetune", str(model), "--max-steps", "3", "--seq-len", "32", "--microbatches", "2", "--lr", "3e-3",
            "--warmup-steps", "1", "--output-dir", str(out), "--save-hf-at-end", "--threads-per-rank", "1", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "hfpipe.cli.main", *args], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_finetune_pp2_dp2_ep2_equals_pp1(kind, tmp_path):
    """``--pp 2 --dp 2 --ep 2 --batch-size 2`` against ``--pp 1 --batch-size 4``: losses and grad norms
    within 1e-5 at step 1 and 1e-4 relative after; the export has the source's keys and shapes."""
    model = tiny_checkpoint(kind, num_hidden_layers=LAYERS)
    one = _finetune(model, tmp_path / "one", "--pp", "1", "--batch-size", "4")
    ep = _finetune(model, tmp_path / "ep", "--pp", "2", "--dp", "2", "--ep", "2", "--batch-size", "2")
    assert [r["step"] for r in ep] == [r["step"] for r in one] and len(one) == 3
    for i, (a, b) in enumerate(zip(one, ep)):
        for key in ("loss", "grad_norm"):
            if i == 0:
                assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
            else:
                assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (key, i, a[key], b[key])
    assert _source_specs(tmp_path / "ep" / "hf") == _source_specs(model)
