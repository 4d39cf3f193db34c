"""The names every layer of the config shares: the schedule spellings and the config error.

They sit below both :mod:`hfpipe.config.run` (the dataclass) and :mod:`hfpipe.config.checks` (its
checks), so the checks need not import the dataclass they check.
"""

from hfpipe.errors import ConfigError
from hfpipe.parallel.rules import INTERLEAVED_SCHEDULES, SCHEDULES, V_SCHEDULES

__all__ = ["ConfigError", "SCHEDULES", "INTERLEAVED_SCHEDULES", "V_SCHEDULES", "QUANTIZE_BASE"]

#: Formats a LoRA run's frozen base can be kept in on the device (``--quantize-base``).
QUANTIZE_BASE = ("nf4", "fp8")
