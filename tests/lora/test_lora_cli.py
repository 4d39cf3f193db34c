"""The LoRA flags of ``hfpipe finetune`` and ``hfpipe plan``: parsed into the config, errors name the flag."""

from __future__ import annotations

import pytest
import yaml

from test_cli import assert_user_error, fake_runner, run, tiny  # noqa: F401 - fixtures


def test_lora_flags_reach_the_config_and_override_the_recipe(fake_runner, tiny, tmp_path):  # noqa: F811
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny), "lora_rank": 8, "lora_targets": "all-linear"}))
    result = run("finetune", "--recipe", recipe, "--lora-rank", 16, "--lora-alpha", 32, "--lora-dropout", 0.05,
                 "--lora-targets", "q_proj,k_proj,v_proj,o_proj")
    assert result.exit_code == 0, result.stderr
    ((config, _),) = fake_runner.calls
    assert (config.lora_rank, config.lora_alpha, config.lora_dropout) == (16, 32.0, 0.05)
    assert config.lora_targets == "q_proj,k_proj,v_proj,o_proj"
    from hfpipe.lora.adapters import from_finetune_config

    lora = from_finetune_config(config)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (16, 32.0, 0.05)
    assert lora.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_bad_lora_flags_are_one_line_errors_naming_the_flag(fake_runner, tiny):  # noqa: F811
    assert_user_error(run("finetune", tiny, "--lora-rank", 0), "--lora-rank must be >= 1")
    assert_user_error(run("finetune", tiny, "--lora-dropout", 0.1), "--lora-dropout applies to LoRA runs only")
    assert_user_error(run("finetune", tiny, "--lora-rank", 4, "--lora-alpha", -1), "--lora-alpha must be > 0")
    assert not fake_runner.calls


def test_plan_prices_a_lora_run(tiny):  # noqa: F811
    full, lora = run("plan", tiny, "--pp", 2, "--dtype", "bf16"), run("plan", tiny, "--pp", 2, "--dtype", "bf16",
                                                                      "--lora-rank", 4)
    assert full.exit_code == 0 and lora.exit_code == 0, lora.stderr
    assert "LoRA rank 4 on all-linear:" in lora.stdout and "LoRA" not in full.stdout
    assert_user_error(run("plan", tiny, "--pp", 2, "--lora-rank", 4, "--lora-targets", "nope"),
                      "--lora-targets nope match no module of the llama model")


def test_lora_configs_that_would_change_the_base_are_refused():
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hfpipe.lora.adapters import LoraError, resolve_config
    from hfpipe.tiny import tiny_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama_tied"))
    with pytest.raises(LoraError, match="init_lora_weights='pissa' is not supported"):
        resolve_config(LoraConfig(target_modules=["q_proj"], init_lora_weights="pissa"), meta)
    with pytest.raises(LoraError, match="tied embedding/head is not supported"):
        resolve_config(LoraConfig(target_modules=["q_proj", "lm_head"]), meta)
    with pytest.raises(LoraError, match="DoRA"):
        resolve_config(LoraConfig(target_modules=["q_proj"], use_dora=True), meta)


@pytest.mark.slow
def test_quickstart_lora_runs_offline_and_passes_against_peft(tmp_path):
    from test_cli_e2e import hfpipe

    run = hfpipe("quickstart", "--lora", "--out", "qs", "--steps", 12, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for marker in ("2/4 fine-tuning 12 steps at pp=2, LoRA rank 16", "(a PEFT adapter folder)",
                   "4/4 checking the export: PEFT in this process", "(PASS)", "after fine-tuning:"):
        assert marker in run.stdout, (marker, run.stdout)
    assert (tmp_path / "qs" / "run-lora" / "hf" / "adapter_model.safetensors").is_file()


def test_a_lora_command_opens_without_torchaos_import_noise(tiny, tmp_path):  # noqa: F811
    """PEFT imports torchao whenever it is installed (the qlora extra); torchao's import-time warnings
    (CUDA-only kernels that do not load here, torch's enum deprecation) stay out of hfpipe's output."""
    from test_cli_e2e import hfpipe

    run = hfpipe("plan", tiny, "--pp", 2, "--lora-rank", 4, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Failed to load" not in run.stderr and "_pytree" not in run.stderr, run.stderr[-2000:]
