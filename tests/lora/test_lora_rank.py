"""A LoRA rank is checked where it is read, before any process starts: a positive integer no wider than the
widest layer it adapts (an absurd rank once passed the checks and asked a worker for 512 GiB)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from hfpipe.lora.adapters import LoraError, resolve_config
from hfpipe.tiny import tiny_config
from test_cli import assert_user_error, run, tiny  # noqa: F401 - fixtures


def _meta(kind: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind))


@pytest.mark.parametrize("r", [0, -4, 2.5, True])
def test_a_rank_that_is_not_a_positive_integer_is_refused_naming_it(r):
    with pytest.raises(LoraError, match=r"--lora-rank \(LoraConfig.r\) must be an integer >= 1, got "):
        resolve_config(LoraConfig(r=r, target_modules="all-linear"), _meta("llama"))


#: The widest layer all-linear adapts: the tiny Llama's MLP (intermediate 128); on the tiny Qwen3-MoE, PEFT's
#: conversion adapts attention and the experts (64 wide), not the dense MLP (128) of its dense layer.
WIDEST = {"llama": 128, "qwen3_moe": 64}


@pytest.mark.parametrize("kind", sorted(WIDEST))
def test_a_rank_wider_than_every_adapted_layer_is_refused_and_the_widest_is_allowed(kind):
    meta, widest = _meta(kind), WIDEST[kind]
    resolve_config(LoraConfig(r=widest, target_modules="all-linear"), meta)
    with pytest.raises(LoraError, match=f"--lora-rank {2**31} is wider than every layer it adapts "
                                        f"\\(the widest is {widest}\\): pass at most {widest}"):
        resolve_config(LoraConfig(r=2**31, target_modules="all-linear"), meta)


def test_the_finetune_preflight_and_plan_refuse_an_absurd_rank_in_one_line(tiny, tmp_path):  # noqa: F811
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.runner import preflight

    cfg = FinetuneConfig(model=str(tiny), output_dir=str(tmp_path / "out"), lora_rank=2**31, max_steps=1, seq_len=64)
    with pytest.raises(LoraError, match=f"--lora-rank {2**31} is wider than every layer"):
        preflight(cfg, check_data=False)
    assert not (tmp_path / "out").exists()
    assert_user_error(run("plan", tiny, "--pp", 2, "--lora-rank", 2**31), f"--lora-rank {2**31} is wider")
