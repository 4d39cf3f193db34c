"""Spec of ``--method`` and preference training's flags: checked when the config is built, one line each."""

import pytest

from hfpipe.config.preference import DPO_LOSSES, parse_dpo_loss
from hfpipe.config.run import ConfigError, FinetuneConfig


def error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        FinetuneConfig(**{"model": "m", **kwargs})
    return str(info.value)


def test_sft_is_the_default_method():
    c = FinetuneConfig(model="m")
    assert (c.method, c.beta, c.dpo_loss) == ("sft", 0.1, "sigmoid")


def test_a_dpo_config_round_trips_through_a_recipe(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text("model: m\nmethod: dpo\nbeta: 0.5\ndpo_loss: sigmoid=1,sft=0.25\n")
    c = FinetuneConfig.from_yaml(path)
    assert (c.method, c.beta) == ("dpo", 0.5)
    assert parse_dpo_loss(c.dpo_loss) == (["sigmoid", "sft"], [1.0, 0.25])
    assert FinetuneConfig.from_dict(c.to_dict()) == c


def test_every_loss_offered_is_one_the_objective_computes():
    from hfpipe.loss.trl_dpo import LOSS_TYPES

    assert set(DPO_LOSSES) <= set(LOSS_TYPES)


@pytest.mark.parametrize("loss", DPO_LOSSES)
def test_every_trl_loss_type_is_accepted(loss):
    assert parse_dpo_loss(loss) == ([loss], [1.0])


MESSAGES = [
    (dict(method="kto"), "--method must be one of sft, dpo; got 'kto'"),
    (dict(method="DPO"), "--method must be one of sft, dpo; got 'DPO' (did you mean dpo?)"),
    (dict(beta=0.5), "--beta applies to preference training; add --method dpo"),
    (dict(dpo_loss="ipo"), "--dpo-loss applies to preference training; add --method dpo"),
    (dict(method="dpo", beta=0), "--beta must be > 0, got 0.0"),
    (dict(method="dpo", dpo_loss="sigmod"), "--dpo-loss 'sigmod' is not a loss hfpipe runs; choose from "
     + ", ".join(DPO_LOSSES) + ", or weigh several as sigmoid=1,sft=0.5 (did you mean sigmoid?)"),
    (dict(method="dpo", dpo_loss="sigmoid,sigmoid=2"), "--dpo-loss names sigmoid twice; give each loss once"),
    (dict(method="dpo", dpo_loss="sigmoid=x"), "--dpo-loss 'sigmoid=x': the weight after '=' must be a number"),
    (dict(method="dpo", format="chat"), "--format does not apply to --method dpo: preference data is read in "
     "TRL's formats (prompt/chosen/rejected) and trains on the completions; drop it"),
    (dict(method="dpo", cp=2), "--cp 2 with --method dpo: a pair's log-probs would be summed over cp ranks, which "
     "the preference loss does not do yet; use --cp 1 (--tp or --pp split long pairs too)"),
    (dict(method="dpo", eval_fraction=0.1), "--method dpo does not evaluate yet; drop --eval-dataset, "
     "--eval-split and --eval-fraction"),
]


@pytest.mark.parametrize("kwargs, message", MESSAGES, ids=[m for _, m in MESSAGES])
def test_validation_message(kwargs, message):
    assert error(**kwargs) == message


def test_dpo_without_trl_is_refused_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert error(method="dpo") == "--method dpo needs TRL: pip install 'hfpipe[trl]'"
