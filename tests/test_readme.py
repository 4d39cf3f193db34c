"""The README's CLI reference matches the CLI: every command and every option is documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.main import get_command

from hfpipe.cli.main import app

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
COMMANDS = sorted(get_command(app).commands)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_every_command_is_in_the_readme(name):
    assert f"### `hfpipe {name}`" in README
    command = get_command(app).commands[name]
    for param in command.params:
        for flag in param.opts + param.secondary_opts:
            if flag.startswith("--"):
                assert flag in README, f"hfpipe {name} {flag} is missing from the README"


def test_the_readme_names_the_test_command_ci_runs():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
