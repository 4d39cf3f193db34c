"""A full disk during a checkpoint save: one line with the path and the bytes, no partial folder."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

__all__ = ["is_disk_full", "out_of_space", "state_bytes", "disk_full_message"]

_MARKERS = ("No space left on device", "Disk quota exceeded", f"[Errno {errno.ENOSPC}]")


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps: DCP re-raises writer errors per rank as text) is ENOSPC/EDQUOT."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in _MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def out_of_space(folder: Path, nbytes: int) -> bool:
    """Whether ``folder``'s file system has less room left than ``nbytes``.

    torch.save reports a write that hit a full disk as "unexpected pos 704 vs 598" (its zip writer
    loses the errno), so a failed save is also judged by the space left once it failed.
    """
    try:
        return shutil.disk_usage(folder if folder.exists() else folder.parent).free < max(nbytes, 1)
    except OSError:
        return False


def state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: about what the save writes from this rank."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def disk_full_message(path: Path, nbytes: int) -> str:
    free = shutil.disk_usage(path.parent if not path.exists() else path).free if path.parent.exists() else 0
    return (f"disk full while saving {path} (this rank writes about {nbytes} bytes, {free} are free); "
            "the partial checkpoint was removed: free space or choose another --output-dir, then --resume auto")
