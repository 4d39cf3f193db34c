"""torch's schedule class behind each ``--schedule`` name (imported only when a schedule is built or read)."""

from __future__ import annotations

__all__ = ["schedule_class"]


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class spelled ``name`` (a name from
    :data:`hfpipe.parallel.rules.SCHEDULES`)."""
    from torch.distributed.pipelining import schedules as s

    return {
        "gpipe": s.ScheduleGPipe,
        "1f1b": s.Schedule1F1B,
        "interleaved-1f1b": s.ScheduleInterleaved1F1B,
        "looped-bfs": s.ScheduleLoopedBFS,
        "interleaved-zb": s.ScheduleInterleavedZeroBubble,
        "zbv": s.ScheduleZBVZeroBubble,
        "dualpipev": s.ScheduleDualPipeV,
    }[name]
