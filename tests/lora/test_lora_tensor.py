"""LoRA on tensor-parallel stages (``--lora-rank`` with ``--tp``) trains exactly as PEFT does in one process.

The oracle, batches and checks are ``tests/lora/test_lora_equivalence.py``'s (PEFT's ``get_peft_model`` on
transformers' model, full-batch AdamW with clipping; loss and grad norm per step within 1e-5, every
adapter after 3 steps within 1e-5 plus AdamW's derived drift, the base frozen). Here each stage is
also split over 2 tp ranks and PEFT's adapters are split as their base layers are
(:mod:`hfpipe.lora.tensor`); the adapters compared are whole (gathered over tp).
"""

from __future__ import annotations

import pytest

from test_lora_equivalence import DSV3_LORA, LORA, run_and_check

# DeepSeek-V3's MLA: q_a_proj whole, q_b_proj/kv_b_proj colwise, kv_a_proj_with_mqa whole with its rope
# gradient summed, o_proj rowwise. (PEFT turns gate/up/down_proj of a MoE model into the routed experts'
# parameters, which tp refuses: the MLPs are left out.)
DSV3_MLA_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])


@pytest.mark.slow
def test_lora_pp2_x_tp2_llama_matches_peft():
    """Sequence parallel (the default): rowwise adapters reduce-scatter by sequence."""
    run_and_check("llama", 2, ("1f1b",), options={"tp": 2})


@pytest.mark.slow
def test_lora_pp2_x_tp2_without_sequence_parallelism_tied_qwen3():
    """Qwen3's per-head q/k norms after colwise adapters; a tied embedding across the stages."""
    run_and_check("qwen3", 2, ("1f1b",), options={"tp": 2, "sequence_parallel": False})


@pytest.mark.slow
def test_lora_pp2_x_tp2_deepseek_v3_mla():
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_MLA_LORA, options={"tp": 2})


@pytest.mark.slow
def test_lora_dp2_x_pp2_x_tp2_matches_peft():
    """FSDP2 over dp on top of tp-split adapters (8 processes)."""
    run_and_check("llama", 2, ("1f1b",), dp=2, options={"tp": 2})


@pytest.mark.parametrize("kw, match", [
    (DSV3_LORA, "--tp 2 with LoRA on the routed experts"),
    ({**LORA, "target_modules": ["embed_tokens", "q_proj"]}, "--tp 2 with --lora-targets embed_tokens: the vocabulary"),
    ({**LORA, "lora_dropout": 0.1}, "--tp 2 with --lora-dropout 0.1: dropout masks"),
])
def test_what_tp_stages_cannot_adapt_is_refused_in_one_line(kw, match):
    from hfpipe.lora.adapters import LoraError
    from hfpipe.lora.tensor import check_tp_lora
    from test_lora_equivalence import lora_config

    with pytest.raises(LoraError, match=match) as e:
        check_tp_lora(lora_config(kw), 2)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_lora_pp2_x_dp2_x_ep2_x_tp2_deepseek_v3_mla():
    """The routed experts frozen and whole on each tp rank, sharded over ep (8 processes): the MLA adapters
    see the experts' outputs gathered back over tp."""
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_MLA_LORA, dp=2, options={"tp": 2, "ep": 2})
