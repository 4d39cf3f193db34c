"""``hfpipe plan --png``: the schedule's timeline, each rank's memory and the stage costs.

Top left, each rank's steps replayed in time: one colour per stage, the kind of step by its fill
(forward solid, backward hatched), every block labelled with its stage and microbatch. Top right,
beside each rank's row, its memory (weights, gradients, AdamW state, activations) against
``--gpu-memory``. Bottom, each stage's compute against the mean. Legends list only what is drawn.

matplotlib is an optional extra (``pip install 'hfpipe[plot]'``); without it ``--png`` fails
with one line saying so, before any planning work.
"""

from __future__ import annotations

import colorsys
import importlib
import os
from pathlib import Path

from hfpipe.plan.split import PlanError
from hfpipe.plan.actions import timeline
from hfpipe.plan.report import PlanReport

__all__ = ["require_matplotlib", "save_png", "stage_colors"]

# The step kind is the fill pattern; the colour is the stage.
_HATCH = {"F": "", "B": "//", "I": "\\\\", "W": ".."}
_KIND_NAME = {"F": "forward", "B": "backward", "I": "backward (input grads)", "W": "backward (weight grads)"}
# Greys, so that no memory colour reads as a stage's.
_MEMORY = (("weights", "weight_bytes", "#3a3a3a"), ("grads", "grad_bytes", "#7a7a7a"),
           ("AdamW", "optimizer_bytes", "#b4b4b4"), ("activations", "activation_bytes", "#e2e2e2"))
_GIB = 1024**3


def require_matplotlib() -> None:
    """Raise PlanError, saying what to install, unless matplotlib imports."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise PlanError("--png needs matplotlib; install it with: pip install 'hfpipe[plot]'") from None


def stage_colors(n: int) -> list[tuple[float, float, float]]:
    """``n`` distinct RGB colours: tab20's up to 20, beyond that evenly spaced hues in two tones."""
    if n <= 20:
        from matplotlib import colormaps

        cmap = colormaps["tab20"]  # pairs of dark/light: take the 10 darks first, then the lights
        order = [2 * i for i in range(10)] + [2 * i + 1 for i in range(10)]
        return [cmap(order[i])[:3] for i in range(n)]
    return [colorsys.hsv_to_rgb(i / n, 0.85 if i % 2 else 0.5, 0.8 if i % 2 else 0.95) for i in range(n)]


def save_png(report: PlanReport, path: str | Path, gpu_memory: int | None = None) -> Path:
    """Draw the plan into a PNG, written to a hidden sibling and renamed (complete or absent).

    Args:
        report: The plan.
        path: The PNG to write.
        gpu_memory: Bytes of one GPU, drawn as a line on the memory panel.

    Raises:
        PlanError: matplotlib is missing or ``path`` cannot be written.
    """
    require_matplotlib()
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    path, plan = Path(path), report.plan
    rows = timeline(report.actions)
    span = max((end for row in rows for _, end, *_ in row), default=1)
    width = min(8 + span * 0.22, 60)
    fig = Figure(figsize=(width, 3.5 + 0.45 * plan.pp), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[width - 5, 4], height_ratios=[plan.pp + 2.5, 3])
    top = fig.add_subplot(grid[0, 0])
    memory = fig.add_subplot(grid[0, 1], sharey=top)
    with rc_context({"hatch.linewidth": 0.4, "hatch.color": "#333333"}):
        _draw_timeline(top, rows, stage_colors(len(plan.stages)))
    top.set_title(f"{report.schedule}: pp {plan.pp} x vpp {plan.vpp}, {report.microbatches} "
                  f"microbatches, bubble {report.bubble:.1%} (analytic)", loc="left")
    _draw_memory(memory, report, gpu_memory)
    _draw_costs(fig.add_subplot(grid[1, :]), report)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PlanError(f"cannot write --png {path} ({e.strerror}); choose a writable path") from None
    return path


def _draw_timeline(ax, rows, colors) -> None:
    from matplotlib.patches import Patch

    kinds, stages = set(), set()
    for r, row in enumerate(rows):
        groups: dict[tuple[str, int], list] = {}
        for start, end, kind, stage, mb in row:
            groups.setdefault((kind, stage), []).append((start, end - start))
            ax.text((start + end) / 2, r, f"s{stage}\n{kind}{mb}", ha="center", va="center",
                    fontsize=6, linespacing=0.9, color=_ink(colors[stage]), in_layout=False)
        for (kind, stage), bars in groups.items():  # one artist per group: fast at 16 x 2 x 32
            kinds.add(kind)
            stages.add(stage)
            ax.broken_barh(bars, (r - 0.42, 0.84), facecolors=colors[stage], edgecolors="black",
                           linewidth=0.4, hatch=_HATCH[kind])
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max((row[-1][1] for row in rows if row), default=1))
    ax.set_xlabel("time (one forward = 1; F = I = W = 1, B = 2); block: s<stage>, <kind><microbatch>")
    handles = [Patch(facecolor=colors[s], edgecolor="black", label=f"stage {s}") for s in sorted(stages)]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k], label=_KIND_NAME[k])
                for k in "FBIW" if k in kinds]
    ax.figure.legend(handles=handles, loc="outside lower left", ncol=min(len(handles), 18),
                     fontsize=7, frameon=False)


def _ink(rgb) -> str:
    """Black text on light fills, white on dark ones."""
    r, g, b = rgb[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _draw_memory(ax, report: PlanReport, gpu_memory: int | None) -> None:
    left = [0.0] * len(report.ranks)
    dequant = (("dequantized", "transient_bytes", "#f4f4f4"),) if any(k.transient_bytes for k in report.ranks) else ()
    for label, attr, color in _MEMORY + dequant:  # a quantized base's transient weights, if any
        sizes = [getattr(k, attr) / _GIB for k in report.ranks]
        ax.barh([k.rank for k in report.ranks], sizes, left=left, height=0.7, color=color, label=label,
                edgecolor="black", linewidth=0.4)
        left = [a + b for a, b in zip(left, sizes)]
    for k, total in zip(report.ranks, left):
        over = gpu_memory is not None and k.total_bytes > gpu_memory
        ax.text(total, k.rank, f" {total:.1f}", va="center", fontsize=7,
                color="#c00000" if over else "black", fontweight="bold" if over else None)
    if gpu_memory is not None:
        ax.axvline(gpu_memory / _GIB, color="#c00000", linestyle="--", linewidth=1,
                   label=f"GPU {gpu_memory / _GIB:.1f} GiB")
    ax.set_xlim(0, max(left + [gpu_memory / _GIB if gpu_memory else 0]) * 1.25 or 1)
    ax.set_xlabel("GiB per rank")
    ax.set_title("memory per rank", loc="left")
    ax.tick_params(labelleft=False)
    ax.figure.legend(*ax.get_legend_handles_labels(), loc="outside lower right", fontsize=7, ncol=5,
                     frameon=False)


def _draw_costs(ax, report: PlanReport) -> None:
    colors = stage_colors(len(report.stages))
    index = [s.index for s in report.stages]
    ax.bar(index, [s.cost_share for s in report.stages], color=[colors[i] for i in index],
           edgecolor="black", linewidth=0.4)
    if len(index) <= 64:
        ax.set_xticks(index)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("stage (colour as in the timeline)")
    ax.set_ylabel("cost / mean")
    ax.set_title(f"stage costs, balance {report.balance:.3f}", loc="left")
