"""The recipes shipped with hfpipe: ``hfpipe/recipes/<name>.yaml``, installed with the package.

Each recipe is a YAML file of :class:`~hfpipe.config.run.FinetuneConfig` keys that opens with a comment:
its purpose on the first line, the launch command, and a ``# Fits:`` line naming the GPUs it fits
(which ``hfpipe plan`` confirms; a test checks every recipe). ``--recipe`` takes a recipe's name
(``llama3_1_8b_sft_pp4``) or the path of any YAML file.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Recipe", "find_recipe", "list_recipes"]

RECIPE_DIR = Path(__file__).parent
_FITS = re.compile(r"^# Fits: (\d+) x (\d+(?:\.\d+)?GB) GPUs\b")


@dataclass(frozen=True)
class Recipe:
    """A shipped recipe: its name, file, one-line purpose and the GPUs it names."""

    name: str
    path: Path
    purpose: str
    gpus: int | None  # from the `# Fits: N x SIZE GPUs` line
    gpu_memory: str | None  # e.g. "80GB"

    @classmethod
    def read(cls, path: Path) -> Recipe:
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        purpose = header[0].lstrip("# ").strip() if header else ""
        fits = next((m for m in map(_FITS.match, header) if m), None)
        return cls(path.stem, path, purpose, int(fits.group(1)) if fits else None,
                   fits.group(2) if fits else None)


def list_recipes() -> list[Recipe]:
    """Every shipped recipe, by name."""
    return [Recipe.read(p) for p in sorted(RECIPE_DIR.glob("*.yaml"))]


def find_recipe(name: str | Path) -> Path:
    """The YAML file ``--recipe`` means: an existing path, or a shipped recipe's name.

    Raises:
        ConfigError: neither; the message lists close names (or all of them).
    """
    from hfpipe.config.names import ConfigError

    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    shipped = RECIPE_DIR / f"{stem}.yaml"
    if shipped.is_file() and (path.parent == Path(".") or path.parent.name == "recipes"):
        return shipped
    if path.suffix in (".yaml", ".yml") and path.parent != Path("."):
        raise ConfigError(f"cannot read config {path}: No such file or directory")
    names = [r.stem for r in sorted(RECIPE_DIR.glob("*.yaml"))]
    close = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"shipped recipes: {', '.join(names)}"
    raise ConfigError(f"--recipe {name}: no such file or shipped recipe ({hint}; hfpipe recipes lists them)")
