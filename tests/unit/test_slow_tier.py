"""The `slow` tier holds only tests whose path a default test already crosses, and says which.

Why: the default run must stay within 10 minutes on 2 cores (issue 40), and a test moved out of
it must not take its path out of CI with it. Each test marked `@pytest.mark.slow` names, in its
docstring, a line `Default twin: tests/ranks/test_x.py::test_y` (with what the twin shares); the
twin must exist and run in the default tier (not be marked slow itself, or have a default case
where it is parametrised with slow cases), so two tests cannot each point at the other.
Read from the source (ast), not from a collection: it runs in milliseconds and names the file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Optional

TESTS = Path(__file__).resolve().parents[1]
TWIN = re.compile(r"Default twin:\s*(tests/[\w/]+\.py)::(test_\w+)")


def _is_slow_mark(node: ast.expr) -> bool:
    """`pytest.mark.slow` (the decorator), not `pytest.mark.slow` inside a parameter's marks."""
    return isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "mark"


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def _slow(fn: ast.FunctionDef) -> bool:
    return any(_is_slow_mark(d) for d in fn.decorator_list)


def _twin(fn: ast.FunctionDef) -> Optional[tuple[str, str]]:
    m = TWIN.search(ast.get_docstring(fn) or "")
    return (m.group(1), m.group(2)) if m else None


def _all_slow() -> list[tuple[Path, ast.FunctionDef]]:
    return [(path, fn) for path in sorted(TESTS.rglob("test_*.py")) for fn in _functions(path).values() if _slow(fn)]


def test_every_slow_test_names_a_default_twin_that_exists_and_runs_by_default():
    problems = []
    for path, fn in _all_slow():
        where = f"{path.relative_to(TESTS.parent)}::{fn.name}"
        twin = _twin(fn)
        if twin is None:
            problems.append(f"{where}: no 'Default twin: tests/...py::test_...' line in its docstring")
            continue
        target = TESTS.parent / twin[0]
        if not target.is_file():
            problems.append(f"{where}: its twin's file {twin[0]} does not exist")
            continue
        other = _functions(target).get(twin[1])
        if other is None:
            problems.append(f"{where}: {twin[0]} has no {twin[1]}")
        elif _slow(other):
            problems.append(f"{where}: its twin {twin[1]} is in the slow tier too")
    assert not problems, "\n".join(problems)


def test_the_rule_sees_a_missing_twin_and_a_slow_twin(tmp_path):
    """The reader itself: a slow test without the line, and one whose twin is slow, are both caught."""
    src = ('import pytest\n@pytest.mark.slow\ndef test_a():\n    """Default twin: tests/x.py::test_b"""\n'
           '@pytest.mark.slow\ndef test_b():\n    """nothing"""\ndef test_c():\n    pass\n')
    path = tmp_path / "test_x.py"
    path.write_text(src)
    fns = _functions(path)
    assert _slow(fns["test_a"]) and _slow(fns["test_b"]) and not _slow(fns["test_c"])
    assert _twin(fns["test_a"]) == ("tests/x.py", "test_b") and _twin(fns["test_b"]) is None
