"""The suite's layout: a folder per package of hfpipe (``tests/plan/`` for ``hfpipe/plan/``), each test file
named for the package it checks (``test_plan_split.py``), so basenames are unique across folders.

Test files share oracles by importing each other by name (``from test_train_equivalence import ...``) and
spawned workers import the test module that holds their function: every folder of the suite is on
``sys.path`` (workers inherit it), not only the one pytest is collecting.
"""

import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _folder in sorted({_HERE, *(p.parent for p in _HERE.glob("*/test_*.py"))}, reverse=True):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """A test that loads a pipeline in this process (a world of one) leaves neither its process group nor the
    launcher's variables to the next test, whose ``run_finetune`` would take them for a world of its own
    ("--pp 2 = 2 processes, but 1 were started")."""
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    dist = sys.modules.get("torch.distributed")  # never imported: nothing to end
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
