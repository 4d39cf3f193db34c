"""Every shipped recipe loads, names a bundled config transformers loads natively, and plans."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from hfpipe.config import FinetuneConfig, bundled_config_dir
from hfpipe.plan import plan_pipeline

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))


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
        "deepseek_v32_exp_sft_pp16_vpp2.yaml",
        "deepseek_v3_sft_pp16_vpp2.yaml",
        "deepseek_v4_flash_sft_pp16_vpp2.yaml",
        "llama3_1_70b_sft_pp8_dp2.yaml",
        "llama3_1_8b_sft_pp4.yaml",
        "llama3_2_1b_sft_pp2.yaml",
    ]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads(path):
    cfg = FinetuneConfig.from_yaml(path)
    assert cfg.batch_size % cfg.num_microbatches == 0
    assert 1e-5 <= cfg.lr <= 2e-5


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_opens_with_purpose_and_command(path):
    cfg, text = FinetuneConfig.from_yaml(path), header(path)
    assert text.count("\n") >= 3, "open with a comment: purpose, launch command, memory"
    assert f"hfpipe finetune --recipe recipes/{path.name}" in text
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


def test_deepseek_v3_layout_gives_32_stages_over_61_layers():
    recipe = Path(__file__).parents[1] / "recipes" / "deepseek_v3_sft_pp16_vpp2.yaml"
    cfg = FinetuneConfig.from_yaml(recipe)
    assert (cfg.pp, cfg.vpp, cfg.schedule, cfg.layout) == (16, 2, "interleaved-1f1b", "Et*3|(tt|)*29,m|L")
    config = hf_config(cfg)
    assert config.num_hidden_layers == 61 and config.num_nextn_predict_layers == 1
    plan = plan_pipeline(config, cfg.pp, vpp=cfg.vpp, style=cfg.pipeline_style, layout=cfg.layout)
    stages = plan.stages
    assert len(stages) == 32
    assert stages[0].embed and stages[0].layers == (0, 1, 2)
    assert all(len(s.layers) == 2 for s in stages[1:30])
    assert stages[30].layers == () and stages[30].mtp == (61,)
    assert stages[31].layers == () and stages[31].head
    assert [s.index for s in plan.stages_of_rank(0)] == [0, 16]
