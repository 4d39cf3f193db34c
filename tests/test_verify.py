"""Spec of hfpipe.verify: a model folder's pipelined logits against transformers' own.

The end-to-end check starts real gloo processes (one test); its failure modes (broken folders,
bad options) fail before any process starts and are covered through the CLI in test_cli.py.
"""

from __future__ import annotations

import torch

from hfpipe.tiny import make_tiny_checkpoint
from hfpipe.verify import _compare, verify


def test_tiny_llama_at_pp2_matches_transformers(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama")
    result = verify(folder, pp=2, schedule="1f1b", tolerance=1e-5)
    assert result.passed
    assert result.max_abs_diff <= 1e-5 and result.kl <= 1e-9
    assert result.tokens == 2 * 32 - 32 // 4  # the padded quarter of the last row is left out
    assert result.summary().startswith("PASS")


def test_differing_logits_fail_with_a_positive_kl():
    ref = torch.randn(2, 4, 10)
    real = torch.ones(2, 4, dtype=torch.bool)
    real[1, 3] = False
    same = _compare(ref, ref.clone(), real, 1e-5, 2, "1f1b")
    assert same.passed and same.max_abs_diff == 0.0 and same.kl == 0.0 and same.tokens == 7
    got = ref.clone()
    got[0, 0, 0] += 1e-3
    got[1, 3] += 100.0  # a padded position: ignored
    worse = _compare(ref, got, real, 1e-5, 2, "1f1b")
    assert not worse.passed and worse.kl > 0
    assert abs(worse.max_abs_diff - 1e-3) < 1e-6
    assert worse.summary().startswith("FAIL")
