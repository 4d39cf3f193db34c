"""Expert parallelism (``--ep``) around the run: loading only a rank's experts (per-expert, fused 3-D
and FP8 block-scaled checkpoints), resuming an ep checkpoint at another ep, dp and pp, exporting a
fused source in its own layout, and the issue's check through ``hfpipe finetune``.

The oracles are those of tests/parallel/test_parallel_expert.py (one-process transformers, and the run that
never stopped); everything here is in the slow suite but the checks the default slice already makes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint
from test_parallel_expert import MESHES, _full, _rows, _source_specs, run_case
from test_models_table import LAYERS, STEPS, _optimizer
from test_train_equivalence import HP, check_equal, make_batches


# --- checkpoints ----------------------------------------------------------------------------------

def _resume_worker(path: str, mesh: tuple, root: str, save: bool, options: dict | None = None) -> dict:
    """``save``: train steps 1-2, checkpoint, train step 3. Else: resume the checkpoint, train step 3.
    ``options``: more ``load_pipeline`` arguments (``lora``: a ``LoraConfig``'s keywords)."""
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from hfpipe.parallel.mesh import init_distributed

    options = dict(options or {})
    if "lora" in options:
        from test_lora_equivalence import lora_config

        options["lora"] = lora_config(options["lora"])
    pp, dp, ep, schedule, micro, layout = mesh
    dist = init_distributed(pp, dp)
    pm = load_pipeline(path, pp=pp, dp=dp, ep=ep, schedule=schedule, microbatches=micro, layout=layout,
                       method="even", dist=dist, **options)
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
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    dist = init_distributed(ParallelDims(pp=1, dp=ep, ep=ep))
    source = ModelSource.open(path)
    (stage,), stats = load_rank_stages(source, plan_pipeline(source.config, 1), 0, dist.device,
                                       expert_mesh=dist.expert_mesh())
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
    from hfpipe.pipeline.build import load_rank_stages
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
    from hfpipe.pipeline.build import load_rank_stages
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
