"""The training method (``--method``) and preference training's settings: their names and their checks.

``--method dpo`` trains on preference pairs with TRL's DPO losses (``--beta``, ``--dpo-loss``); plain SFT
stays the default. The loss names are TRL 1.16's ``DPOConfig.loss_type`` values; a weighted sum of several
is TRL's ``loss_type`` list with ``loss_weights``, written ``sigmoid=1,sft=0.5``.
"""

from __future__ import annotations

import difflib
import importlib.util

from hfpipe.errors import ConfigError

__all__ = ["DPO_LOSSES", "TRAIN_METHODS", "check_method", "parse_dpo_loss"]

#: Training methods: supervised fine-tuning, and direct preference optimisation on preference pairs.
TRAIN_METHODS = ("sft", "dpo")
#: TRL's DPO loss types the pipeline computes pair by pair (:data:`hfpipe.loss.trl_dpo.LOSS_TYPES`, listed here so
#: that the config reads without torch) that need no setting beyond ``beta``: not ``exo_pair``, which needs TRL's
#: ``label_smoothing`` > 0, a setting ``hfpipe finetune`` does not have (``robust`` at 0 is ``sigmoid``'s loss).
#: ``aot``/``aot_unpaired`` sort over the whole batch, so a microbatch's loss would depend on the others'.
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
              "discopop", "sft", "sigmoid_norm")
#: The flags that only preference training reads, with their defaults.
_DPO_ONLY = {"beta": 0.1, "dpo_loss": "sigmoid"}
#: SFT's data flags that a preference run does not read, with their defaults.
_SFT_ONLY = {"format": "auto", "train_on_prompt": False}


def parse_dpo_loss(text: str) -> tuple[list[str], list[float]]:
    """``--dpo-loss`` as TRL's ``(loss_type, loss_weights)``: ``sigmoid`` or ``sigmoid=1,sft=0.5``.

    Raises:
        ConfigError: an unknown loss type (the closest named), a loss given twice, or a weight that is no number.
    """
    types, weights = [], []
    for part in (p.strip() for p in text.split(",")):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in DPO_LOSSES:
            close = difflib.get_close_matches(name, DPO_LOSSES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"--dpo-loss {name!r} is not a loss hfpipe runs; choose from {', '.join(DPO_LOSSES)}"
                              f", or weigh several as sigmoid=1,sft=0.5{hint}")
        if name in types:
            raise ConfigError(f"--dpo-loss names {name} twice; give each loss once")
        try:
            value = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ConfigError(f"--dpo-loss {part!r}: the weight after '=' must be a number") from None
        types.append(name)
        weights.append(value)
    return types, weights


def check_method(c) -> None:
    """``--method`` and the flags that go with it, on a FinetuneConfig ``c``."""
    if c.method not in TRAIN_METHODS:
        close = difflib.get_close_matches(c.method.lower(), TRAIN_METHODS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"--method must be one of {', '.join(TRAIN_METHODS)}; got {c.method!r}{hint}")
    if c.method == "sft":
        for name, default in _DPO_ONLY.items():
            if getattr(c, name) != default:
                raise ConfigError(f"--{name.replace('_', '-')} applies to preference training; add --method dpo")
        return
    if importlib.util.find_spec("trl") is None:
        raise ConfigError("--method dpo needs TRL: pip install 'hfpipe[trl]'")
    if c.beta <= 0:
        raise ConfigError(f"--beta must be > 0, got {c.beta}")
    parse_dpo_loss(c.dpo_loss)
    for name, default in _SFT_ONLY.items():
        if getattr(c, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to --method dpo: preference data is read "
                              "in TRL's formats (prompt/chosen/rejected) and trains on the completions; drop it")
    if c.cp > 1:
        raise ConfigError(f"--cp {c.cp} with --method dpo: a pair's log-probs would be summed over cp ranks, which the "
                          "preference loss does not do yet; use --cp 1 (--tp or --pp split long pairs too)")
    if c.evaluates:
        raise ConfigError("--method dpo does not evaluate yet; drop --eval-dataset, --eval-split and --eval-fraction")
