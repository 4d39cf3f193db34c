"""The README's two commands, run as a new user runs them: in a clean virtual environment (no system
site-packages; pip takes torch from the machine's wheel cache and the rest from the index), in a
copy of the repository's tracked files.

Slow (minutes: installs, the whole quickstart), so ``pytest -m slow``. The test command is run as
written but limited to one quick test file: what it proves is that the README's install gives
pytest and the test extra, not the suite itself (which CI runs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> tuple[str, list[str]]:
    """(install-and-quickstart line, test-command lines) from the README's "Two commands"."""
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    quickstart = blocks[0].strip()
    tests = [line for line in blocks[-1].strip().splitlines() if line.strip()]
    return quickstart, tests


def test_the_readme_states_both_commands_and_the_test_extra():
    quickstart, tests = readme_commands()
    assert quickstart == "pip install torch==2.13.0 && pip install -e . && hfpipe quickstart"
    assert tests == ['pip install -e ".[test,qlora,trl]"', "python -m pytest -q"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_readme_commands_work_in_a_clean_venv(tmp_path):
    repo = tmp_path / "hfpipe"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def sh(line: str, timeout: int) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-c", line], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, (line, done.stdout[-3000:], done.stderr[-3000:])
        return done

    quickstart, tests = readme_commands()
    out = sh(quickstart, timeout=1500).stdout
    assert "(PASS)" in out and "after fine-tuning:" in out and "nan" not in out
    sh(tests[0], timeout=900)
    result = sh(tests[1] + " tests/config/test_config_run.py", timeout=900)
    assert " passed" in result.stdout
    # A plain (non-editable) install carries the recipes: they are package data.
    sh(f"pip wheel --no-deps -q -w {tmp_path / 'wheel'} .", timeout=900)
    (wheel,) = (tmp_path / "wheel").glob("hfpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"hfpipe/recipes/{p.name}" for p in (ROOT / "hfpipe" / "recipes").glob("*.yaml")} <= set(names)
