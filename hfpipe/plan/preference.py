"""What preference training (``--method dpo``) adds to a plan: two sequences a pair, and the reference pass.

A DPO step runs both completions of each pair (TRL's batch is ``[all chosen; all rejected]``), so every
microbatch of ``b`` pairs is ``2b`` sequences: its activations and tokens are twice an SFT microbatch's
of ``b`` rows (the report is priced on sequences; :func:`sequences_per_pair`).

Before training, a forward-only pipelined pass over every pair computes the reference log-probs (stored with
the run, so the reference model never stays resident). It keeps no gradients and no optimizer state (the
optimizer has taken no step yet), and no activations for a backward: a rank holds its weights, the input of
the stage it runs (one microbatch's hidden states), the working set of one decoder layer on one microbatch
(at most what the layer keeps for its backward, measured by :mod:`hfpipe.plan.activations`), and on the head
rank one chunk's logits and fp32 log-probabilities (:mod:`hfpipe.loss.chunked`; the whole microbatch's
when it is one chunk). Its compute is one forward of each pair: a third of a training step's per pair
(forward + backward counted as 1 + 2), a quarter under full activation checkpointing (which recomputes the
forward); a half (a third) under LoRA, whose backward computes no weight gradients of the frozen base. The
forward-only schedule idles ``(p - 1) / (m + p - 1)`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfpipe.loss.budget import chunk_tokens
from hfpipe.plan.memory import ACT_BYTES

__all__ = ["ReferencePass", "describe_reference", "reference_pass", "sequences_per_pair"]


def sequences_per_pair(method: str) -> int:
    """Sequences a row of ``--batch-size`` stands for: 2 under ``dpo`` (chosen and rejected), else 1."""
    return 2 if method == "dpo" else 1


@dataclass(frozen=True)
class ReferencePass:
    """The reference pass's price: per pipeline rank, its peak bytes (weights included) and their activations."""

    peak_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    compute_share: float  # of a training step's compute over the same pairs
    bubble: float  # idle share of the forward-only schedule


def reference_pass(plan, ranks, config, *, tokens: int, per_layer: tuple[int, ...], hidden_elements: int,
                   dtype: str, microbatches: int, activation_checkpointing: str, tp: int = 1,
                   sp: bool = False, lora: bool = False) -> ReferencePass:
    """Price the forward-only reference pass of ``plan`` (see the module docstring).

    Args:
        plan: The :class:`hfpipe.plan.split.Plan`.
        ranks: The training run's :class:`hfpipe.plan.report.RankReport` per pipeline rank (their weights).
        config: The model config.
        tokens: One microbatch's tokens on one rank (both halves of its pairs; a cp rank's part).
        per_layer: Bytes per token each decoder layer keeps for backward, on one tensor-parallel rank.
        hidden_elements: Elements per token of the hidden states between stages.
        dtype, microbatches, activation_checkpointing, tp, sp: As the run's.
        lora: Whether the run trains adapters only (its backward is one forward's work, not two).
    """
    act = ACT_BYTES[dtype]
    boundary = hidden_elements * act / (tp if sp else 1)
    chunk = chunk_tokens(config.vocab_size)
    head_tokens = chunk if 0 < chunk < tokens else tokens
    peaks, acts = [], []
    for rank, report in zip(range(plan.pp), ranks):
        stages = plan.stages_of_rank(rank)
        layers = [per_layer[i] for s in stages for i in s.layers]
        held = tokens * (2 * boundary + max(layers, default=0))  # a stage's input and output, one layer's work
        if any(s.head for s in stages):
            held += head_tokens * config.vocab_size * (act + 4) / tp
        acts.append(int(held))
        peaks.append(int(report.weight_bytes + report.transient_bytes + held))
    p, m = plan.pp, microbatches
    step = (2 if lora else 3) + (activation_checkpointing == "full")  # in forwards: backward, recompute
    share = 1 / step
    return ReferencePass(tuple(peaks), tuple(acts), share, (p - 1) / (m + p - 1))


def describe_reference(ref: ReferencePass, size) -> str:
    """The plan report's line for the reference pass."""
    worst = max(range(len(ref.peak_bytes)), key=ref.peak_bytes.__getitem__)
    return (f"reference pass (dpo, before training, forward only): peak {size(ref.peak_bytes[worst])} on rank "
            f"{worst} (weights + {size(ref.activation_bytes[worst])} of one microbatch's working set; no "
            f"gradients or optimizer state), compute {ref.compute_share:.2f} of a training step per pair, bubble "
            f"{100 * ref.bubble:.1f}%; its log-probs are stored with the run")
