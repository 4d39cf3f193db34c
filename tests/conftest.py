"""The suite's layout: a folder per package of hfpipe (``tests/plan/`` for ``hfpipe/plan/``), each test file
named for the package it checks (``test_plan_split.py``), so basenames are unique across folders.

Test files share oracles by importing each other by name (``from test_train_equivalence import ...``) and
spawned workers import the test module that holds their function: every folder of the suite is on
``sys.path`` (workers inherit it), not only the one pytest is collecting.
"""

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _folder in sorted({_HERE, *(p.parent for p in _HERE.glob("*/test_*.py"))}, reverse=True):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
