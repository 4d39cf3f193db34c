"""The README and docs/ say what the CLI does: no merge leftovers, Python that parses, `hfpipe ...`
commands whose commands and flags exist, relative links that lead somewhere, and a CLI reference
(docs/cli.md) that is the real ``--help`` of every command, word for word. The README stays a guide
(at most 450 lines) that links every page of docs/ from its first screen.

After changing a command's help, rewrite docs/cli.md with ``python tests/test_readme.py``.
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from hfpipe.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md"]
README_MAX_LINES = 450
FIRST_SCREEN = 25  # lines a reader sees before scrolling
GROUP = get_command(app)
COMMANDS = sorted(GROUP.commands)
# `COLUMNS=80 hfpipe X --help` wraps at 78: what a reader of an 80-column terminal sees.
HELP_WIDTH = 78


def help_text(name: str) -> str:
    """``hfpipe NAME --help`` (NAME "" for the group) as a terminal of 80 columns shows it."""
    args = [name, "--help"] if name else ["--help"]
    return CliRunner().invoke(app, args, prog_name="hfpipe", terminal_width=HELP_WIDTH).output


def cli_reference() -> str:
    """docs/cli.md as it must read: every command's help, in the order ``hfpipe --help`` lists."""
    parts = ["# CLI reference\n",
             "Every command's `--help`, as printed in an 80-column terminal. `tests/test_readme.py`",
             "checks this page against the CLI; `python tests/test_readme.py` rewrites it.\n"]
    for name in ["", *GROUP.list_commands(None)]:
        title = f"hfpipe {name}".strip()
        parts.append(f"## `{title}`\n\n```text\n{help_text(name).rstrip()}\n```\n")
    return "\n".join(parts)


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def _hfpipe_commands(text: str) -> list[str]:
    """Every `hfpipe ...` command line of the bash blocks and of the inline code spans."""
    lines = []
    for block in _code_blocks(text, "bash"):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`(hfpipe [^`]+)`", text)
    commands = []
    for line in lines:
        line = line.split(" #", 1)[0]  # a trailing comment
        for part in re.split(r"&&|\|\||;|\|", line):
            words = part.split()
            if "hfpipe" in words:
                commands.append(" ".join(words[words.index("hfpipe"):]))
    return commands


def _unknown_flags(command: str) -> list[str]:
    words = shlex.split(command.replace("...", " "))[1:]
    group_flags = {"--help"} | {o for p in GROUP.params for o in p.opts + p.secondary_opts}
    while words and words[0] in group_flags:  # `hfpipe --debug finetune ...`, `--log-level X`
        words = words[2:] if words[0] == "--log-level" else words[1:]
    if not words or words[0].startswith("-"):
        return [w for w in words if w.startswith("--") and w.split("=")[0] not in group_flags]
    if words[0].isupper():  # a placeholder: `hfpipe COMMAND --help`
        return [w for w in words[1:] if w.startswith("--") and w.split("=")[0] not in group_flags]
    if words[0] not in GROUP.commands:
        return [f"no command {words[0]!r}"]
    params = GROUP.commands[words[0]].params
    known = group_flags | {o for p in params for o in p.opts + p.secondary_opts}
    return [w for w in words[1:] if w.startswith("--") and w.split("=")[0] not in known]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _broken_links(doc: Path) -> list[str]:
    """Relative links of ``doc`` (outside code) whose file, or heading anchor, does not exist."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path) if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def _missing_files(doc: Path) -> list[str]:
    """Repository files a page names in its text (tests/..., examples/..., bench/... .py) that do not exist."""
    named = set(re.findall(r"(?<![\w/.])((?:tests|examples|bench)/[\w/]+\.py)\b", doc.read_text()))
    return sorted(name for name in named if not (ROOT / name).is_file())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_merge_conflict_is_left(doc):
    markers = re.findall(r"^(?:<{7}|={7}|>{7})(?: .*)?$", doc.read_text(), re.M)
    assert not markers, f"{doc.name} holds merge conflict markers: {markers}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_parses(doc):
    for block in _code_blocks(doc.read_text(), "python"):
        ast.parse(block)  # raises SyntaxError naming the line


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_hfpipe_command_uses_flags_that_exist(doc):
    commands = _hfpipe_commands(doc.read_text())
    assert len(commands) >= (10 if doc == README else 0)
    wrong = {c: bad for c in commands if (bad := _unknown_flags(c))}
    assert not wrong, f"{doc.name}: commands with unknown commands or flags: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc):
    assert not _broken_links(doc), f"{doc.relative_to(ROOT)}: broken links {_broken_links(doc)}"


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Does it fit? (`hfpipe plan`)\n")
    doc = tmp_path / "README.md"
    doc.write_text("[ok](docs/page.md) [ok](docs/page.md#does-it-fit-hfpipe-plan) [web](https://x.org/a)\n"
                   "[gone](docs/gone.md) [no heading](docs/page.md#nowhere) [self](#page)\n"
                   "`[in code](docs/code.md)`\n\n```text\n[in a block](docs/block.md)\n```\n")
    assert _broken_links(doc) == ["docs/gone.md", "docs/page.md#nowhere", "#page"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_example_and_bench_file_named_exists(doc):
    assert not _missing_files(doc), f"{doc.relative_to(ROOT)} names files that are gone: {_missing_files(doc)}"


def test_the_file_check_catches_a_renamed_test(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("run `python -m pytest tests/test_readme.py` or tests/test_gone.py; bench/load.py, "
                   "examples/nowhere.py, hfpipe/tests/x.py\n")
    assert _missing_files(doc) == ["examples/nowhere.py", "tests/test_gone.py"]


def test_the_readme_is_a_short_guide_that_links_every_reference_page_from_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference text to docs/"
    first_screen = "\n".join(lines[:FIRST_SCREEN])
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert len(pages) >= 7
    missing = [p.name for p in pages if f"(docs/{p.name})" not in first_screen]
    assert not missing, f"link these from the README's first {FIRST_SCREEN} lines: {missing}"


def test_the_check_catches_a_flag_that_does_not_exist():
    assert _unknown_flags("hfpipe export out out/hf --dtype bf16 --force") == []
    assert _unknown_flags("hfpipe export out out/hf --overwrite") == ["--overwrite"]
    assert _unknown_flags("hfpipe exprot out out/hf") == ["no command 'exprot'"]
    assert _unknown_flags("hfpipe --debug finetune --recipe x --pp 2") == []


def test_the_cli_reference_is_the_real_help_of_every_command():
    assert CLI_DOC.read_text() == cli_reference(), (
        "docs/cli.md differs from the CLI's --help; rewrite it with python tests/test_readme.py")


def test_the_readme_leads_with_install_and_quickstart_and_links_the_reference():
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:2] == ["Two commands", "Your own model"]
    assert "docs/cli.md" in text and "### `hfpipe finetune`" not in text


def test_the_readme_names_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in README.read_text() and "python -m pytest -q" in ci


if __name__ == "__main__":
    CLI_DOC.parent.mkdir(exist_ok=True)
    CLI_DOC.write_text(cli_reference())
    sys.exit(0)
