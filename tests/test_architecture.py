"""Spec of the house (ARCHITECTURE.md): imports run downwards (between modules and between rooms),
few floors (counted between modules and between rooms), few top modules, short files, one definition per
public name.

A room is a folder (``pipeline/``, ``cli/``) or a module at the top of ``hfpipe/`` (``hfpipe/api.py``); a
floor is a step of the longest import chain, so a room's floor is one above the highest room it imports.

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


def _cycle_from(start: str, graph: dict | None = None) -> list[str] | None:
    """A path start -> ... -> start, if the graph (modules by default, or rooms) has one."""
    graph = GRAPH if graph is None else graph
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
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


def _room_graph(graph) -> dict[str, set[str]]:
    """Room -> the rooms it imports (its own modules left out)."""
    rooms: dict[str, set[str]] = {}
    for a, targets in graph.items():
        rooms.setdefault(_package(a), set()).update(_package(b) for b in targets if _package(b) != _package(a))
    for targets in list(rooms.values()):
        for b in targets:
            rooms.setdefault(b, set())
    return rooms


def _longest_chain(rooms: dict[str, set[str]]) -> list[str]:
    """The longest import chain between rooms, top first (its length is the number of floors)."""

    @lru_cache(None)
    def chain(room: str) -> tuple[str, ...]:
        return (room, *max((chain(b) for b in rooms[room]), key=len, default=()))

    return list(max((chain(r) for r in rooms), key=len))


def _room_cycle(rooms: dict[str, set[str]]) -> list[str] | None:
    return next((c for c in (_cycle_from(r, rooms) for r in sorted(rooms)) if c), None)


def test_the_rooms_have_no_circle_and_at_most_nine_floors():
    """Folders count as well as modules: lora -> quant adds a floor even when no module circle does."""
    rooms = _room_graph(GRAPH)
    assert _room_cycle(rooms) is None, " -> ".join(_room_cycle(rooms))
    chain = _longest_chain(rooms)
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors: " + " -> ".join(chain)


def test_a_tenth_floor_of_rooms_is_caught():
    """The checker itself: a tower of ten rooms each importing the one below counts ten floors, and one
    arrow from the floor of the house up to its top is a circle between rooms."""
    tower = {f"hfpipe.room{i}.m": {f"hfpipe.room{i - 1}.m"} if i else set() for i in range(MAX_FLOORS + 1)}
    assert len(_longest_chain(_room_graph(tower))) == MAX_FLOORS + 1
    looped = _room_graph({**GRAPH, "hfpipe.errors": {"hfpipe.cli.main"}})
    assert _room_cycle(looped) is not None


#: Names several modules define on purpose, each the same plug-in interface: a family file's ``ADAPTERS``
#: (gathered by ``models/registry.py``) and an axis's pricing module (``plan/tensor.py``, ``plan/context.py``,
#: ``plan/experts.py``, ``plan/quant.py``: what ``plan/report.py`` asks each of them).
PLUGIN_NAMES = {"ADAPTERS", "describe", "layer_bytes", "price_ranks"}


def _public_definitions() -> dict[str, list[str]]:
    defined: dict[str, list[str]] = {}
    for name, path in MODS.items():
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
            for n in names:
                if not n.startswith("_"):
                    defined.setdefault(n, []).append(name)
    return defined


def test_every_public_name_is_defined_once():
    """One name, one thing: a second ``PipelineTrainer`` or ``load_pipeline`` is a rename, not a layer."""
    twice = {n: where for n, where in _public_definitions().items() if len(where) > 1 and n not in PLUGIN_NAMES}
    assert not twice, twice


def test_a_known_circle_is_caught():
    """The checker itself: a graph with a circle is reported (so the tests above can fail)."""
    saved = dict(GRAPH)
    try:
        GRAPH["hfpipe.errors"] = {"hfpipe.api"}
        assert _cycle_from("hfpipe.errors") is not None
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


# ---- the suite mirrors the package ------------------------------------------------------------------------
TESTS = ROOT / "tests"
#: The rooms a test folder may be named for: hfpipe's packages, its top modules (``tests/api/``) and the CLI.
TEST_ROOMS = ({p.name for p in (ROOT / "hfpipe").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
              | {p.stem for p in (ROOT / "hfpipe").glob("*.py")} | {"cli"})


def _misplaced_tests(paths) -> list[str]:
    """Test files outside a folder named for a room, or not named for their folder's room; a file at the top
    of tests/ is named for a top module of hfpipe (``test_verify.py``) or for the house and its README."""
    top = {p.stem for p in (ROOT / "hfpipe").glob("*.py")} | {"architecture", "readme", "readme_commands"}
    bad = []
    for path in paths:
        rel = path.relative_to(TESTS)
        stem = path.stem.removeprefix("test_")
        if len(rel.parts) == 1:
            ok = stem in top
        else:
            ok = len(rel.parts) == 2 and rel.parts[0] in TEST_ROOMS and stem.split("_")[0] == rel.parts[0]
        if not ok:
            bad.append(str(rel))
    return bad


def test_the_suite_has_a_folder_per_package_and_names_that_map_to_it():
    bad = _misplaced_tests(sorted(TESTS.rglob("test_*.py")))
    assert not bad, bad


def test_a_test_named_for_its_history_is_caught():
    assert _misplaced_tests([TESTS / "test_trust_round3b.py", TESTS / "plan" / "test_round_two.py"]) == [
        "test_trust_round3b.py", "plan/test_round_two.py"]
