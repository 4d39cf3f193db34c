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
        "deepseek_v2_lite_sft_pp4.yaml",
        "deepseek_v32_exp_sft_pp64_dp4.yaml",
        "deepseek_v3_sft_pp64_dp4.yaml",
        "deepseek_v4_flash_sft_pp46_dp4.yaml",
        "llama3_1_70b_lora_pp8.yaml",
        "llama3_1_70b_sft_pp16_dp2.yaml",
        "llama3_1_8b_sft_pp4.yaml",
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
    if cfg.pp * cfg.dp > 8:  # more than one 8-GPU node
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
    assert recipe.gpus == cfg.pp * cfg.dp
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


def test_deepseek_v3_layout_gives_one_layer_per_stage():
    cfg = FinetuneConfig.from_yaml(find_recipe("deepseek_v3_sft_pp64_dp4"))
    assert (cfg.pp, cfg.dp, cfg.vpp, cfg.schedule, cfg.layout) == (64, 4, 1, "1f1b", "E|(t|)*61,m|L")
    config = hf_config(cfg)
    assert config.num_hidden_layers == 61 and config.num_nextn_predict_layers == 1
    plan = plan_pipeline(config, cfg.pp, vpp=cfg.vpp, style=cfg.pipeline_style, layout=cfg.layout)
    stages = plan.stages
    assert len(stages) == 64
    assert stages[0].embed and stages[0].layers == ()
    assert [s.layers for s in stages[1:62]] == [(i,) for i in range(61)]
    assert stages[62].layers == () and stages[62].mtp == (61,)
    assert stages[63].layers == () and stages[63].head
