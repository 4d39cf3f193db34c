"""Checks of command options shared by plan, verify and quickstart, run before any work.

Each names the flag as the user typed it (``--pp``), so ``--pp 0`` is not reported as a
consequence of it (``--microbatches must be at least 1``).
"""

from __future__ import annotations

import math

from hfpipe.errors import HfpipeError

__all__ = ["OptionError", "require_positive", "require_tolerance"]


class OptionError(HfpipeError):
    """An option value that can never work (one line naming the flag)."""


def require_positive(**flags: int | None) -> None:
    """Every given (non-None) option is an integer >= 1; keys are flag names with ``_`` for ``-``."""
    for name, value in flags.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OptionError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")


def require_tolerance(value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise OptionError(f"--tolerance must be a finite number >= 0, got {value}")
