"""A step whose loss or gradient norm is not finite stops the run before anything saves it."""

from __future__ import annotations

import math

from hfpipe.errors import HfpipeError

__all__ = ["NonFiniteStep", "check_finite"]


class NonFiniteStep(HfpipeError):
    """Training diverged at a step (one line: the step, the values, the last good checkpoint)."""


def check_finite(step: int, loss: float, grad_norm: float, last_good) -> None:
    """Raise :class:`NonFiniteStep` if ``loss`` or ``grad_norm`` is nan/inf.

    Every rank holds the same values (the step all-reduces them), so every rank stops at the same
    step without a collective of its own, and none saves the NaN weights the step produced.
    """
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("grad norm", grad_norm))
           if value is not None and not math.isfinite(value)]
    if bad:
        keep = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
        raise NonFiniteStep(f"step {step}: {' and '.join(bad)} is not finite; stopped without saving it, "
                            f"{keep}: resume from it with a lower --lr or a --max-grad-norm")
