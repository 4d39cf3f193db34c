"""What the benchmarks measure the same way: a process's resident memory and timed training steps.

Imported by the scripts beside it (``python bench/<name>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import os
import time


def rss() -> int:
    """Resident bytes of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_steps(trainer, data: dict, steps: int) -> tuple[list[float], list[float]]:
    """Run ``steps + 1`` optimizer steps on ``data``; return each one's wall and CPU seconds (the first,
    which builds the schedule, included: callers drop it)."""
    walls, cpus = [], []
    for _ in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(data)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus
