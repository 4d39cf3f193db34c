"""Helpers for tests that run real gloo processes on localhost."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from hfpipe.parallel.launch import launch

TIMEOUT_S = 300


def run_ranks(fn, nprocs: int, *args) -> dict[int, object]:
    """Run module-level ``fn(*args)`` in ``nprocs`` spawned processes; return rank -> result."""
    return launch(fn, nprocs, *args, threads_per_rank=1, timeout_s=TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(kind: str, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` (cached for the test session)."""
    from hfpipe.tiny import make_tiny_checkpoint

    out = Path(tempfile.mkdtemp(prefix=f"hfpipe-{kind}-"))
    return make_tiny_checkpoint(out, kind, **overrides)
