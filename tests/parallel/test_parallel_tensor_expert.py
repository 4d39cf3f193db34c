"""Tensor and expert parallelism together (``--tp`` with ``--ep``) train exactly as transformers does in one process.

Under ep the routed experts are not split over tp: each tp rank holds its ep shard of whole experts, and
transformers' ``AllToAllEP`` hands each rank of a tp group a disjoint slice of the tokens the group shares
to dispatch over ep, then all-gathers the outputs over tp (Megatron's expert tensor parallelism 1).
Attention, the shared experts and dense MLPs are tp-split as without ep. So an expert's gradient is the sum
over edp x tp, and the router's arrives whole on every tp rank through the all-gather's backward: the
step-1 gradients below say both against the oracle.

The oracle is the model table's (tests/models/test_models_table.py): ``from_pretrained`` logits of a padded and a
packed batch, and 3 AdamW steps on padded, prompt-masked batches; each dp rank takes its rows, the tp ranks
of a replica the same rows. Logits within 1e-5, losses and grad norms within 1e-5, step-1 gradients within
reordering noise and the weights after 3 steps within 1e-5 plus AdamW's drift (tests/_dist.py); the
export has the source's keys and the trained weights. Everything here runs 4 to 8 gloo processes: slow.
"""

from __future__ import annotations

import pytest

from _dist import run_ranks, tiny_checkpoint
from test_parallel_expert import _check_export, _check_logits, _full, _rows
from test_parallel_expert_io import _merged
from test_models_table import LAYERS, STEPS, _optimizer, _reference
from test_pipeline_stages import logit_batches
from test_train_equivalence import HP, check_equal, first_gradients, make_batches

pytestmark = pytest.mark.slow


def _worker(path: str, degrees: dict, options: dict, export: str | None) -> dict:
    """Logits, then 3 training steps with the step-1 gradients, at ``degrees``; the export when asked."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dims = ParallelDims(**degrees)
    dist = init_distributed(dims)
    pm = load_pipeline(path, **degrees, schedule="1f1b", microbatches=2, method="even", dist=dist, **options)
    vocab = pm.source.config.vocab_size
    logits = {}
    for name, batch in logit_batches(vocab).items():
        out = pm.forward(_rows(batch, dims.dp, dist.dp_rank))
        logits[name] = None if out is None else out.detach().clone()
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    grads = first_gradients(opt, pm.named_parameters())  # whole: gathered over tp, ep and FSDP's shards
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for (batch,) in make_batches(vocab, steps=STEPS):
        step = trainer.step(_rows(batch, dims.dp, dist.dp_rank))
        losses.append(step.loss)
        norms.append(step.grad_norm)
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    if export:
        pm.save_pretrained(export)
    return {"logits": logits, "dp_rank": dist.dp_rank, "tp_rank": dims.coords(dist.rank)["tp"],
            "experts": _expert_layouts(pm), "keys_read": pm.load_stats.keys_read,
            "train": {"loss": losses, "norm": norms, "grads": grads, "weights": weights}}


def _expert_layouts(pm) -> dict:
    """Each routed-expert parameter's (mesh dims, placements)."""
    out = {}
    for name, p in pm.named_parameters():
        if ".mlp.experts." in name:
            out[name] = (p.device_mesh.mesh_dim_names, tuple(str(x) for x in p.placements))
    return out


def _check_experts_whole_per_tp_rank(ranks: dict, degrees: dict, experts: int) -> None:
    """The experts sharded over ep only (FSDP2 over edp x tp): never split over tp, and each rank read only
    the checkpoint rows of its ep shard, whole."""
    per_rank = experts // degrees["ep"]
    holding = {rank: res for rank, res in ranks.items() if res["experts"]}  # at pp 2, stage 0's layers are dense
    assert len(holding) == degrees["dp"] * degrees["tp"], f"routed experts on ranks {sorted(holding)}"
    for rank, res in holding.items():
        for name, (mesh, placements) in res["experts"].items():
            assert mesh == ("edp_tp", "ep") and placements[1] == "S(0)", (rank, name, mesh, placements)
        mine = range(per_rank * (res["dp_rank"] % degrees["ep"]), per_rank * (res["dp_rank"] % degrees["ep"] + 1))
        read = {int(k.split(".experts.")[1].split(".")[0]) for k in res["keys_read"] if ".mlp.experts." in k}
        assert read == set(mine), f"rank {rank} read experts {sorted(read)}, holds {list(mine)}"


def run_case(kind: str, degrees: dict, tmp_path, options: dict | None = None, path=None) -> None:
    from hfpipe.models.moe import routed_experts
    from hfpipe.tiny import tiny_config

    path = path or tiny_checkpoint(kind, num_hidden_layers=LAYERS)
    world = degrees.get("pp", 1) * degrees["dp"] * degrees["tp"]
    out = tmp_path / "hf"
    ranks = run_ranks(_worker, world, str(path), degrees, options or {}, str(out))
    ref = _reference(str(path))
    for tp_rank in range(degrees["tp"]):  # every tp rank's loss rank hands back whole logits of its rows
        _check_logits(ref, {r: res for r, res in ranks.items() if res["tp_rank"] == tp_rank}, degrees["dp"], kind)
    check_equal(ref, {r: {"tp x ep": res["train"]} for r, res in ranks.items()}, ("tp x ep",))
    trained = {k: w for res in ranks.values() for k, w in res["train"]["weights"].items()}
    _check_export(path, out, trained)
    _check_experts_whole_per_tp_rank(ranks, degrees, routed_experts(tiny_config(kind))[0])


def test_deepseek_v3_pp2_dp2_ep2_tp2_matches_transformers(tmp_path):
    """MLA split by heads, the shared expert by columns and rows, the routed experts whole over ep."""
    run_case("deepseek_v3", dict(pp=2, dp=2, ep=2, tp=2), tmp_path)


def test_qwen3_moe_dp2_ep2_tp2_with_sequence_parallelism_matches_transformers(tmp_path):
    """pp 1: the MoE block gathers the sequence-split residual before the router and experts."""
    run_case("qwen3_moe", dict(pp=1, dp=2, ep=2, tp=2), tmp_path, {"sequence_parallel": True})


@pytest.mark.parametrize("kind, degrees, options", [
    ("deepseek_v3", dict(pp=2, dp=2, ep=2, tp=2), {"sequence_parallel": False}),
    ("qwen3_moe", dict(pp=1, dp=2, ep=2, tp=2), {"reshard_per_microbatch": True}),
    ("qwen3_moe", dict(pp=1, dp=4, ep=2, tp=2), {}),
], ids=["deepseek_v3-no-sequence-parallelism", "qwen3_moe-fsdp-resharded-per-microbatch", "qwen3_moe-edp2-x-tp2"])
def test_the_other_settings_match_transformers(kind, degrees, options, tmp_path):
    """Without sequence parallelism the MoE block's whole output joins the residual; FSDP2 resharding every
    microbatch; two replicas of each expert shard (edp 2), so the experts' FSDP2 mesh flattens edp and tp,
    which are not neighbours in the expert view (pp, edp, ep, cp, tp)."""
    run_case(kind, degrees, tmp_path, options)


def test_a_rank_whose_experts_get_no_token_still_matches(tmp_path):
    """Every token picks experts 0 and 1: ep rank 1's experts, on both of its tp ranks, receive nothing."""
    from test_parallel_expert import starved_checkpoint

    run_case("deepseek_v3", dict(pp=2, dp=2, ep=2, tp=2), tmp_path, path=starved_checkpoint("deepseek_v3"))


# --- a checkpoint saved under tp x ep, resumed without tp ------------------------------------------

def _resume_worker(path: str, degrees: dict, root: str, save: bool) -> dict:
    """``save``: train steps 1-2, checkpoint, train step 3. Else: resume the checkpoint, train step 3."""
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    dims = ParallelDims(**degrees)
    dist = init_distributed(dims)
    pm = load_pipeline(path, **degrees, schedule="1f1b", microbatches=2, method="even", dist=dist)
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=STEPS)
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    batches = [b for (b,) in make_batches(pm.source.config.vocab_size, steps=STEPS)]
    if save:
        for batch in batches[:2]:
            trainer.step(_rows(batch, dims.dp, dist.dp_rank))
        pm.save_checkpoint(root, 2, opt)
    else:
        load_checkpoint(latest_checkpoint(root), pm.view(), opt)
        for _ in range(2):
            sched.step()  # a LambdaLR: its state is the step count
    step = trainer.step(_rows(batches[2], dims.dp, dist.dp_rank))
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    return {"loss": [step.loss], "norm": [step.grad_norm], "weights": weights}


def test_a_tp2_x_ep2_checkpoint_resumes_exactly_at_tp1(tmp_path):
    """Saved at dp 2 x ep 2 x tp 2 (Qwen3-MoE) after 2 steps: step 3 after resuming at dp 2 x ep 2, tp 1,
    equals step 3 of the run that never stopped (DCP reshards the experts' and the tp-split DTensors)."""
    path = str(tiny_checkpoint("qwen3_moe", num_hidden_layers=LAYERS))
    root = str(tmp_path / "ckpt")
    saved = dict(pp=1, dp=2, ep=2, tp=2)
    want = _merged(run_ranks(_resume_worker, 4, path, saved, root, True))
    got = run_ranks(_resume_worker, 2, path, dict(saved, tp=1), root, False)
    check_equal(want, {r: {"tp 1": res} for r, res in got.items()}, ("tp 1",))
