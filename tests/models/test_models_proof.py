"""Proof at load: a family outside the test table runs only if its stages are proven exact.

hfpipe builds a tiny random replica of the config, runs it as transformers does and stage by stage,
and accepts it (one log line, cached per config) only within 1e-5; otherwise it refuses naming the
part that differs. Refused families say why in one line (exit 2 from the CLI).
"""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel

from hfpipe.models.adapter import UnsupportedModelError
from hfpipe.models.registry import SUPPORTED_MODEL_TYPES
from hfpipe.models.support import get_adapter
from hfpipe.models.proof import replica_config
from _trust import error_lines

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_exact_family_outside_the_table_is_proven_and_cached(cache_dir, caplog):
    from transformers import StableLmConfig

    assert "stablelm" not in SUPPORTED_MODEL_TYPES
    config = StableLmConfig(**SMALL)
    with caplog.at_level(logging.INFO, logger="hfpipe.models.proof"):
        adapter = get_adapter(config)
    assert not adapter.tested
    assert [r.message for r in caplog.records if "proven equal" in r.message]
    [cached] = (cache_dir / "proofs").glob("stablelm-*.json")
    assert json.loads(cached.read_text())["ok"] is True


# Deliberately different forwards: registered as new families, so only the proof can judge them.
class ScaledEmbedConfig(LlamaConfig):
    model_type = "test_scaled_embed"


class ScaledEmbedModel(LlamaModel):
    config_class = ScaledEmbedConfig

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        return super().forward(inputs_embeds=self.embed_tokens(input_ids) * 2.0, **kwargs)


class ScaledEmbedForCausalLM(LlamaForCausalLM):
    config_class = ScaledEmbedConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = ScaledEmbedModel(config)


class ScaledLogitsConfig(LlamaConfig):
    model_type = "test_scaled_logits"


class ScaledLogitsForCausalLM(LlamaForCausalLM):
    config_class = ScaledLogitsConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out


@pytest.fixture(scope="module", autouse=True)
def registered():
    for cfg, model in ((ScaledEmbedConfig, ScaledEmbedForCausalLM), (ScaledLogitsConfig, ScaledLogitsForCausalLM)):
        AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
        AutoModelForCausalLM.register(cfg, model, exist_ok=True)


@pytest.mark.parametrize("config_cls, part", [(ScaledEmbedConfig, "embedding"), (ScaledLogitsConfig, "norm/head")])
def test_a_family_with_another_forward_is_refused_naming_the_part(config_cls, part, cache_dir):
    with pytest.raises(UnsupportedModelError, match=rf"not in hfpipe's tested table .* differs .* at {part} "):
        get_adapter(config_cls(**SMALL))
    # the refusal is cached as well: the second call does not run the replica again
    [cached] = (cache_dir / "proofs").glob(f"{config_cls.model_type}-*.json")
    assert json.loads(cached.read_text())["ok"] is False
    with pytest.raises(UnsupportedModelError, match=part):
        get_adapter(config_cls(**SMALL))


def test_the_replica_keeps_layer_types_and_per_layer_patterns():
    from transformers import Gemma3TextConfig, SmolLM3Config

    big = Gemma3TextConfig(num_hidden_layers=30, sliding_window_pattern=6, hidden_size=1024, head_dim=64)
    small = replica_config(big)
    assert small.hidden_size == 64 and small.num_hidden_layers == 7  # first global layer is index 5
    assert set(small.layer_types) == set(big.layer_types) and small.layer_types == big.layer_types[:7]
    smol = replica_config(SmolLM3Config(num_hidden_layers=36, no_rope_layer_interval=4))
    assert smol.no_rope_layers == SmolLM3Config(num_hidden_layers=36, no_rope_layer_interval=4).no_rope_layers[:smol.num_hidden_layers]
    assert set(smol.no_rope_layers) == {0, 1}


def test_refused_families_say_why_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app
    from transformers import FalconH1Config

    FalconH1Config(**SMALL).save_pretrained(tmp_path)
    result = CliRunner().invoke(app, ["plan", str(tmp_path), "--pp", "2"])
    assert result.exit_code == 2
    lines = error_lines(result.stderr)  # a progress line may come first on a loaded machine
    assert len(lines) == 1 and "'falcon_h1' is not supported: its Mamba layers" in lines[0], result.stderr
