"""The long names other tools give the parallel axes (``--tensor-parallel``, ``--pipeline-parallel-size``, ...)
point at hfpipe's flag, not at whatever click finds closest by spelling (``--sequence-parallel``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hfpipe.cli.main import app
from _trust import error_lines

AXES = {"pipeline-parallel": "pp", "data-parallel": "dp", "tensor-parallel": "tp", "context-parallel": "cp",
        "expert-parallel": "ep"}


def _error(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    lines = error_lines(result.output)
    return result.exit_code, lines[-1] if lines else ""


@pytest.mark.parametrize("command", ["finetune", "plan"])
@pytest.mark.parametrize("long", sorted(AXES))
def test_an_axis_long_name_points_at_its_flag(command, long):
    for typed in (f"--{long}", f"--{long}-size", f"--{AXES[long]}-size"):
        code, line = _error(command, "model", typed, "2")
        assert code == 2 and line == (f"error: no such option {typed}; did you mean --{AXES[long]}? "
                                      f"(see 'hfpipe {command} --help')"), line


def test_a_command_without_the_axis_keeps_clicks_answer():
    code, line = _error("verify", "model", "--tensor-parallel", "2")
    assert code == 2 and "did you mean" not in line and "--tensor-parallel" in line
