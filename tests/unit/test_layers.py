"""The package's layer rules, read from the source with an AST walk (no import needed).

Rooms, bottom to top: core < judge < measure < runtime < probes < ingest, explain, callback < attach <
render < session < the top-level modules (cli, api, snapshot, adapters). A room imports only rooms below
it (and itself); imports under `if TYPE_CHECKING:` are types only and are not counted.
Besides: no torch where judging happens, rich only where rendering happens, pynvml only in
measure/nvml.py, `os._exit` and the literal exit code 124 only in core/exits.py.
docs/architecture.md states the same rules for people.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "judge": {"core", "judge"},
    "measure": {"core", "judge", "measure"},  # judge for formats it parses (the Flight Recorder's entries)
    "runtime": {"core", "measure", "judge", "runtime"},
    "probes": {"core", "measure", "judge", "runtime", "probes"},
    "explain": {"core", "judge", "explain"},
    "history": {"core", "judge", "history"},  # the run store: sqlite3, the report JSON, busbw formulas
    "callback": {"core", "measure", "judge", "runtime", "probes", "history", "callback"},
    "attach": {"core", "callback", "attach"},  # `ddpdoctor run`: finds the Doctor's objects in a running script
    "render": {"core", "judge", "probes", "explain", "history", "render"},
    "ingest": {"core", "judge", "probes", "ingest"},  # other tools' outputs into the probes' facts
    "session": {"core", "measure", "judge", "runtime", "probes", "render", "session"},
}
TOP_LEVEL_MAX = 12


def _sources() -> Iterator[tuple[str, pathlib.Path]]:
    """(dotted module name, path) for every module of the installed package."""
    for path in sorted((ROOT / "ddpdoctor").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(rel.parts), path
    for path in sorted((ROOT / "probes").rglob("*.py")):
        rel = path.relative_to(ROOT / "probes").with_suffix("")
        yield ".".join(("ddpdoctor", "probes") + rel.parts), path


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    return "top"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _imports(module: str, path: pathlib.Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import outside `if TYPE_CHECKING:`, lazy ones included."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # `from ddpdoctor.core import keys` imports ddpdoctor.core.keys
                yield f"{target}.{alias.name}", node.lineno


SOURCES = list(_sources())
IMPORTS = {module: list(_imports(module, path)) for module, path in SOURCES}
MODULES = {module for module, _ in SOURCES}


def _ours(target: str) -> str | None:
    """The module of ours that `target` names (a package or a module), else None."""
    while target:
        if target in MODULES or f"{target}.__init__" in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def test_every_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, imports in IMPORTS.items():
        room = _room(module)
        if room == "top":
            continue
        for target, line in imports:
            ours = _ours(target)
            if ours is None or ours in ("ddpdoctor",):  # the package root: __version__ only
                continue
            if _room(ours) not in ALLOWED[room]:
                wrong.append(f"{module}:{line} ({room}) imports {ours} ({_room(ours)})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_rooms_form_no_cycle():
    edges: dict[str, set[str]] = {}
    for module, imports in IMPORTS.items():
        for target, _ in imports:
            ours = _ours(target)
            if ours and ours != "ddpdoctor" and _room(ours) != _room(module):
                edges.setdefault(_room(module), set()).add(_room(ours))
    seen: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(room: str, path: list[str]) -> None:
        seen[room] = 1
        for nxt in sorted(edges.get(room, ())):
            assert seen.get(nxt) != 1, f"import cycle: {' -> '.join(path + [nxt])}"
            if nxt not in seen:
                visit(nxt, path + [nxt])
        seen[room] = 2

    for room in sorted(edges):
        if room not in seen:
            visit(room, [room])


def _modules_importing(prefix: str) -> set[str]:
    return {m for m, imports in IMPORTS.items() for target, _ in imports
            if target == prefix or target.startswith(prefix + ".")}


def test_judging_rooms_never_import_torch():
    """core, judge and explain run on recorded facts and logs, where torch may not be installed."""
    offenders = {m for m in _modules_importing("torch") if _room(m) in ("core", "judge", "explain")}
    assert not offenders, offenders


def test_rich_only_where_rendering_happens():
    allowed = {m for m in MODULES if _room(m) == "render" or m.endswith(".render")} | {"ddpdoctor.cli"}
    assert _modules_importing("rich") <= allowed, _modules_importing("rich") - allowed


def test_pynvml_only_in_the_nvml_module():
    assert _modules_importing("pynvml") == {"ddpdoctor.measure.nvml"}


def test_measure_and_ingest_never_build_a_finding():
    """A reading is recorded (in a snapshot, a report, the probes' facts) before it is judged."""
    builders = []
    for module, path in SOURCES:
        if _room(module) not in ("measure", "ingest"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Finding":
                builders.append(f"{module}:{node.lineno}")
    assert not builders, builders


def test_only_core_exits_leaves_the_process_and_spells_124():
    exits, literals = [], []
    for module, path in SOURCES:
        if module == "ddpdoctor.core.exits":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_exit" and ast.unparse(node.value) == "os":
                exits.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value == 124:
                literals.append(f"{module}:{node.lineno}")
    assert not exits, f"os._exit outside core/exits.py: {exits}"
    assert not literals, f"the literal 124 outside core/exits.py: {literals}"


def test_at_most_a_dozen_modules_stay_at_the_top():
    top = sorted(p.name for p in (ROOT / "ddpdoctor").glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, top


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_every_room_says_what_it_is_for(room):
    init = ROOT / ("probes" if room == "probes" else f"ddpdoctor/{room}") / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc) > 40, f"{init} needs a docstring saying what the room is for"


def test_the_probe_names_below_the_probes_are_the_registry():
    from ddpdoctor.core.probe_names import PROBE_NAMES
    from ddpdoctor.probes import all_probes

    assert tuple(all_probes()) == PROBE_NAMES


def test_the_rule_reader_sees_a_wrong_import(tmp_path):
    """The walk itself: a core module importing a probe, lazily, is caught; under TYPE_CHECKING it is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ddpdoctor.probes import get_probe\n")
    ok = tmp_path / "ok.py"
    ok.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddpdoctor.probes import get_probe\n")
    assert ("ddpdoctor.probes", 2) in list(_imports("ddpdoctor.core.bad", bad))
    assert not [t for t, _ in _imports("ddpdoctor.core.ok", ok) if t.startswith("ddpdoctor")]


KEY_SHAPE = ("hello/", "hellos/", "hb/", "timeline/", "error/", "timeout/", "done/", "fr/", "result/", "bye/",
             "terminated/", "localise/", "clock/", "scaling/", "ddpdoctor/watch/", "ddpdoctor/host/", "ddpdoctor/hang/")


def test_every_store_key_is_built_in_core_keys():
    """A key is a contract between processes: spelled in one place, a rename cannot leave a reader behind."""
    spelled = []
    for module, path in SOURCES:
        if module == "ddpdoctor.core.keys":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith(KEY_SHAPE):
                spelled.append(f"{module}:{node.lineno}: {head.value!r}")
    assert not spelled, spelled
