"""``PipelineTrainer(bf16=True)`` at one replica trains bit for bit as through FSDP2's one-rank path.

The same script (``tests/hf/scripts/train_lm.py``) run twice under ``torchrun`` at pp 2, bf16-mixed, with
gradient accumulation and evaluation: once through :mod:`hfpipe.parallel.one_replica`, once through FSDP2 (the
oracle: ``hfpipe.parallel.fsdp._FSDP2_AT_ONE_REPLICA``). Every logged loss, grad norm and eval loss is equal,
and so is every tensor ``save_model()`` wrote.
"""

from __future__ import annotations

import pytest
import torch

from _dist import folder_tensors
from test_hf_trainer import finish, history, start_script


@pytest.mark.slow
def test_pipeline_trainer_bf16_at_one_replica_equals_fsdp2s_path(tmp_path):
    spec = dict(trainer="pipeline", pp=2, bf16=True, ga=2, eval=True, max_steps=3)
    new = finish(start_script(tmp_path, "one-replica", 2, **spec))
    old = finish(start_script(tmp_path, "fsdp2", 2, fsdp2_at_one_replica=True, **spec))
    logged = [[{k: h[k] for k in ("loss", "grad_norm", "eval_loss") if k in h} for h in history(out)]
              for out in (new, old)]
    assert logged[0] == logged[1] and any("eval_loss" in h for h in logged[0]), logged
    got, want = folder_tensors(new / "final"), folder_tensors(old / "final")
    assert got.keys() == want.keys() and got
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
