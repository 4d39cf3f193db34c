"""Helpers for tests that run real gloo processes on localhost, build tiny checkpoints and read them."""

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


def folder_tensors(folder) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by key."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out
