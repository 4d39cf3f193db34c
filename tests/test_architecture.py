"""Spec of the house (ARCHITECTURE.md): imports run downwards (between modules and between packages),
few floors, few top modules, short files.

Every ``import`` statement counts, also one inside a function: a lazy import still makes the two
modules depend on each other. ``cli/`` is installed as ``hfpipe.cli`` and counted with the package.
"""

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FLOORS, MAX_TOP, MAX_LINES = 9, 8, 420


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in ((ROOT / "hfpipe", "hfpipe"), (ROOT / "cli", "hfpipe.cli")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            mods[".".join((package, *parts))] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The hfpipe modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in mods:  # `from a.b import c`: c may be a name, not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


MODS = _modules()
GRAPH = {name: _imports(name, path, MODS) for name, path in MODS.items()}


def _cycle_from(start: str) -> list[str] | None:
    """A path start -> ... -> start, if the graph has one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in GRAPH[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_one_that_imports_it_back():
    cycles = [c for c in map(_cycle_from, sorted(GRAPH)) if c]
    assert not cycles, "import circle: " + " -> ".join(cycles[0])


@lru_cache(None)
def _floor(name: str) -> int:
    return 1 + max((_floor(n) for n in GRAPH[name]), default=0)


def test_the_import_graph_has_at_most_nine_floors():
    deepest = max(GRAPH, key=_floor)
    chain = [deepest]
    while GRAPH[chain[-1]]:
        chain.append(max(GRAPH[chain[-1]], key=_floor))
    assert _floor(deepest) <= MAX_FLOORS, " -> ".join(chain)


def test_the_top_of_the_package_keeps_only_the_faces():
    top = sorted(p.stem for p in (ROOT / "hfpipe").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP, top


def test_no_file_is_over_420_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODS.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


#: Packages whose ``__init__`` names its faces lazily (imports inside a module ``__getattr__``, run on first
#: use only): ``from hfpipe import load_pipeline``, ``from hfpipe.hf import PipelineTrainer``.
LAZY_FACES = ("hfpipe", "hfpipe.hf")


def test_package_inits_import_nothing_but_the_lazy_faces():
    """Importing ``hfpipe.x.y`` runs ``hfpipe/x/__init__.py``: it must not pull in the rest of x.

    (A package without modules, such as ``recipes`` beside its YAML files, is a module itself.)
    """
    for name, path in MODS.items():
        has_modules = any(m.startswith(name + ".") for m in MODS)
        if path.name == "__init__.py" and name not in LAZY_FACES and has_modules:
            assert not GRAPH[name], f"{path.relative_to(ROOT)} imports {sorted(GRAPH[name])}"


def _package(name: str) -> str:
    """The floor a module lives on: its package under hfpipe (``pipeline``), or itself at the top."""
    if name.startswith("hfpipe.cli"):
        return "cli"
    parts = name.split(".")
    if len(parts) == 1:
        return name
    return parts[1] if len(parts) > 2 or MODS[name].name == "__init__.py" else name


def _package_arrows(graph) -> dict[tuple[str, str], list[tuple[str, str]]]:
    arrows: dict = {}
    for a, targets in graph.items():
        for b in targets:
            if _package(a) != _package(b):
                arrows.setdefault((_package(a), _package(b)), []).append((a, b))
    return arrows


def _back_arrows(graph) -> list[str]:
    """Package pairs that import each other: one of the two arrows runs back up a floor."""
    arrows = _package_arrows(graph)
    return [f"{a} -> {b} ({arrows[a, b][0][0]} imports {arrows[a, b][0][1]})"
            for a, b in sorted(arrows) if (b, a) in arrows]


def test_imports_run_down_between_packages_too():
    """A package never imports one that imports it back (no two-way arrows between folders)."""
    back = _back_arrows(GRAPH)
    assert not back, "; ".join(back)


def test_a_known_back_arrow_is_caught():
    graph = {**GRAPH, "hfpipe.models.stage": GRAPH["hfpipe.models.stage"] | {"hfpipe.pipeline.schedule"}}
    assert any(a.startswith("models -> pipeline") for a in _back_arrows(graph))


def test_a_known_circle_is_caught():
    """The checker itself: a graph with a circle is reported (so the tests above can fail)."""
    saved = dict(GRAPH)
    try:
        GRAPH["hfpipe.errors"] = {"hfpipe.api"}
        assert _cycle_from("hfpipe.errors") is not None
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
