"""``hfpipe plan --png``: the schedule's timeline and the stage costs, drawn with matplotlib.

matplotlib is an optional extra (``pip install 'hfpipe[plot]'``); without it ``--png`` fails
with one line saying so, before any planning work.
"""

from __future__ import annotations

import os
from pathlib import Path

from hfpipe.plan import PlanError
from hfpipe.plan_report import PlanReport, timeline

__all__ = ["require_matplotlib", "save_png"]

_COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
_MAX_LABELLED = 150  # timelines longer than this (in forward steps) get no per-step labels


def require_matplotlib() -> None:
    """Raise PlanError, saying what to install, unless matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError("--png needs matplotlib; install it with: pip install 'hfpipe[plot]'") from None


def save_png(report: PlanReport, path: str | Path) -> Path:
    """Draw the timeline (top: each rank's steps, replayed) and stage costs (bottom) into a PNG.

    Written to a hidden sibling and renamed, so ``path`` is complete or absent.

    Raises:
        PlanError: matplotlib is missing or ``path`` cannot be written.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    path, plan = Path(path), report.plan
    rows = timeline(report.actions)
    span = max((end for row in rows for _, end, *_ in row), default=1)
    fig = Figure(figsize=(min(6 + span * 0.12, 40), 4 + 0.4 * plan.pp))
    top, bottom = fig.subplots(2, 1, height_ratios=[plan.pp + 1, 3])
    _draw_timeline(top, rows, span)
    top.set_yticks(range(plan.pp), [f"rank {r}" for r in range(plan.pp)])
    top.set_title(f"{report.schedule}: pp {plan.pp} x vpp {plan.vpp}, {report.microbatches} "
                  f"microbatches, bubble {report.bubble:.1%} (analytic)")
    _draw_costs(bottom, report)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PlanError(f"cannot write --png {path} ({e.strerror}); choose a writable path") from None
    return path


def _draw_timeline(ax, rows, span: float) -> None:
    from matplotlib.patches import Patch

    for r, row in enumerate(rows):
        for kind, color in _COLORS.items():
            bars = [(start, end - start) for start, end, k, _, _ in row if k == kind]
            ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.3)
        for start, end, kind, stage, mb in row if span <= _MAX_LABELLED else ():
            ax.text((start + end) / 2, r, f"{stage}{kind}{mb}", ha="center", va="center", fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("time (one forward = 1; F = I = W = 1, B = 2)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="center left",
              bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def _draw_costs(ax, report: PlanReport) -> None:
    index = [s.index for s in report.stages]
    ax.bar(index, [s.cost_share for s in report.stages], color=[f"C{s.rank % 10}" for s in report.stages])
    if len(index) <= 64:
        ax.set_xticks(index)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("stage (colour: rank)")
    ax.set_ylabel("cost / mean")
    ax.set_title(f"stage costs, balance {report.balance:.3f}")
