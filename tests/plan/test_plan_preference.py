"""Spec of ``hfpipe plan --method dpo``: a pair is two sequences, and the reference pass is priced.

The reference pass is a forward-only pipelined pass before training: weights, one microbatch's working set
(stage input and output, one layer's work, a chunk's logits on the head rank), no gradients or optimizer.
"""

import pytest

from hfpipe.plan.activations import layer_bytes_per_token
from hfpipe.plan.report import format_report, plan_report
from hfpipe.tiny import tiny_config


def llama(layers=4):
    return tiny_config("llama", num_hidden_layers=layers)


def test_a_dpo_step_of_b_pairs_costs_an_sft_step_of_2b_sequences():
    config = llama()
    sft = plan_report(config, 2, seq_len=16, batch_size=8, dtype="fp32")
    dpo = plan_report(config, 2, seq_len=16, batch_size=4, dtype="fp32", train_method="dpo")
    assert dpo.microbatch_size == sft.microbatch_size == 4  # 2 pairs of a microbatch: 4 sequences
    assert [s.activation_bytes for s in dpo.stages] == [s.activation_bytes for s in sft.stages]
    assert [r.total_bytes for r in dpo.ranks] == [r.total_bytes for r in sft.ranks]
    assert sft.reference is None and "reference pass" not in format_report(sft)
    assert "8 sequences = 4 pairs" in format_report(dpo)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_the_reference_pass_holds_weights_and_one_microbatchs_working_set(dtype):
    config = llama()
    seq, pairs_per_mb = 16, 2
    report = plan_report(config, 2, seq_len=seq, batch_size=2 * pairs_per_mb, dtype=dtype, train_method="dpo")
    ref, act = report.reference, {"fp32": 4, "bf16-mixed": 2}[dtype]
    per_layer = layer_bytes_per_token(config, dtype)
    tokens = 2 * pairs_per_mb * seq  # both halves of the microbatch's pairs
    boundary = 2 * config.hidden_size * act * tokens  # the stage's input and output
    assert ref.activation_bytes[0] == boundary + max(per_layer[:2]) * tokens
    head = tokens * config.vocab_size * (act + 4)  # one chunk: the whole microbatch at this vocabulary
    assert ref.activation_bytes[1] == boundary + max(per_layer[2:]) * tokens + head
    for rank, peak, held in zip(report.ranks, ref.peak_bytes, ref.activation_bytes):
        assert peak == rank.weight_bytes + held < rank.total_bytes  # no gradients, optimizer, backward
    assert ref.compute_share == pytest.approx(1 / 3) and ref.bubble == pytest.approx(1 / 3)
    assert "reference pass (dpo, before training, forward only)" in format_report(report)


@pytest.mark.parametrize("lora, ac, share", [(None, "full", 1 / 4), (4, "none", 1 / 2), (4, "full", 1 / 3)])
def test_the_reference_pass_is_one_forward_of_a_steps_forwards_and_backwards(lora, ac, share):
    """A step is a forward and a backward of two forwards' work (one under LoRA: no base weight gradients),
    and one more forward under full activation checkpointing."""
    report = plan_report(llama(), 2, seq_len=16, batch_size=2, train_method="dpo", activation_checkpointing=ac,
                         lora_rank=lora)
    assert report.reference.compute_share == pytest.approx(share)


def test_hfpipe_plan_method_dpo_prints_pairs_and_the_reference_pass(tmp_path):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    llama().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--pp", "2", "--seq-len", "16", "--batch-size", "2", "--method", "dpo"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "4 sequences = 2 pairs" in result.output and "reference pass (dpo, before training" in result.output
