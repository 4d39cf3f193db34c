"""The same error on every rank: a check or a write that fails on one rank fails on all of them.

Under torchrun a rank that raises leaves the others waiting in their next collective, which ends in a
gloo "Connection closed by peer" and a long ``ChildFailedError`` that hides the one line that
mattered. Around the API's checks and rank-0 writes, every rank therefore tells the others whether it
failed (one ``all_gather_object`` of a few strings between this run's own processes), and each raises
the first failing rank's error: the user's error class and message on every rank.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

from hfpipe.errors import HfpipeError

__all__ = ["agree", "raise_together"]


def agree(fn, *, group=None):
    """``fn()`` on this rank; if any rank's ``fn`` raised, every rank raises that error.

    Returns ``fn()``'s result when no rank failed. Collective: every rank of ``group`` calls it.
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - told to every rank, then raised here too
        error = e
    raise_together(error, group=group)
    return result


def raise_together(error: BaseException | None, *, group=None) -> None:
    """Tell every rank whether this one failed; raise the lowest failing rank's error everywhere.

    Without a process group (one process, or before ``init_process_group``) ``error`` is raised
    as it is.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    mine = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(rank, told) for rank, told in enumerate(everyone) if told is not None]
    if not failed:
        return
    rank, told = failed[0]
    if error is not None and told == mine:
        raise error  # this rank's own, with its traceback
    raise _rebuilt(rank, *told)


def _rebuilt(rank: int, module: str, qualname: str, message: str) -> BaseException:
    """The same user error class and message; a bug elsewhere is named with its rank."""
    cls = None
    if module.startswith("hfpipe."):  # only hfpipe's own error classes are rebuilt by name
        try:
            cls = getattr(importlib.import_module(module), qualname, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, HfpipeError):
        try:
            return cls(message)
        except TypeError:  # a class with another constructor: the base carries the same line
            return HfpipeError(message)
    return RuntimeError(f"rank {rank} failed: {qualname}: {message}")
