"""Expert parallelism (``--ep``) is exact: pipelined, data-parallel runs with routed experts sharded over
ep ranks equal one-process transformers.

The oracle is the model table's (tests/models/test_models_table.py): ``from_pretrained`` logits of a padded
and a packed batch, and 3 AdamW steps on padded, prompt-masked batches. Each dp rank takes its rows of
the same global batches, so the ep run must give transformers' logits within 1e-5 and its losses,
grad norms and final weights. The export of the trained run must have the source's keys and shapes
and load in ``from_pretrained`` with those weights.

Also here: the all-to-all dispatch and combine alone against transformers' experts module (one rank
receives no tokens, most experts none; the rank read exactly its share) and the inputs ``--ep``
refuses. Loading layouts, resume and the CLI check are in tests/parallel/test_parallel_expert_io.py.

The default suite runs DeepSeek-V3 at pp 2 x dp 2 x ep 2; ``pytest -m slow`` runs the table (8
families x 6 meshes: ep 2 and 4 at pp 2 and 3, two replicas per expert shard, an interleaved
schedule; and a starved router). The V schedules (zbv,
dualpipev) are zero-bubble ones, which torch 2.13 cannot run under FSDP (dp > 1): ep refuses them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_models_table import LAYERS, STEPS, TOL, _optimizer, _reference
from test_pipeline_stages import logit_batches
from test_train_equivalence import HP, check_equal, make_batches
from _trust import error_lines

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
    """Same keys, dtypes and shapes as the source; from_pretrained loads the trained weights, bit
    for bit (the export copies and renames, it computes nothing)."""
    from transformers import AutoModelForCausalLM

    assert _source_specs(out) == _source_specs(src)
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, w in model.state_dict().items():
        if name in weights:
            assert torch.equal(w, weights[name]), f"export {name}: not the trained weight"


def run_case(path: Path, mesh_name: str, tmp_path: Path, kind: str) -> None:
    mesh = MESHES[mesh_name]
    out = tmp_path / "hf"
    ranks = run_ranks(_train_worker, mesh[0] * mesh[1], str(path), mesh, str(out))
    ref = _reference(str(path))
    _check_logits(ref, ranks, mesh[1], kind)
    check_equal(ref, {r: {mesh_name: res["train"]} for r, res in ranks.items()}, (mesh_name,))
    trained = {k: w for res in ranks.values() for k, w in res["train"]["weights"].items()}
    _check_export(path, out, trained)


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
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    dist = init_distributed(ParallelDims(pp=1, dp=2, ep=2))
    source = ModelSource.open(path)
    (stage,), stats = load_rank_stages(source, plan_pipeline(source.config, 1), 0, dist.device,
                                       expert_mesh=dist.expert_mesh())
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
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout
    from hfpipe.tiny import tiny_config

    with pytest.raises(ParallelError, match=says) as e:
        check_layout(ParallelDims(pp=2, dp=dp, ep=ep), "zbv" if says == "zero-bubble" else "1f1b",
                     microbatches=4, model_config=tiny_config(kind))
    assert "--ep" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind, flags, says", [
    ("llama", "--dp 2 --ep 2", "no routed experts"),
    ("mixtral", "--dp 8 --ep 8", "must divide the 4 routed experts"),
    ("mixtral", "--dp 3 --ep 2", "must divide --dp"),
    ("mixtral", "--dp 2 --ep 2 --schedule zbv --vpp 2 --microbatches 4", "zero-bubble"),
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
    lines = error_lines(result.stderr)  # a progress line may come first on a loaded machine
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr[-2000:]
    assert "--ep" in lines[0] and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_with_ep_matches_transformers(kind):
    """``output_router_logits`` on: the pipelined aux loss (tests/pipeline/test_pipeline_router_loss.py's oracle) also holds
    with the experts sharded (pp 2 x dp 2 x ep 2)."""
    from test_pipeline_router_loss import check

    check(kind, 2, "1f1b", 4, dp=2, options={"ep": 2})
