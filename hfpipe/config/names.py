"""The names every layer of the config shares: the schedule spellings and the config error.

They sit below both :mod:`hfpipe.config.run` (the dataclass) and :mod:`hfpipe.config.checks` (its
checks), so the checks need not import the dataclass they check.
"""

from hfpipe.errors import HfpipeError

__all__ = ["ConfigError", "SCHEDULES", "INTERLEAVED_SCHEDULES", "V_SCHEDULES", "QUANTIZE_BASE"]

#: Every pipeline schedule, as spelled in ``--schedule``.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
#: Schedules that put several stages per rank in a loop (rank r holds stages r, r+pp, ...).
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")
#: Schedules that put exactly two stages per rank in a V (rank r holds stages r and 2*pp-1-r).
V_SCHEDULES = ("zbv", "dualpipev")
#: Formats a LoRA run's frozen base can be kept in on the device (``--quantize-base``).
QUANTIZE_BASE = ("nf4", "fp8")


class ConfigError(HfpipeError):
    """An invalid configuration value or file; the message names the flag or key to fix."""
