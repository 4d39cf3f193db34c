"""``PipelineModel.load_checkpoint`` is all or nothing: what it is handed is checked against the saved state
before any of it is applied (the multi-process case, weights untouched after a refusal, is in
``tests/api/test_api_resume.py``, slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfpipe.checkpoint.dcp import CheckpointError
from hfpipe.checkpoint.pipeline_state import _check_kinds, _check_scheduler_fits


def _scheduler(groups: int):
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1e-3)
    return torch.optim.lr_scheduler.LambdaLR(opt, [lambda step: 1.0] * groups)


def test_a_scheduler_over_other_parameter_groups_is_refused_before_loading():
    saved = _scheduler(1).state_dict()
    _check_scheduler_fits(_scheduler(1), saved, Path("ckpt"))
    with pytest.raises(CheckpointError, match=r"the checkpoint's scheduler ran over 1 parameter groups \(base_lrs\), "
                                              r"this one over 3"):
        _check_scheduler_fits(_scheduler(3), saved, Path("ckpt"))


@pytest.mark.parametrize("optimizer, scheduler, message", [
    ("adamw", None, "load_checkpoint(optimizer='adamw'): pass the torch optimizer"),
    (None, "cosine", "load_checkpoint(scheduler='cosine'): pass a torch LR scheduler"),
])
def test_an_optimizer_or_scheduler_given_by_name_is_refused(optimizer, scheduler, message):
    with pytest.raises(CheckpointError) as e:
        _check_kinds(optimizer, scheduler)
    assert str(e.value).startswith(message)
    _check_kinds(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), _scheduler(1))
