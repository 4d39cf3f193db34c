"""TRL's DPO loss, run on the per-token log-probs the pipeline's last stage computes (TRL is the extra ``trl``).

TRL 1.16 writes its loss types inline in ``DPOTrainer._compute_loss`` (trl/trainer/dpo_trainer.py, from
"Get the log ratios" to ``loss += per_sequence_loss.mean() * loss_weight``): there is no function of the
log-probs to call. So that every ``loss_type`` (weighted lists, ``ld_alpha``, the f-divergences, label
smoothing) is TRL's by construction, :func:`trl_dpo_loss` calls that method itself with a stand-in for the
trainer (the few attributes the method reads, :class:`_TrainerView`) and for the model (:class:`_LogProbs`:
it returns the log-probs handed in, in the shape of TRL's fused LM head output). The metrics the method
computes from the logits (entropy, mean logits, token accuracy) get zeros and are not read.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from hfpipe.errors import ConfigError

__all__ = ["PreferenceConfig", "REWARD_METRICS", "trl_dpo_loss", "trl_ref_logps"]

#: The per-pair metrics TRL logs, under its names (each the batch mean).
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")

#: TRL's loss types computed from per-sequence log-probs pair by pair, plus ``sft`` (a token mean over the
#: chosen completions, normalised by the batch's chosen tokens). ``aot``/``aot_unpaired`` sort over the whole
#: batch, so one microbatch's loss would depend on the others': refused.
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
              "apo_down", "discopop", "sft", "sigmoid_norm")
_BATCH_WIDE = ("aot", "aot_unpaired")


@dataclass(frozen=True)
class PreferenceConfig:
    """The preference loss: ``DPOConfig``'s fields of the same names (TRL's defaults).

    Attributes:
        beta: DPO's beta (IPO's tau).
        loss_type: TRL's loss types, summed with ``loss_weights``.
        loss_weights: One weight per loss type, or ``None`` for all 1.
        label_smoothing: For ``robust``, ``exo_pair``.
        ld_alpha: LD-DPO's weight of the completion tokens past the shorter completion, or ``None``.
        f_divergence_type: ``reverse_kl`` (DPO), ``forward_kl``, ``js_divergence`` or ``alpha_divergence``.
        f_alpha_divergence_coef: The alpha of ``alpha_divergence``.
        discopop_tau: DiscoPOP's temperature.
    """

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 1.0
    discopop_tau: float = 0.05
    weights: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        object.__setattr__(self, "loss_type", types)
        for name in types:
            if name in _BATCH_WIDE:
                raise ConfigError(f"loss_type={name!r} sorts the log-ratios over the whole batch, so a microbatch's "
                                  "loss would depend on the others'; use a pairwise type (e.g. 'sigmoid', 'ipo')")
            if name not in LOSS_TYPES:
                raise ConfigError(f"loss_type={name!r} is not one of TRL's: {', '.join(LOSS_TYPES)}")
        weights = tuple(self.loss_weights) if self.loss_weights is not None else (1.0,) * len(types)
        if len(weights) != len(types):
            raise ConfigError(f"loss_weights={list(weights)} needs one weight per loss_type ({len(types)})")
        object.__setattr__(self, "weights", weights)
        if self.beta <= 0:
            raise ConfigError(f"beta={self.beta} must be positive")

    @classmethod
    def from_trl(cls, args) -> "PreferenceConfig":
        """The loss settings of a TRL ``DPOConfig``."""
        loss = args.loss_type
        return cls(beta=args.beta, loss_type=tuple([loss] if isinstance(loss, str) else loss),
                   loss_weights=None if args.loss_weights is None else tuple(args.loss_weights),
                   label_smoothing=args.label_smoothing, ld_alpha=args.ld_alpha,
                   f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
                   discopop_tau=args.discopop_tau)


class _TrainerView:
    """What ``DPOTrainer._compute_loss`` reads of its trainer (TRL 1.16), for one call on one microbatch."""

    def __init__(self, config: PreferenceConfig, types: tuple[str, ...], weights: tuple[float, ...], device):
        self.beta = config.beta
        self.loss_types, self.loss_weights = list(types), list(weights)
        self.ld_alpha = config.ld_alpha
        self.f_divergence_type = config.f_divergence_type
        self.f_alpha_divergence_coef = config.f_alpha_divergence_coef
        self.label_smoothing = config.label_smoothing
        self.args = SimpleNamespace(discopop_tau=config.discopop_tau, gradient_checkpointing_kwargs=None)
        self.precompute_ref_logps = True  # the reference log-probs ride in the inputs
        self.use_weighting = False
        self.aux_loss_enabled = False  # a MoE router loss is hfpipe's own (hfpipe.loss.objective.StageLoss)
        self.model = _Policy()
        self.ref_model = None
        self.accelerator = SimpleNamespace(device=device, gather=_same, gather_for_metrics=_same,
                                           autocast=contextlib.nullcontext)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        self._tp_size = 1


class _Policy(torch.nn.Module):
    """``self.model`` as the method asks it: training, not checkpointing, not a PEFT model (a module)."""

    is_gradient_checkpointing = False


def _same(x):
    return x  # one microbatch of one process: nothing to gather


class _LogProbs:
    """The model ``_compute_loss`` calls: TRL's fused LM head output, made of the log-probs handed in."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        self.log_probs = log_probs

    def __call__(self, **_):
        zeros = torch.zeros_like(self.log_probs.detach())
        return SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool(), aux_loss=None)


def _trl():
    try:
        from trl import DPOTrainer
    except ImportError as e:  # the optional extra
        raise ConfigError("preference training needs TRL: pip install 'hfpipe[trl]'") from e
    return DPOTrainer


def _inputs(completion_mask: torch.Tensor, **more) -> dict:
    """The collated batch ``_compute_loss`` reads: its completion mask (ids and attention are not read)."""
    rows, length = completion_mask.shape
    device = completion_mask.device
    return {"input_ids": torch.zeros(rows, length, dtype=torch.long, device=device),
            "attention_mask": torch.ones(rows, length, dtype=torch.long, device=device),
            "completion_mask": completion_mask, **more}


def trl_ref_logps(config: PreferenceConfig, log_probs: torch.Tensor,
                  completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's per-sequence log-probs ``(chosen, rejected)`` as TRL's ``compute_ref_log_probs`` sums
    them (``ld_alpha`` included), from the reference's per-token log-probs (rows and shapes as
    :func:`trl_dpo_loss`)."""
    view = _TrainerView(config, config.loss_type, config.weights, log_probs.device)
    with torch.no_grad():
        return _trl().compute_ref_log_probs(view, _LogProbs(log_probs), _inputs(completion_mask))


def trl_dpo_loss(config: PreferenceConfig, types: tuple[str, ...], weights: tuple[float, ...],
                 log_probs: torch.Tensor, completion_mask: torch.Tensor,
                 ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """TRL's DPO loss of a batch of pairs, and its reward metrics (batch means), from per-token log-probs.

    Args:
        config: The loss settings.
        types, weights: The loss types (of ``config``) this call sums, with their weights.
        log_probs: (2b, T-1) each row's log-prob of its next token, 0 where that token is not a completion
            token; rows in TRL's order, the b chosen then the b rejected completions.
        completion_mask: (2b, T) the collator's completion mask, rows in the same order.
        ref_chosen, ref_rejected: (b,) the reference's log-probs of the completions.

    Returns:
        ``(loss, metrics)``: the loss as TRL's ``_compute_loss`` returns it (the mean over the b pairs),
        differentiable in ``log_probs``, and TRL's values of :data:`REWARD_METRICS`.
    """
    view = _TrainerView(config, types, weights, log_probs.device)
    inputs = _inputs(completion_mask, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
    loss = _trl()._compute_loss(view, _LogProbs(log_probs), inputs, False)
    metrics = {k: view._metrics["train"][k][0] for k in REWARD_METRICS}
    return loss, metrics
