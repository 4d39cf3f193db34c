"""What each rank of a pipeline schedule runs, in order, and when (for ``hfpipe plan``).

:func:`schedule_actions` reads torch's own schedules (their ``pipeline_order``, built against
mock stages, for the multi-stage ones); :func:`in_flight` turns them into the most microbatches
each stage holds at once (activation memory); :func:`timeline` into the start and end of every
step under unit step times (the ``--png`` drawing).
"""

from __future__ import annotations

__all__ = ["in_flight", "schedule_actions", "timeline"]


def schedule_actions(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple:
    """Per rank, the compute steps torch's schedule runs, in order: ``(kind, stage, microbatch)``.

    ``kind`` is F (forward), B (full backward), I (input-gradient backward) or W (weight-gradient
    backward); DualPipeV's overlapped forward + backward is listed as its two halves. GPipe and
    1F1B follow their ``_step_microbatches`` loops (1F1B: ``min(m, p - rank)`` warmup forwards,
    then backward/forward pairs); the multi-stage schedules run their ``pipeline_order``, read
    here from torch's own schedule built against mock stages (no process group).
    """
    if schedule in ("gpipe", "1f1b"):
        return tuple(_single_stage_steps(schedule, rank, pp, microbatches) for rank in range(pp))
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from hfpipe.parallel.schedules import schedule_class

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    ops = get_schedule_ops(schedule_class(schedule), pp, microbatches, num_stages_per_rank=vpp)
    out = []
    for rank_ops in ops:
        steps = []
        for action in filter(None, rank_ops):
            for sub in action.sub_actions or (action,):
                kind = kinds.get(sub.computation_type.name)
                if kind is not None:
                    steps.append((kind, sub.stage_index, sub.microbatch_index))
        out.append(tuple(steps))
    return tuple(out)


def _single_stage_steps(schedule: str, rank: int, pp: int, m: int) -> tuple:
    warmup = m if schedule == "gpipe" else min(m, pp - rank)
    steps = [("F", rank, i) for i in range(warmup)]
    for i in range(m):
        steps.append(("B", rank, i))
        if warmup + i < m:
            steps.append(("F", rank, warmup + i))
    return tuple(steps)


def in_flight(actions, per_mb: list[int]) -> tuple[dict[int, int], list[int]]:
    """(stage -> most microbatches alive at once, rank -> peak activation bytes)."""
    counts = {s: 0 for s in range(len(per_mb))}
    peaks = []
    for steps in actions:
        alive: set[tuple[int, int]] = set()
        peak = 0
        for kind, stage, mb in steps:
            if kind == "F":
                alive.add((stage, mb))
                counts[stage] = max(counts[stage], sum(1 for s, _ in alive if s == stage))
                peak = max(peak, sum(per_mb[s] for s, _ in alive))
            elif kind in ("B", "W"):
                alive.discard((stage, mb))
        peaks.append(peak)
    return counts, peaks


_STEP_TIME = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def timeline(actions) -> list[list[tuple[float, float, str, int, int]]]:
    """Per rank, ``(start, end, kind, stage, microbatch)`` of every step of :func:`schedule_actions`.

    Each rank runs its steps in order, each waiting for its rank and its data, with unit step
    times F = I = W = 1, B = 2 (the convention of :func:`hfpipe.plan.split.bubble_fraction`).
    """
    last = max((stage for steps in actions for _, stage, _ in steps), default=0)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G", stage, mb) -> finish time
    clock, pos = [0.0] * len(actions), [0] * len(actions)
    rows: list[list] = [[] for _ in actions]
    while any(p < len(steps) for p, steps in zip(pos, actions)):
        progressed = False
        for r, steps in enumerate(actions):
            while pos[r] < len(steps):
                kind, stage, mb = steps[pos[r]]
                needs = {"F": [("F", stage - 1, mb)] * (stage > 0),
                         "W": [("G", stage, mb)]}.get(kind, [("F", stage, mb)] + [("G", stage + 1, mb)] * (stage < last))
                if any(n not in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + _STEP_TIME[kind]
                if kind != "W":
                    done[("F" if kind == "F" else "G", stage, mb)] = clock[r]
                rows[r].append((start, clock[r], kind, stage, mb))
                pos[r], progressed = pos[r] + 1, True
        if not progressed:
            raise RuntimeError("schedule replay made no progress; torch's action lists changed?")
    return rows
