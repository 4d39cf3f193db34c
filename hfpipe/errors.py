"""The base of every error hfpipe raises for a user's input, and the errors several layers share.

A floor module: it imports nothing from hfpipe, so any layer can raise these and any caller
(the CLI, a worker, a Python script) can catch :class:`HfpipeError` for all of them. Each layer
keeps its own subclass where only it raises it (``ConfigError``, ``SourceError``, ...).
"""

__all__ = ["CheckpointError", "ConfigError", "ExportError", "HfpipeError", "NoSuchPathError", "ParallelError",
           "PlanError"]


class HfpipeError(ValueError):
    """A problem with the user's input, told in one line that names the flag or file to fix."""


class ConfigError(HfpipeError):
    """An invalid configuration value or file; the message names the flag or key to fix."""


class ParallelError(ConfigError):
    """A mesh, degree or schedule combination that cannot run (one validator raises it for the CLI,
    the API and ``plan`` alike: :mod:`hfpipe.parallel.rules`)."""


class PlanError(HfpipeError):
    """A pipeline plan that cannot be made; the message says which option to change."""


class ExportError(HfpipeError):
    """The checkpoint, source or output cannot be exported (one line: the file/option and the fix)."""


class CheckpointError(HfpipeError):
    """A checkpoint is missing, incomplete or does not fit the model (one line, names what)."""


class NoSuchPathError(HfpipeError):
    """A path the user named as a local file or folder is not there (one line, the closest name)."""
