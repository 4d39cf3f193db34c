"""Spec of training checkpoints (``hfpipe.checkpoint.dcp``) as the runner writes and resumes them.

Everything runs in real gloo processes: ``finetune`` launches its workers, the kill tests start
it as a separate process and ``kill -9`` a worker. One uninterrupted run at pp=2 (``reference``)
is the oracle the interrupted and resumed runs must reproduce bit for bit (losses and every
model, optimizer and RNG tensor); a run resumed at another pp and schedule must match its own
uninterrupted run within 1e-6. Process start-up dominates the run time, so each launched run
serves several tests (module-scoped fixtures): 9 launches, about two minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint, folder_tensors as tensors
from hfpipe.checkpoint.dcp import CheckpointError, latest_checkpoint, load_checkpoint, resolve_resume
from hfpipe.export.hf_folder import export_checkpoint
from hfpipe.config.run import FinetuneConfig
from hfpipe.train.runner import run_finetune

LAYERS = 4
STEPS, EVERY = 6, 2  # checkpoints at steps 2, 4 and 6
RUN = dict(pp=2, batch_size=2, seq_len=32, max_steps=STEPS, save_every=EVERY, keep=3, lr=1e-3,
           warmup_steps=0, threads_per_rank=1)
BLOCK = 128  # DeepSeek-V3's FP8 weight block
REPO = Path(__file__).resolve().parents[2]


def config(model, out, **overrides) -> FinetuneConfig:
    return FinetuneConfig(model=str(model), output_dir=str(out), **{**RUN, **overrides})


def step_dir(out, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:08d}"


def dcp_state(ckpt) -> dict[str, object]:
    """Every entry of a DCP checkpoint (model, optimizer, RNG), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dump = Path(ckpt).parent / f".{Path(ckpt).name}.pt"
    dcp_to_torch_save(ckpt, dump)
    state = torch.load(dump, weights_only=True)
    dump.unlink()
    return _flatten(state)


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}.{key}".lstrip(".")).items()}


def assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def losses(history: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in history}


def metrics(out) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def copy_run(out, dst, upto: int) -> Path:
    """A new output folder holding ``out``'s checkpoints up to step ``upto`` (as if it stopped there)."""
    for ckpt in sorted((Path(out) / "checkpoints").glob("step-*")):
        if int(ckpt.name.removeprefix("step-")) <= upto:
            shutil.copytree(ckpt, Path(dst) / "checkpoints" / ckpt.name)
    return Path(dst)


# --- the runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(llama, tmp_path_factory) -> dict:
    """The oracle: 6 uninterrupted steps at pp=2 with checkpoints at 2, 4, 6 and an HF export."""
    out = tmp_path_factory.mktemp("reference")
    result = run_finetune(config(llama, out, save_hf_at_end=True))
    return {"out": out, "losses": losses(result["history"]), "final": dcp_state(step_dir(out, STEPS))}


# --- HF -> stages -> DCP -> HF ----------------------------------------------------------------


def stages_to_dcp_worker(jobs: list[tuple[str, str]]) -> None:
    """Load each source into pp=3 stages and save them untouched as a step-0 checkpoint."""
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import rank_view, save_checkpoint
    from hfpipe.parallel.mesh import init_distributed

    dist_info = init_distributed(3)
    for source, root in jobs:
        pm = load_pipeline(source, pp=3, dist=dist_info)
        cfg = pm.source.config
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        meta = {"format": 1, "source": source, "source_dtype": str(cfg.dtype or "float32").removeprefix("torch."),
                "tied": tied, "config": {}}
        save_checkpoint(root, 0, rank_view(pm.modules, tied), None, meta)
    torch.distributed.destroy_process_group()


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return q.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """kind -> (HF source, its export after HF -> pp=3 stages -> DCP), all in one launch."""
    from hfpipe.tiny import make_fp8_checkpoint, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("round_trip")
    base = make_tiny_checkpoint(root / "dsv3-256", "deepseek_v3", hidden_size=256, num_hidden_layers=LAYERS)
    sources = {
        "llama_tied": tiny_checkpoint("llama_tied", num_hidden_layers=LAYERS),
        "deepseek_v3": tiny_checkpoint("deepseek_v3", num_hidden_layers=LAYERS),
        "deepseek_v3_fp8": make_fp8_checkpoint(base, root / "fp8", block=BLOCK),
    }
    run_ranks(stages_to_dcp_worker, 3, [(str(src), str(root / kind)) for kind, src in sources.items()])
    return {kind: (src, export_checkpoint(root / kind / "step-00000000", root / f"{kind}-hf", progress=False))
            for kind, src in sources.items()}


@pytest.mark.parametrize("kind", ["llama_tied", "deepseek_v3"])
def test_stages_saved_untrained_export_the_source_bit_for_bit(round_trips, kind):
    src, out = round_trips[kind]
    want, got = tensors(src), tensors(out)
    assert sorted(got) == sorted(want)  # per-expert keys back; no lm_head when tied
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def test_an_fp8_source_round_trips_to_its_dequantised_weights_in_bf16(round_trips):
    src, out = round_trips["deepseek_v3_fp8"]
    fp8, got = tensors(src), tensors(out)
    assert sorted(got) == sorted(k for k in fp8 if not k.endswith("_scale_inv"))
    quantised = [k for k in got if k + "_scale_inv" in fp8]
    assert quantised and all(got[k].dtype == torch.bfloat16 for k in quantised)
    for key, t in got.items():
        if key in quantised:
            assert torch.equal(t, dequantise(fp8[key], fp8[key + "_scale_inv"]).to(torch.bfloat16)), key
        else:
            assert t.dtype == fp8[key].dtype and torch.equal(t, fp8[key]), key


# --- a fine-tuned export; async saves -------------------------------------------------------


def reload_worker(ckpt: str, ids: torch.Tensor, sync_root: str, async_root: str) -> torch.Tensor | None:
    """Load ``ckpt`` (model and optimizer) into fresh pp=2 stages and return the pipeline's logits.

    Then save that state twice at step 6, synchronously and with ``async_save``, and train a step
    while the async save is still pending: both checkpoints must hold the state before that step.
    """
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import rank_view, save_checkpoint
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    meta = json.loads((Path(ckpt) / "hfpipe.json").read_text())
    pm = load_pipeline(meta["source"], pp=2, dist=init_distributed(2))
    view, optimizer = rank_view(pm.modules, meta["tied"]), build_optimizer(pm.modules, lr=1.0)
    load_checkpoint(ckpt, view, optimizer)
    logits = pm.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    save_checkpoint(sync_root, STEPS, view, optimizer, meta)
    pending = save_checkpoint(async_root, STEPS, view, optimizer, meta, async_save=True)
    pm.trainer(optimizer).step({"input_ids": ids, "labels": ids})  # changes every weight meanwhile
    assert pending.wait().name == f"step-{STEPS:08d}"
    torch.distributed.destroy_process_group()
    return logits


@pytest.fixture(scope="module")
def reloaded(reference, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reloaded")
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    results = run_ranks(reload_worker, 2, str(step_dir(reference["out"], STEPS)), ids,
                        str(root / "sync"), str(root / "async"))
    logits = next(r for r in results.values() if r is not None)
    return {"ids": ids, "logits": logits, "sync": root / "sync", "async": root / "async"}


def test_a_finetuned_export_loads_in_transformers_with_the_pipeline_logits(reference, reloaded, llama, tmp_path):
    from transformers import AutoModelForCausalLM

    final, hf = step_dir(reference["out"], STEPS), reference["out"] / "hf"  # save_hf_at_end's export
    assert sorted(p.name for p in hf.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert_same_state(tensors(export_checkpoint(final, tmp_path / "hf", progress=False)), tensors(hf))
    trained, source = tensors(hf), tensors(llama)
    assert max((trained[k] - source[k]).abs().max().item() for k in source) > 1e-3  # it did train

    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        exported = model(reloaded["ids"]).logits
    assert (exported - reloaded["logits"]).abs().max().item() <= 1e-5


def test_an_async_save_writes_what_a_sync_save_writes(reference, reloaded):
    name = f"step-{STEPS:08d}"
    sync, async_ = reloaded["sync"] / name, reloaded["async"] / name
    assert [p.name for p in reloaded["async"].iterdir()] == [name]  # renamed; no .tmp left
    records = [json.loads((c / "hfpipe.json").read_text()) for c in (async_, sync)]
    assert [r.pop("checksums")["file"] for r in records] == ["checksums.json"] * 2  # of each one's own bytes
    assert records[0] == records[1]
    state = dcp_state(sync)
    assert_same_state(dcp_state(async_), state)
    # load then save gives back what training saved (bar the LR scheduler's initial_lr: none here)
    trained = {k: v for k, v in reference["final"].items() if not k.endswith(".initial_lr")}
    assert_same_state(state, trained)


# --- interrupted runs -------------------------------------------------------------------------

RUN_SCRIPT = '''
"""One finetune run in a process of its own, for tests that kill it. argv[1]: the config as JSON.

Faults come from the environment and are installed at import time, so the spawned workers (which
import this file as __mp_main__) install them too:
  HFPIPE_TEST_PIDS      folder where each worker writes rank<r> = its pid at every step
  HFPIPE_TEST_SLEEP     seconds each worker sleeps after every step (time to kill it mid-run)
  HFPIPE_TEST_DIE_SAVE  step whose save kills rank 1 (SIGKILL) right after its DCP write
"""
import json, os, signal, sys, time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hfpipe.train.step import StepEngine

_step, _save = StepEngine.step, dcp.save


def step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    if os.environ.get("HFPIPE_TEST_PIDS"):
        with open(os.path.join(os.environ["HFPIPE_TEST_PIDS"], f"rank{dist.get_rank()}"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("HFPIPE_TEST_SLEEP", "0")))
    return out


def save(state, *, checkpoint_id, **kwargs):
    out = _save(state, checkpoint_id=checkpoint_id, **kwargs)
    die = os.environ.get("HFPIPE_TEST_DIE_SAVE")
    if die and str(checkpoint_id).endswith(f"step-{int(die):08d}") and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


StepEngine.step, dcp.save = step, save

if __name__ == "__main__":
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.runner import run_finetune

    run_finetune(FinetuneConfig.from_dict(json.loads(sys.argv[1])))
'''


def start_run(cfg: FinetuneConfig, tmp_path: Path, **faults: str) -> subprocess.Popen:
    """``run_finetune(cfg)`` as a separate process (its launcher), with faults from :data:`RUN_SCRIPT`."""
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)
    env = {**os.environ, **{f"HFPIPE_TEST_{k.upper()}": str(v) for k, v in faults.items()}}
    with open(tmp_path / "run.log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen([sys.executable, str(script), json.dumps(cfg.to_dict())], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the test could interrupt it"
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def killed_mid_training(llama, tmp_path_factory) -> dict:
    """The reference run started as its own process, one worker killed with SIGKILL after step 3."""
    tmp = tmp_path_factory.mktemp("killed")
    out, pids = tmp / "out", tmp / "pids"
    pids.mkdir()
    proc = start_run(config(llama, out), tmp, pids=pids, sleep=1.0)
    wait_for(proc, lambda: step_dir(out, 2).is_dir() and len(metrics(out)) >= 3 and (pids / "rank1").exists())
    os.kill(int((pids / "rank1").read_text()), signal.SIGKILL)
    returncode = proc.wait(timeout=120)
    return {"out": out, "returncode": returncode, "steps_done": len(metrics(out)),
            "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir())}


def test_kill_9_of_one_worker_fails_the_run_and_resume_auto_finishes_it_exactly(llama, reference,
                                                                                killed_mid_training):
    run = killed_mid_training
    assert run["returncode"] != 0
    assert 3 <= run["steps_done"] < STEPS and f"step-{STEPS:08d}" not in run["checkpoints"]
    start = int(latest_checkpoint(run["out"] / "checkpoints").name.removeprefix("step-"))
    resumed = run_finetune(config(llama, run["out"], resume="auto"))
    assert losses(resumed["history"]) == {s: v for s, v in reference["losses"].items() if s > start}
    assert_same_state(dcp_state(step_dir(run["out"], STEPS)), reference["final"])
    assert [row["step"] for row in metrics(run["out"])][-(STEPS - start):] == list(range(start + 1, STEPS + 1))


@pytest.fixture(scope="module")
def killed_mid_save(llama, tmp_path_factory) -> dict:
    """The reference run as its own process; rank 1 SIGKILLs itself in the save of step 4, after
    DCP wrote the files and before the checkpoint is finalised (``hfpipe.json``, rename)."""
    tmp = tmp_path_factory.mktemp("killed_in_save")
    out = tmp / "out"
    returncode = start_run(config(llama, out), tmp, die_save=4).wait(timeout=300)
    ckpts = out / "checkpoints"
    return {"out": out, "returncode": returncode, "latest": latest_checkpoint(ckpts),
            "left": sorted(p.name for p in ckpts.iterdir()),
            "tmp_files": sorted(p.name for p in (ckpts / ".tmp-step-00000004").iterdir())}


@pytest.fixture(scope="module")
def resumed_after_crash(llama, killed_mid_save) -> dict:
    """``--resume auto`` of that run, saving asynchronously and keeping 2 checkpoints."""
    out = killed_mid_save["out"]
    result = run_finetune(config(llama, out, resume="auto", async_save=True, keep=2))
    return {"losses": losses(result["history"]), "left": sorted(p.name for p in (out / "checkpoints").iterdir())}


def test_a_crash_mid_save_leaves_the_previous_checkpoint_the_latest(killed_mid_save):
    run = killed_mid_save
    assert run["returncode"] != 0
    assert run["left"] == [".tmp-step-00000004", "step-00000002"]
    assert run["tmp_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # all but hfpipe.json
    assert run["latest"] == step_dir(run["out"], 2)
    assert resolve_resume("auto", run["out"]) == step_dir(run["out"], 2)


def test_resume_at_the_same_pp_is_bit_exact(reference, resumed_after_crash):
    assert resumed_after_crash["losses"] == {s: v for s, v in reference["losses"].items() if s > 2}


def test_async_saves_of_a_resumed_run_equal_the_sync_run_and_keep_prunes(reference, killed_mid_save,
                                                                         resumed_after_crash):
    out = killed_mid_save["out"]
    assert resumed_after_crash["left"] == ["step-00000004", "step-00000006"]  # keep=2; the .tmp replaced
    for step in (4, STEPS):
        assert_same_state(dcp_state(step_dir(out, step)), dcp_state(step_dir(reference["out"], step)))
    meta, ref = (json.loads((step_dir(o, STEPS) / "hfpipe.json").read_text()) for o in (out, reference["out"]))
    assert {k: meta[k] for k in ("step", "train", "world", "source")} == \
        {k: ref[k] for k in ("step", "train", "world", "source")}


# --- resharding -------------------------------------------------------------------------------

RESHARD = dict(batch_size=4, microbatches=4, max_steps=4, save_every=2)


@pytest.fixture(scope="module")
def pp4_interleaved(tmp_path_factory) -> dict:
    """4 steps at pp=4 with interleaved-1f1b (8 stages) of a tied Llama, saved at steps 2 and 4."""
    model = tiny_checkpoint("llama_tied", num_hidden_layers=8)
    out = tmp_path_factory.mktemp("pp4")
    result = run_finetune(config(model, out, pp=4, schedule="interleaved-1f1b", **RESHARD))
    return {"model": model, "out": out, "losses": losses(result["history"])}


def test_a_pp4_interleaved_checkpoint_resumes_at_pp2_with_1f1b(pp4_interleaved, tmp_path):
    run = pp4_interleaved
    meta = json.loads((step_dir(run["out"], 2) / "hfpipe.json").read_text())
    assert meta["world"] == {"pp": 4, "dp": 1, "ep": 1, "cp": 1, "tp": 1} and meta["config"]["schedule"] == "interleaved-1f1b"
    out = copy_run(run["out"], tmp_path / "out", upto=2)
    resumed = run_finetune(config(run["model"], out, pp=2, schedule="1f1b", resume="auto", **RESHARD))
    got, want = losses(resumed["history"]), {s: v for s, v in run["losses"].items() if s > 2}
    assert sorted(got) == sorted(want) == [3, 4]
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6
    final, ref = dcp_state(step_dir(out, 4)), dcp_state(step_dir(run["out"], 4))
    trained = [k for k in ref if not k.startswith("rng.")]  # model and optimizer: same names at any pp
    assert sorted(k for k in final if not k.startswith("rng.")) == sorted(trained)
    for key in trained:
        if key.startswith("model."):
            torch.testing.assert_close(final[key], ref[key], rtol=0, atol=1e-6, msg=key)


# --- damaged checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("damage", [".metadata", "hfpipe.json", "__1_0.distcp"])
def test_a_damaged_checkpoint_is_refused_naming_what_is_missing(reference, tmp_path, damage):
    out = copy_run(reference["out"], tmp_path / "out", upto=4)
    (step_dir(out, 4) / damage).unlink()
    with pytest.raises(CheckpointError, match=rf"step-00000004 is incomplete: {re.escape(damage)} missing"):
        resolve_resume(str(step_dir(out, 4)), out)
    with pytest.raises(CheckpointError, match=rf"{re.escape(damage)} missing"):
        load_checkpoint(step_dir(out, 4), torch.nn.Module(), None)
    if damage == "__1_0.distcp":  # still looks finished: --resume auto picks it, then refuses it
        with pytest.raises(CheckpointError, match="__1_0.distcp missing"):
            resolve_resume("auto", out)
    else:  # unfinished: skipped, the one before is the latest
        assert resolve_resume("auto", out) == step_dir(out, 2)


def test_a_corrupt_metadata_file_is_refused(reference, tmp_path):
    out = copy_run(reference["out"], tmp_path / "out", upto=2)
    (step_dir(out, 2) / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read"):
        resolve_resume("auto", out)


def test_resume_auto_without_checkpoints_starts_fresh_and_an_explicit_path_must_exist(tmp_path):
    assert resolve_resume("auto", tmp_path) is None
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        resolve_resume(str(tmp_path / "checkpoints" / "step-00000002"), tmp_path)
