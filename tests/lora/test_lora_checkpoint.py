"""Spec of LoRA runs' checkpoints and exports (``hfpipe finetune --lora-rank``, ``hfpipe export``).

A LoRA checkpoint holds only what training changes: the adapters, their AdamW state, the scheduler,
the data position and the RNG, plus a pointer to the base model. It resumes bit for bit after a
``kill -9`` (against an uninterrupted run, the oracle), and at another pipeline size and schedule
within 1e-6. Its export is a PEFT adapter folder that ``PeftModel.from_pretrained`` loads with the
pipeline's logits; ``--merge`` gives the base checkpoint's files with the adapters merged, equal to
PEFT's ``merge_and_unload()``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _dist import run_ranks, tiny_checkpoint
from hfpipe.checkpoint.dcp import record_checksums
from hfpipe.export.hf_folder import ExportError, export_checkpoint
from hfpipe.config.run import ConfigError, FinetuneConfig
from hfpipe.train.runner import run_finetune
from test_checkpoint_dcp import (
    assert_same_state,
    copy_run,
    dcp_state,
    losses,
    metrics,
    start_run,
    step_dir,
    tensors,
    wait_for,
)

LAYERS = 4
STEPS, EVERY = 6, 2
RUN = dict(pp=2, batch_size=4, microbatches=4, seq_len=32, max_steps=STEPS, save_every=EVERY, keep=3, lr=1e-2,
           warmup_steps=0, threads_per_rank=1, lora_rank=4, lora_alpha=16, lora_targets="q_proj,v_proj,down_proj")
TOL = 1e-5


def config(model, out, **overrides) -> FinetuneConfig:
    return FinetuneConfig(model=str(model), output_dir=str(out), **{**RUN, **overrides})


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_checkpoint("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict:
    """The oracle: 6 uninterrupted LoRA steps at pp=2, checkpoints at 2, 4, 6, the adapter exported."""
    out = tmp_path_factory.mktemp("lora_reference")
    result = run_finetune(config(base, out, save_hf_at_end=True))
    return {"out": out, "losses": losses(result["history"]), "final": dcp_state(step_dir(out, STEPS))}


def test_a_checkpoint_holds_adapters_optimizer_rng_and_a_pointer_to_the_base(base, reference):
    state, meta = reference["final"], json.loads((step_dir(reference["out"], STEPS) / "hfpipe.json").read_text())
    model = [k for k in state if k.startswith("model.")]
    assert model and all(".lora_A.default." in k or ".lora_B.default." in k for k in model)
    assert len(model) == 2 * 3 * LAYERS  # A and B of q_proj, v_proj, down_proj in every layer
    assert all(k.split(".")[0] in ("model", "optim", "rng") for k in state)
    assert all(".lora_" in k for k in state if k.startswith("optim.state."))
    assert meta["source"] == str(base) and meta["lora"]["r"] == 4 and meta["lora"]["lora_alpha"] == 16
    assert sorted(meta["lora"]["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert set(meta["train"]) == {"position", "scheduler"}
    # rank 4 on q_proj (64 -> 64), v_proj (64 -> 32) and down_proj (128 -> 64): r * (in + out) each
    assert sum(state[k].numel() for k in model) == LAYERS * 4 * ((64 + 64) + (64 + 32) + (128 + 64))
    for moment in ("exp_avg", "exp_avg_sq"):  # Adam state: one fp32 tensor per adapter, nothing else
        adam = {k.removeprefix("optim.state.").removesuffix("." + moment): v for k, v in state.items()
                if k.startswith("optim.state.") and k.endswith("." + moment)}
        assert sorted(adam) == sorted(k.removeprefix("model.") for k in model)
        assert all(v.dtype == torch.float32 for v in adam.values())


# --- resume -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def killed(base, tmp_path_factory) -> dict:
    """The reference run as its own process, one worker SIGKILLed after step 3."""
    tmp = tmp_path_factory.mktemp("lora_killed")
    out, pids = tmp / "out", tmp / "pids"
    pids.mkdir()
    proc = start_run(config(base, out), tmp, pids=pids, sleep=1.0)
    wait_for(proc, lambda: step_dir(out, 2).is_dir() and len(metrics(out)) >= 3 and (pids / "rank1").exists())
    os.kill(int((pids / "rank1").read_text()), signal.SIGKILL)
    return {"out": out, "returncode": proc.wait(timeout=120)}


@pytest.mark.slow
def test_kill_9_then_resume_auto_ends_bit_identical_to_the_uninterrupted_run(base, reference, killed):
    assert killed["returncode"] != 0 and not step_dir(killed["out"], STEPS).exists()
    resumed = run_finetune(config(base, killed["out"], resume="auto"))
    start = min(losses(resumed["history"])) - 1
    assert start >= 2
    assert losses(resumed["history"]) == {s: v for s, v in reference["losses"].items() if s > start}
    assert_same_state(dcp_state(step_dir(killed["out"], STEPS)), reference["final"])


@pytest.mark.slow
def test_a_pp2_1f1b_checkpoint_resumes_at_pp3_with_gpipe(base, reference, tmp_path):
    out = copy_run(reference["out"], tmp_path / "out", upto=2)
    resumed = run_finetune(config(base, out, pp=3, schedule="gpipe", resume="auto"))
    got, want = losses(resumed["history"]), {s: v for s, v in reference["losses"].items() if s > 2}
    assert sorted(got) == sorted(want)
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6
    final = dcp_state(step_dir(out, STEPS))
    trained = [k for k in reference["final"] if not k.startswith("rng.")]
    assert sorted(k for k in final if not k.startswith("rng.")) == sorted(trained)
    for key in trained:
        if key.startswith(("model.", "optim.state.")):
            torch.testing.assert_close(final[key], reference["final"][key], rtol=0, atol=1e-6, msg=key)


def test_a_full_checkpoint_is_not_resumed_as_lora(base, reference, tmp_path):
    out = copy_run(reference["out"], tmp_path / "out", upto=2)
    from hfpipe.train.resume_check import ResumeMismatch

    # the resume check names every setting that differs (here only the LoRA ones)
    with pytest.raises(ResumeMismatch, match=r"--lora-rank 4 -> None"):
        run_finetune(config(base, out, resume="auto", lora_rank=None, lora_alpha=None, lora_targets="all-linear"))


# --- export -------------------------------------------------------------------------------------


def logits_worker(ckpt: str, ids: torch.Tensor, api_out: str) -> torch.Tensor | None:
    """The pipeline's logits with the checkpoint's adapters, loaded at pp=2; then
    ``pm.save_pretrained(api_out)``, which writes a PEFT adapter folder for a LoRA pipeline."""
    from hfpipe.api import load_pipeline
    from hfpipe.checkpoint.dcp import load_checkpoint
    from hfpipe.lora.adapters import config_from_dict

    meta = json.loads((Path(ckpt) / "hfpipe.json").read_text())
    pm = load_pipeline(meta["source"], pp=2, lora=config_from_dict(meta["lora"]))
    load_checkpoint(ckpt, pm.view(), None)
    logits = pm.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    pm.save_pretrained(api_out)
    torch.distributed.destroy_process_group()
    return logits


@pytest.fixture(scope="module")
def pipeline_logits(reference, tmp_path_factory) -> dict:
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    api_out = tmp_path_factory.mktemp("api") / "adapter"
    results = run_ranks(logits_worker, 2, str(step_dir(reference["out"], STEPS)), ids, str(api_out))
    return {"ids": ids, "logits": next(r for r in results.values() if r is not None), "api_out": api_out}


def _peft(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


def test_the_adapter_export_loads_in_peft_with_the_pipeline_logits(base, reference, pipeline_logits):
    from peft import get_peft_model_state_dict

    hf = reference["out"] / "hf"  # save_hf_at_end of a LoRA run writes the adapter folder
    assert sorted(p.name for p in hf.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "hfpipe_export.json"]
    cfg = json.loads((hf / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["peft_type"] == "LORA" and cfg["r"] == 4
    model = _peft(base, hf)
    saved = load_file(hf / "adapter_model.safetensors")
    assert sorted(saved) == sorted(get_peft_model_state_dict(model))  # PEFT's own key names
    assert all(k.startswith("base_model.model.model.layers.") and ".default" not in k for k in saved)
    with torch.no_grad():
        got = model(pipeline_logits["ids"]).logits
    assert (got - pipeline_logits["logits"]).abs().max().item() <= TOL
    assert (saved[next(k for k in saved if "lora_B" in k)]).abs().max() > 0  # it did train
    api = pipeline_logits["api_out"]  # pm.save_pretrained of a LoRA pipeline: the same folder
    assert_same_state(load_file(api / "adapter_model.safetensors"), saved)
    assert json.loads((api / "adapter_config.json").read_text()) == cfg


def test_the_merged_export_equals_peft_merge_and_unload(base, reference, pipeline_logits, tmp_path):
    from transformers import AutoModelForCausalLM

    merged = export_checkpoint(step_dir(reference["out"], STEPS), tmp_path / "merged", merge=True, progress=False)
    assert sorted(p.name for p in merged.glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    assert json.loads((merged / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    got, src = tensors(merged), tensors(base)
    assert sorted(got) == sorted(src) and all(got[k].dtype == src[k].dtype for k in src)
    changed = {k for k in src if not torch.equal(got[k], src[k])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(LAYERS)
                       for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    peft_merged = _peft(base, reference["out"] / "hf").merge_and_unload()
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = pipeline_logits["ids"]
    with torch.no_grad():
        want, ours = peft_merged(ids).logits, model(ids).logits
    assert (ours - want).abs().max().item() <= TOL
    assert (ours - pipeline_logits["logits"]).abs().max().item() <= TOL


def test_merge_of_a_full_fine_tuning_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")
    meta = {"format": 1, "step": 1, "source": str(tmp_path), "source_dtype": "float32", "tied": False, "config": {}}
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match="not a LoRA run's; export it without --merge"):
        export_checkpoint(ckpt, tmp_path / "out", merge=True)


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"lora_rank": 0}, "--lora-rank must be >= 1"),
    ({"lora_alpha": 32.0}, "--lora-alpha applies to LoRA runs only; add --lora-rank"),
    ({"lora_rank": 8, "lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\)"),
    ({"lora_rank": 8, "lora_targets": "q_proj v_proj"}, "--lora-targets must be all-linear or a comma list"),
])
def test_bad_lora_settings_name_the_flag(overrides, message):
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig(model="m", **overrides)


def test_lora_targets_matching_no_module_are_refused_before_any_process_starts(base, tmp_path):
    from hfpipe.lora.adapters import LoraError

    with pytest.raises(LoraError, match="--lora-targets qq_proj match no module of the llama model"):
        run_finetune(config(base, tmp_path / "out", lora_targets="qq_proj"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_verify_runs_an_adapter_folder_on_its_base_against_peft(reference):
    from hfpipe.verify import verify

    result = verify(reference["out"] / "hf", pp=2)
    assert result.passed and result.max_abs_diff <= TOL


def lora_checkpoint_from_peft(base: Path, ckpt: Path, targets, parameters=None) -> Path:
    """A LoRA checkpoint as the trainer writes it, from a PEFT model with random adapters."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hfpipe.checkpoint.base_record import base_record
    from hfpipe.lora.adapters import config_to_dict, resolve_config

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=parameters,
                        task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            state["model." + name.removeprefix("base_model.model.")] = 0.1 * torch.randn(p.shape, generator=g)
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    meta = {"format": 1, "step": 3, "source": str(base), "source_dtype": "bfloat16", "tied": False,
            "config": {"model": str(base)}, "lora": config_to_dict(resolve_config(config, model.base_model.model)),
            "base": base_record(base)}
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(ckpt)  # as every checkpoint hfpipe saves
    return ckpt


def test_a_bf16_base_merges_in_bf16_bit_for_bit_as_peft_merge_and_unload(tmp_path):
    from hfpipe.tiny import make_tiny_checkpoint

    base = make_tiny_checkpoint(tmp_path / "base", "llama", num_hidden_layers=2, dtype=torch.bfloat16, tokenizer=False)
    ckpt = lora_checkpoint_from_peft(base, tmp_path / "step-00000003", "all-linear")
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    merged = export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                                     adapter).merge_and_unload().state_dict()
    got, src = tensors(merged), tensors(base)
    assert sorted(got) == sorted(src) and all(t.dtype == torch.bfloat16 for t in got.values())
    assert sum(not torch.equal(got[k], src[k]) for k in src) == 2 * 7  # every linear layer but the head
    for key, t in got.items():
        assert torch.equal(t, want[key]), key


def test_adapters_on_fused_moe_experts_export_for_peft_and_merge_into_per_expert_tensors(tmp_path):
    """DeepSeek-V3's routed experts are one 3-D parameter in memory (PEFT's target_parameters) but
    per-expert tensors in the checkpoint: the adapter exports for PEFT, and the merge writes the
    per-expert tensors PEFT's merge_and_unload() + save_pretrained writes, bit for bit."""
    from peft import get_peft_model_state_dict

    base = tiny_checkpoint("deepseek_v3", num_hidden_layers=3)
    ckpt = lora_checkpoint_from_peft(base, tmp_path / "step-00000003", ["q_b_proj", "o_proj"],
                                     ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    model = _peft(base, adapter)
    saved = load_file(adapter / "adapter_model.safetensors")
    assert sorted(saved) == sorted(get_peft_model_state_dict(model))
    assert any(".mlp.experts.lora_A." in k for k in saved)
    merged = export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    model.merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    got, want, src = tensors(merged), tensors(tmp_path / "peft-merged"), tensors(base)
    assert sorted(got) == sorted(src) == sorted(want)
    changed = {k for k in src if not torch.equal(got[k], src[k])}
    assert any(".mlp.experts.5.up_proj." in k for k in changed) and any(".o_proj." in k for k in changed)
    for key in src:
        assert got[key].dtype == src[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("merge", [False, True])
def test_a_lora_export_is_written_whole_or_not_at_all(tmp_path, monkeypatch, merge):
    # The adapter and merged exports share full export's guards: OUT locked, a temporary folder,
    # nothing left behind on failure, files readable by the group as save_pretrained leaves them.
    import safetensors.torch

    from hfpipe.export import adapter
    from hfpipe.parallel.lock import FolderBusyError, FolderLock

    base = tiny_checkpoint("llama", num_hidden_layers=2)
    ckpt = lora_checkpoint_from_peft(base, tmp_path / "step-00000003", "all-linear")
    out = tmp_path / "out"
    held = FolderLock(tmp_path / ".out.lock", out, "OUT").acquire()
    try:
        with pytest.raises(FolderBusyError, match="OUT"):
            export_checkpoint(ckpt, out, merge=merge)
    finally:
        held.release()
    module, name = (safetensors.torch, "save_file") if merge else (adapter, "write_adapter")
    real = getattr(module, name)

    def fail_midway(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, name, fail_midway)
    with pytest.raises(ExportError, match=r"disk full while writing .*out .*the partial folder was removed"):
        export_checkpoint(ckpt, out, merge=merge)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["step-00000003"]
    monkeypatch.setattr(module, name, real)
    export_checkpoint(ckpt, out, merge=merge)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~_umask())}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
