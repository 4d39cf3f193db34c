"""Preference training's objective: TRL's DPO loss of each microbatch's pairs, on the last stage.

TRL's ``DataCollatorForPreference`` stacks a batch as ``[the B chosen rows; the B rejected rows]`` and its loss
takes each pair's two sequences together. torch's schedules cut a batch into microbatches of consecutive rows,
so :func:`pair_batch` interleaves them (``c0 r0 c1 r1 ...``): every microbatch then holds whole pairs.

On the last stage :class:`Preference` takes each row's per-token log-probs of its completion tokens (the
chunked head where the stage stops at its hidden states: no microbatch's whole logits are ever held; the
vocabulary-parallel form under tp), hands them to TRL's own loss code (:mod:`hfpipe.loss.trl_dpo`), and scales
the result so that the step is TRL's: each accumulation batch's mean over its pairs, divided by the
accumulation batches (as the Trainer divides a loss not normalised by ``num_items_in_batch``) and averaged over
dp. So each batch counts 1 (:meth:`Preference.count`) and each pair carries ``1 / pairs of its batch``.

A nonlinear loss of per-sequence sums cannot be taken chunk by chunk in one pass: the log-probs are read
first without gradients, TRL's loss gives each token's gradient, and the chunked head runs its backward
with those weights (:func:`hfpipe.loss.chunked.chunked_loss_sum`): one more head forward than SFT's loss.
"""

from __future__ import annotations

import torch

from hfpipe.loss.chunked import chunked_loss_sum, chunked_token_losses
from hfpipe.loss.objective import Head, Objective
from hfpipe.loss.tokens import IGNORE_INDEX, shift_labels
from hfpipe.loss.trl_dpo import REWARD_METRICS, PreferenceConfig, trl_dpo_loss, trl_ref_logps
from hfpipe.loss.vocab_parallel import vocab_parallel_token_losses

__all__ = ["Preference", "PreferenceConfig", "REWARD_METRICS", "pair_batch", "unpair_rows"]


def pair_batch(collated: dict, microbatches: int, ref: tuple | None = None) -> dict:
    """The pipeline's batch of a TRL preference batch: pairs interleaved, whole pairs per microbatch.

    Args:
        collated: ``DataCollatorForPreference``'s batch: ``input_ids``, ``attention_mask``,
            ``completion_mask`` (2B, T) chosen rows then rejected rows; ``ref_chosen_logps`` and
            ``ref_rejected_logps`` (B,) where precomputed.
        microbatches: The pipeline's microbatches: pairs are padded (copies of the last pair, weighing 0) to a
            multiple of it.
        ref: ``(chosen, rejected)`` reference log-probs, in place of the batch's (zeros when neither is given:
            the reference pass itself).

    Returns:
        ``input_ids``, ``attention_mask``, ``labels`` (TRL's: the completion tokens, ``IGNORE_INDEX``
        elsewhere), ``completion_mask``, ``ref_logps``, ``pair_weight`` (1 / B, 0 on added pairs) and
        ``chosen_tokens`` (the batch's chosen completion tokens: ``sft``'s divisor), rows ``c0 r0 c1 r1 ...``.
    """
    ids, mask = collated["input_ids"], collated["completion_mask"]
    pairs = ids.shape[0] // 2
    added = -pairs % microbatches
    index = torch.cat([torch.arange(pairs), torch.full((added,), pairs - 1, dtype=torch.long)])
    order = torch.stack([index, index + pairs], dim=1).flatten()  # (2B',): c0 r0 c1 r1 ...
    if ref is None and "ref_chosen_logps" in collated:
        ref = collated["ref_chosen_logps"], collated["ref_rejected_logps"]
    ref_rows = torch.zeros(2 * pairs) if ref is None else torch.cat([torch.as_tensor(r).flatten() for r in ref])
    weight = torch.full((2 * (pairs + added),), 1.0 / max(pairs, 1), dtype=torch.float64)
    weight[2 * pairs:] = 0.0
    chosen_tokens = float(mask[:pairs, 1:].sum())
    return {"input_ids": ids[order], "attention_mask": collated["attention_mask"][order],
            "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)[order], "completion_mask": mask[order],
            "ref_logps": ref_rows.to(torch.float64)[order.to(ref_rows.device)],
            "pair_weight": weight, "chosen_tokens": torch.full_like(weight, chosen_tokens)}


def unpair_rows(values: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row values of a :func:`pair_batch` batch back to ``(chosen, rejected)`` of its ``pairs`` real pairs."""
    return values[0:2 * pairs:2], values[1:2 * pairs:2]


class _Targets:
    """The columns of :meth:`Preference.targets`, one microbatch's rows (interleaved pairs)."""

    def __init__(self, targets: torch.Tensor) -> None:
        length = (targets.shape[1] - 3) // 2
        self.labels = targets[:, :length].long()  # (R, T) shifted: the token each position predicts
        self.completion = targets[:, length:2 * length].long()  # (R, T) the collator's completion mask
        self.ref = targets[:, 2 * length].float()  # (R,) the reference's log-prob of the row's completion
        self.weight = targets[0::2, 2 * length + 1]  # (R/2,) each pair's share of its batch's mean
        self.chosen_tokens = float(targets[0, 2 * length + 2])
        rows = targets.shape[0]
        self.order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(targets.device)


class Preference(Objective):
    """TRL's DPO loss over pairs (:mod:`hfpipe.loss.trl_dpo`), each batch's mean; see the module docstring.

    Each call appends a record of its microbatch to :attr:`records` (torch calls the loss once more when it
    builds a training schedule, first: read the newest with :meth:`take`). With :attr:`reference` set the loss
    is 0 and the records hold each pair's log-probs instead: the forward-only reference pass
    (:func:`hfpipe.train.reference.reference_logps`).

    Args:
        config: The loss settings (:class:`PreferenceConfig`, from a ``DPOConfig`` by ``from_trl``).
    """

    def __init__(self, config: PreferenceConfig) -> None:
        self.config = config
        self.reference = False
        self.records: list[dict] = []

    def targets(self, batch: dict) -> torch.Tensor:
        columns = [batch["pair_weight"], batch["chosen_tokens"]]
        return torch.cat([shift_labels(batch["labels"]).double(), batch["completion_mask"].double(),
                          batch["ref_logps"].double()[:, None], *(c.double()[:, None] for c in columns)], dim=1)

    def count(self, batch: dict) -> int:
        return 1  # a batch's pairs are averaged by their weights; the step divides by its batches (x dp)

    def take(self, rows: int) -> list[dict]:
        """The newest records covering ``rows`` rows (one batch), oldest first; all records are dropped."""
        out, seen = [], 0
        while self.records and seen < rows:
            out.append(self.records.pop())
            seen += out[-1]["rows"]
        self.records.clear()
        return out[::-1]

    def loss(self, out: torch.Tensor, targets: torch.Tensor, head: Head | None, denominator: float) -> torch.Tensor:
        t = _Targets(targets.to(out.device))
        tokens = self._token_logps(out, t.labels, head)  # (R, T), 0 off the completions
        lp, mask = tokens[t.order][:, :-1], t.completion[t.order]  # TRL's order and shapes: [chosen; rejected]
        if self.reference:
            chosen, rejected = trl_ref_logps(self.config, lp, mask)
            self.records.append({"rows": targets.shape[0], "chosen": chosen.detach(), "rejected": rejected.detach()})
            return tokens.sum() * 0.0
        train = head is not None and torch.is_grad_enabled() and out.requires_grad
        leaf = lp.detach().requires_grad_() if train else lp
        loss = self._pairs_loss(leaf, mask, t) / denominator
        if not train:
            return loss
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        weights = torch.zeros_like(tokens)
        if grad is not None:
            weights[t.order, :-1] = -grad  # d loss / d log-prob of each token, as a factor of its cross entropy
        surrogate = chunked_loss_sum(head.logits, out, t.labels, head.chunk, 1.0, weights=weights)
        return loss.detach() + (surrogate - surrogate.detach())  # TRL's value, the gradient through the head

    def _token_logps(self, out: torch.Tensor, labels: torch.Tensor, head: Head | None) -> torch.Tensor:
        if head is None:  # whole logits (a microbatch smaller than one chunk): plain autograd
            return -vocab_parallel_token_losses(out, labels, IGNORE_INDEX).view(labels.shape)
        return -chunked_token_losses(head.logits, out, labels, head.chunk)

    def _pairs_loss(self, lp: torch.Tensor, mask: torch.Tensor, t: _Targets) -> torch.Tensor:
        """The microbatch's part of its batch's loss: TRL's mean over its real pairs, times their share."""
        real = t.weight > 0
        pairs = int(real.sum())
        loss = lp.sum() * 0.0  # no real pair (added ones only): a zero still on the graph
        if not pairs:
            self.records.append({"rows": lp.shape[0], "pairs": 0})
            return loss
        keep = torch.cat([real, real])
        lp, mask = lp[keep], mask[keep]
        ref = t.ref[t.order][keep]
        ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
        share = pairs * float(t.weight[real][0])
        types = [(n, w) for n, w in zip(self.config.loss_type, self.config.weights) if n != "sft"]
        metrics = None
        if types:
            part, metrics = trl_dpo_loss(self.config, *zip(*types), lp, mask, ref_chosen, ref_rejected)
            loss = loss + part * share
        sft = [w for n, w in zip(self.config.loss_type, self.config.weights) if n == "sft"]
        chosen_tokens = float(mask[:pairs, 1:].sum())
        if sft and chosen_tokens:  # TRL's sft term is a token mean over the batch's chosen completions
            part, sft_metrics = trl_dpo_loss(self.config, ("sft",), (sum(sft),), lp, mask, ref_chosen, ref_rejected)
            loss = loss + part * (chosen_tokens / t.chosen_tokens)
            metrics = metrics or sft_metrics
        record = {"rows": t.labels.shape[0], "pairs": pairs}
        if metrics is not None:
            record.update({k: metrics[k] * pairs for k in REWARD_METRICS})
        self.records.append(record)
        return loss
