"""Every shipped recipe loads, names a bundled config transformers loads natively, plans, and fits
the GPUs its `# Fits:` line names according to `hfpipe plan`."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from hfpipe.config.run import ConfigError, FinetuneConfig, bundled_config_dir
from hfpipe.plan.split import plan_pipeline
from hfpipe.plan.fit import parse_memory, report_for
from hfpipe.recipes import RECIPE_DIR, Recipe, find_recipe, list_recipes

RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))


def header(path: Path) -> str:
    """The comment block a recipe opens with."""
    lines = path.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[:end])


def hf_config(cfg: FinetuneConfig):
    folder = bundled_config_dir(cfg.model)
    assert folder is not None, f"{cfg.model} has no bundled config.json in hfpipe/assets/configs"
    return AutoConfig.from_pretrained(folder)


def test_the_recipes_are_there():
    assert [p.name for p in RECIPES] == [
        "deepseek_v2_lite_sft_pp2_ep4.yaml",
        "deepseek_v32_exp_sft_pp8_ep32.yaml",
        "deepseek_v3_lora_fp8_pp2_ep4.yaml",
        "deepseek_v3_sft_pp8_ep32.yaml",
        "deepseek_v4_flash_lora_fp8_pp2_ep4.yaml",
        "deepseek_v4_flash_sft_pp4_ep32.yaml",
        "llama3_1_405b_sft_pp16_tp8.yaml",
        "llama3_1_70b_lora_pp8.yaml",
        "llama3_1_70b_qlora_pp2.yaml",
        "llama3_1_70b_sft_32k_pp16_cp4.yaml",
        "llama3_1_70b_sft_pp16_dp2.yaml",
        "llama3_1_70b_sft_pp3_tp8.yaml",
        "llama3_1_8b_sft_128k_cp8.yaml",
        "llama3_1_8b_sft_pp4.yaml",
        "llama3_2_1b_dpo_lora_pp2.yaml",
        "llama3_2_1b_lora_pp2.yaml",
        "llama3_2_1b_sft_pp2.yaml",
    ]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads(path):
    cfg = FinetuneConfig.from_yaml(path)
    assert cfg.batch_size % cfg.num_microbatches == 0
    assert 1e-5 <= cfg.lr <= (2e-4 if cfg.lora_rank else 2e-5)  # adapters train at a higher lr


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_opens_with_purpose_and_command(path):
    cfg, text = FinetuneConfig.from_yaml(path), header(path)
    assert text.count("\n") >= 3, "open with a comment: purpose, launch command, memory"
    assert f"hfpipe finetune --recipe {path.stem}" in text
    if cfg.pp * cfg.dp * cfg.cp * cfg.tp > 8:  # more than one 8-GPU node
        assert "torchrun --nnodes" in text and "srun" in text


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_model_is_bundled_and_native(path):
    config = hf_config(FinetuneConfig.from_yaml(path))
    assert type(config).__module__.startswith("transformers.models.")  # not remote code


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_plans(path):
    cfg = FinetuneConfig.from_yaml(path)
    config = hf_config(cfg)
    plan = plan_pipeline(config, cfg.pp, vpp=cfg.vpp, style=cfg.pipeline_style,
                         method=cfg.plan_method, layout=cfg.layout, seq_len=cfg.seq_len)
    assert len(plan.stages) == cfg.pp * cfg.vpp
    assert [i for s in plan.stages for i in s.layers] == list(range(config.num_hidden_layers))
    assert [s.embed for s in plan.stages] == [True] + [False] * (len(plan.stages) - 1)
    assert [s.head for s in plan.stages] == [False] * (len(plan.stages) - 1) + [True]
    assert plan.balance >= 1.0


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_fits_the_gpus_its_comment_names(path):
    recipe, cfg = Recipe.read(path), FinetuneConfig.from_yaml(path)
    assert recipe.gpus is not None, "name the GPUs in a `# Fits: N x SIZE GPUs` line"
    assert recipe.gpus == cfg.pp * cfg.dp * cfg.cp * cfg.tp
    report = report_for(hf_config(cfg), cfg)
    limit = parse_memory(recipe.gpu_memory)
    worst = max(r.total_bytes for r in report.ranks)
    assert worst <= 0.95 * limit, f"busiest rank {worst / 2**30:.1f} GiB on {recipe.gpu_memory} GPUs"
    assert f"hfpipe plan --recipe {path.stem} --gpu-memory {recipe.gpu_memory}" in header(path)


def test_recipes_are_found_by_name_and_by_their_old_path():
    assert find_recipe("llama3_1_8b_sft_pp4") == RECIPE_DIR / "llama3_1_8b_sft_pp4.yaml"
    assert find_recipe("recipes/llama3_1_8b_sft_pp4.yaml") == RECIPE_DIR / "llama3_1_8b_sft_pp4.yaml"
    with pytest.raises(ConfigError, match="did you mean llama3_1_8b_sft_pp4"):
        find_recipe("llama3_1_8b_sft")


def test_every_recipe_has_a_one_line_purpose():
    for recipe in list_recipes():
        assert recipe.purpose.endswith(".") and len(recipe.purpose) < 130, recipe.purpose


MOE_RECIPES = [p for p in RECIPES if p.stem.startswith("deepseek")]


@pytest.mark.parametrize("path", MOE_RECIPES, ids=lambda p: p.stem)
def test_moe_recipes_shard_experts_on_a_short_pipeline_with_a_small_bubble(path):
    # pp <= 8 with ep, bubble <= 15% of the step; the MTP layer takes no stage of its own
    recipe, cfg = Recipe.read(path), FinetuneConfig.from_yaml(path)
    report = report_for(hf_config(cfg), cfg)
    assert cfg.pp <= 8 and cfg.ep > 1 and cfg.dp % cfg.ep == 0
    assert report.bubble <= 0.15
    assert not [line for line in report.notes if "runs nothing" in line]
    if "sft" in path.stem and "v2_lite" not in path.stem:
        assert recipe.gpus <= 256
    if "lora" in path.stem or "v2_lite" in path.stem:
        assert recipe.gpus == 8 and cfg.pp * cfg.ep == 8  # one node


def test_the_full_sft_deepseek_v3_recipe_is_the_issues_plan():
    cfg = FinetuneConfig.from_yaml(find_recipe("deepseek_v3_sft_pp8_ep32"))
    assert (cfg.pp, cfg.dp, cfg.ep, cfg.num_microbatches, cfg.batch_size, cfg.seq_len, cfg.dtype,
            cfg.activation_checkpointing) == (8, 32, 32, 64, 64, 4096, "bf16-mixed", "full")


def test_quantized_lora_recipes_name_their_base():
    for name, kind in (("llama3_1_70b_qlora_pp2", "nf4"), ("deepseek_v3_lora_fp8_pp2_ep4", "fp8"),
                       ("deepseek_v4_flash_lora_fp8_pp2_ep4", "fp8")):
        cfg = FinetuneConfig.from_yaml(find_recipe(name))
        assert cfg.quantize_base == kind and cfg.lora_rank


def test_one_recipe_runs_on_cpu_processes_and_one_gpu():
    # A first run needs no cluster: a LoRA recipe on shipped data that plans at pp 2 and at pp 1.
    path = find_recipe("llama3_2_1b_lora_pp2")
    cfg, text = FinetuneConfig.from_yaml(path), header(path)
    assert cfg.lora_rank and cfg.pp == 2 and cfg.dataset.startswith("builtin:")
    assert "CPU" in text and "--pp 1" in text
    one_gpu = FinetuneConfig.from_yaml(path, pp=1)
    assert max(r.total_bytes for r in report_for(hf_config(one_gpu), one_gpu).ranks) <= 0.95 * parse_memory("24GB")


def test_the_tensor_parallel_recipes_keep_tp_inside_a_node_with_a_small_bubble():
    # tp at most the 8 GPUs of a node; 405B on 128 x 80 GB at 8k tokens (Megatron-Bridge's tp8 x pp16)
    for name in ("llama3_1_70b_sft_pp3_tp8", "llama3_1_405b_sft_pp16_tp8"):
        cfg = FinetuneConfig.from_yaml(find_recipe(name))
        report = report_for(hf_config(cfg), cfg)
        assert cfg.tp == 8 and cfg.sequence_parallel and report.bubble <= 0.15
    cfg = FinetuneConfig.from_yaml(find_recipe("llama3_1_405b_sft_pp16_tp8"))
    assert (cfg.pp, cfg.tp, cfg.dp, cfg.seq_len, cfg.dtype) == (16, 8, 1, 8192, "bf16-mixed")


def test_the_dpo_recipe_trains_preference_pairs_with_lora():
    cfg = FinetuneConfig.from_yaml(find_recipe("llama3_2_1b_dpo_lora_pp2"))
    assert (cfg.method, cfg.dataset, cfg.lora_rank, cfg.pp) == ("dpo", "builtin:tiny-preference", 16, 2)
    report = report_for(hf_config(cfg), cfg)
    assert report.method == "dpo" and report.microbatch_size == 2 * cfg.batch_size // cfg.num_microbatches
    assert max(report.reference.peak_bytes) < max(r.total_bytes for r in report.ranks)
