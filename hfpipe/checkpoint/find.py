"""Which checkpoint a user means: a step folder, a run folder (its newest step) or a checkpoints folder.

``hfpipe export`` and ``hfpipe generate`` take any of these. When the folder named is not there,
the error lists the steps that are, so the user can pick one without an ``ls``.
"""

from __future__ import annotations

import re
from pathlib import Path

# Torch-free (DCP is imported only where a folder exists): a wrong path is named in a moment.
from hfpipe.errors import CheckpointError

__all__ = ["find_checkpoint", "is_checkpoint_like"]

_STEP_DIR = re.compile(r"^step-\d{8}$")
_STEP_LIKE = re.compile(r"^step[-_]?(\d+)$")  # what a user types for one: step-99, step_99, step99


def is_checkpoint_like(path: str | Path) -> bool:
    """Whether ``path`` looks like a training checkpoint, a run folder or a checkpoints folder.

    A Hugging Face model folder (``config.json`` and no ``hfpipe.json``/``checkpoints/``) does not.
    """
    path = Path(path)
    if _STEP_LIKE.match(path.name) or (path / "hfpipe.json").is_file() or (path / ".metadata").is_file():
        return True
    if path.parent.name == "checkpoints" and not path.exists():  # a mistyped step: say which exist
        return True
    if (path / "config.json").is_file():
        return False
    return (path / "checkpoints").is_dir() or any(_steps(path))


def find_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """The checkpoint folder ``path`` stands for.

    Args:
        path: ``OUT/checkpoints/step-00000100``, the run folder ``OUT`` (its newest complete
            checkpoint) or ``OUT/checkpoints``.
        what: How the argument is called in error messages.

    Raises:
        CheckpointError: nothing usable there; the message lists the steps that exist.
    """
    path = Path(path)
    if path.name.startswith(".tmp-"):  # dcp.save_checkpoint writes here, then renames it
        raise CheckpointError(f"{what} {path} is an unfinished save (still being written, or left by a "
                              "crash); pass a complete step folder like OUT/checkpoints/step-00000100")
    if (path / "hfpipe.json").is_file() or (path / ".metadata").is_file():
        return path  # a step folder; its contents are checked by whoever reads it
    for root in (path / "checkpoints", path):
        if not root.is_dir():
            continue
        from hfpipe.checkpoint.dcp import latest_checkpoint

        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    if _STEP_LIKE.match(path.name) or path.parent.name == "checkpoints":
        raise CheckpointError(f"{what} {path} not found; {_existing_steps(path)}")
    if path.is_dir():
        raise CheckpointError(f"{what} {path} holds no complete checkpoint (no checkpoints/step-*/); "
                              "pass a run folder after its first save, or a step folder")
    raise CheckpointError(f"{what} {path} not found; pass a run folder (OUT) or a step folder "
                          "like OUT/checkpoints/step-00000100")


def _existing_steps(path: Path) -> str:
    """The steps beside ``path``, and the one it names if only its zero padding was off."""
    steps = _steps(path.parent)
    if not steps:
        return f"{path.parent} holds no checkpoints"
    number = _STEP_LIKE.match(path.name)
    meant = f"step-{int(number.group(1)):08d}" if number else None
    hint = f"did you mean {path.parent / meant}? " if meant in steps else ""
    return f"{hint}existing steps: {', '.join(steps)}"


def _steps(folder: Path) -> list[str]:
    """Names of the complete step folders in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if _STEP_DIR.match(p.name) and (p / "hfpipe.json").is_file() and (p / ".metadata").is_file())
