"""The preference objective: TRL's DPO loss of whole pairs per microbatch, summed to TRL's batch mean.

The spec, in one process: a batch as TRL collates it (chosen rows, then rejected rows) is interleaved so
that microbatches hold whole pairs; the loss of its microbatches, taken through the chunked head or on whole
logits, sums to the loss DPO defines on the whole batch (``-logsigmoid(beta * margin)``, averaged over the
pairs), with the same gradients; added pairs weigh nothing; the reference pass records each pair's log-probs.
The pipelined runs against TRL's ``DPOTrainer`` are ``tests/hf/test_hf_dpo.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfpipe.errors import ConfigError
from hfpipe.loss.objective import Head
from hfpipe.loss.preference import Preference, PreferenceConfig, pair_batch, unpair_rows

pytest.importorskip("trl", reason="the preference loss is TRL's own")

V, H, PAIRS, T, BETA = 40, 8, 4, 10, 0.2


def collated(seed: int = 0) -> dict:
    """TRL's DataCollatorForPreference layout: 4 chosen rows then 4 rejected rows, right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2 * PAIRS, T), generator=g)
    completion = torch.zeros(2 * PAIRS, T, dtype=torch.long)
    attention = torch.ones_like(completion)
    for i in range(2 * PAIRS):
        end = T - i % 4
        completion[i, 2 + i % 3:end] = 1
        attention[i, end:] = 0
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
            "ref_chosen_logps": torch.randn(PAIRS, generator=g), "ref_rejected_logps": torch.randn(PAIRS, generator=g)}


def dpo_by_definition(head, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """DPO's sigmoid loss on the whole batch, written out: each completion's summed token log-probs."""
    ids, mask = batch["input_ids"], batch["completion_mask"]
    logps = torch.log_softmax(head(hidden)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    seq = (logps * mask[:, 1:]).sum(1)
    margin = (seq[:PAIRS] - batch["ref_chosen_logps"]) - (seq[PAIRS:] - batch["ref_rejected_logps"])
    return -F.logsigmoid(BETA * margin).mean()


def test_pairs_are_interleaved_padded_with_pairs_that_weigh_nothing_and_labelled_on_their_completions():
    batch = collated()
    paired = pair_batch(batch, microbatches=3)  # 4 pairs -> 6: two added
    assert paired["input_ids"].shape == (12, T)
    order = [0, 4, 1, 5, 2, 6, 3, 7, 3, 7, 3, 7]
    assert torch.equal(paired["input_ids"], batch["input_ids"][order])
    assert paired["pair_weight"].tolist() == [0.25] * 8 + [0.0] * 4
    labels = paired["labels"]
    assert torch.equal(labels != -100, batch["completion_mask"][order].bool())
    chosen, rejected = unpair_rows(paired["ref_logps"], PAIRS)
    assert torch.equal(chosen.float(), batch["ref_chosen_logps"]) and torch.equal(rejected.float(),
                                                                                  batch["ref_rejected_logps"])


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_microbatch_losses_sum_to_dpo_on_the_whole_batch_with_its_gradients(chunk, microbatches):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    batch = collated()
    hidden = torch.randn(2 * PAIRS, T, H, requires_grad=True)
    want = dpo_by_definition(head, hidden, batch)
    want_grads = torch.autograd.grad(want, [hidden, head.weight])

    objective = Preference(PreferenceConfig(beta=BETA))
    paired = pair_batch(batch, microbatches)
    order = torch.stack([torch.arange(PAIRS), torch.arange(PAIRS) + PAIRS], 1).flatten()
    inner = hidden.detach()[order].clone().requires_grad_()
    targets, rows, total = objective.targets(paired), 2 * PAIRS // microbatches, 0.0
    for m in range(microbatches):
        part = slice(m * rows, (m + 1) * rows)
        out = inner[part] if chunk else head(inner[part])
        loss = objective.loss(out, targets[part], Head(head, chunk) if chunk else None, 1.0)
        loss.backward()
        total += float(loss.detach())
    assert abs(total - float(want)) <= 1e-6
    back = torch.empty_like(order)
    back[order] = torch.arange(2 * PAIRS)
    torch.testing.assert_close(inner.grad[back], want_grads[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, want_grads[1], rtol=0, atol=1e-6)
    records = objective.take(2 * PAIRS)
    assert sum(r["pairs"] for r in records) == PAIRS and len(records) == microbatches


def test_a_microbatch_of_added_pairs_adds_nothing():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    objective = Preference(PreferenceConfig(beta=BETA))
    batch = {k: v[[0, 4]] if v.ndim == 2 else v[:1] for k, v in collated().items()}  # one pair
    paired = pair_batch(batch, microbatches=2)
    hidden = torch.randn(4, T, H, requires_grad=True)
    targets = objective.targets(paired)
    loss = objective.loss(hidden[2:], targets[2:], Head(head, 3), 1.0)
    loss.backward()
    assert float(loss) == 0.0 and float(hidden.grad.abs().sum()) == 0.0


def test_the_reference_mode_records_each_pairs_completion_log_probs():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    batch = collated()
    hidden = torch.randn(2 * PAIRS, T, H)
    objective = Preference(PreferenceConfig(beta=BETA))
    objective.reference = True
    paired = pair_batch(batch, 1)
    order = torch.stack([torch.arange(PAIRS), torch.arange(PAIRS) + PAIRS], 1).flatten()
    with torch.no_grad():
        assert float(objective.loss(hidden[order], objective.targets(paired), Head(head, 3), 1.0)) == 0.0
    [record] = objective.take(2 * PAIRS)
    logps = torch.log_softmax(head(hidden)[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    seq = (logps * batch["completion_mask"][:, 1:]).sum(1)
    torch.testing.assert_close(record["chosen"], seq[:PAIRS].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(record["rejected"], seq[PAIRS:].detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(loss_type=("aot_unpaired",)), r"^loss_type='aot_unpaired' sorts the log-ratios over the whole batch"),
    (dict(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,)), r"^loss_weights=\[1.0\] needs one weight"),
    (dict(beta=0.0), r"^beta=0.0 must be positive"),
])
def test_a_loss_the_pipeline_cannot_take_per_microbatch_is_refused_in_one_line(change, match):
    with pytest.raises(ConfigError, match=match):
        PreferenceConfig(**change)


def test_a_cp_ranks_part_of_a_pair_is_refused_in_one_line():
    objective = Preference(PreferenceConfig())
    with pytest.raises(ConfigError, match=r"^preference training does not run under cp yet"):
        objective.targets({"shift_labels": torch.zeros(2, 4, dtype=torch.long)})
