"""A fresh environment holds only what pyproject.toml installs, and ddpdoctor must work there.

torch does not install numpy, and hashing the weights with `tensor.numpy()` once made every
`check` in a fresh virtual environment end CRITICAL (RUN003 "Numpy is not available").
The static test holds on any machine; the others run ddpdoctor where numpy cannot be imported.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from ddpdoctor.runtime.workload import build_model, weights_sha256

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("ddpdoctor", "probes")  # probes/ installs as ddpdoctor.probes
# A distribution whose module has another name; the rest import as their name with - as _.
MODULE_OF = {"nvidia-ml-py": "pynvml"}
# Never dependencies: imported inside one function of one file, only for the users who asked.
OPTIONAL = {
    "lightning": ("ddpdoctor/adapters.py", "lightning_callback(), for Lightning users (the adapters extra)"),
    "pytorch_lightning": ("ddpdoctor/adapters.py", "lightning_callback()'s fallback: Lightning's older name"),
    "transformers": ("ddpdoctor/adapters.py", "hf_callback(), for Hugging Face Trainer users (the adapters extra)"),
    "matplotlib": (("probes/allreduce/outputs.py", "ddpdoctor/render/history.py"),
                   "allreduce-bench --plot x.png and history --plot only; without it a usage error says so"),
    "plotly": ("ddpdoctor/render/html_report.py",
               "--html pages' charts only (the html extra); without it the page keeps the figures as tables"),
}
# Emulates a machine without numpy: the path finder does not see it, so `import numpy`
# fails and importlib.util.find_spec("numpy") is None, as where it was never installed
# (torch._dynamo asks find_spec; a finder that raised would break it where absence does not).
NO_NUMPY = '''
from importlib.machinery import PathFinder

_find_spec = PathFinder.find_spec.__func__


def find_spec(cls, name, path=None, target=None):
    if name.partition(".")[0] == "numpy":
        return None
    return _find_spec(cls, name, path, target)


PathFinder.find_spec = classmethod(find_spec)
'''


def _imports(node: ast.AST, in_function: bool = False) -> Iterator[tuple[str, bool]]:
    """(top-level module, imported inside a function?) for each absolute import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            yield from ((alias.name.partition(".")[0], in_function) for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            yield child.module.partition(".")[0], in_function
        yield from _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _imports_by_module() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(file relative to the checkout, inside a function?)] over every source file."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            for module, in_function in _imports(ast.parse(path.read_text(), filename=where)):
                found.setdefault(module, []).append((where, in_function))
    return found


def _places(where: Any) -> tuple[str, ...]:
    """OPTIONAL's file, or files where a module is optional in several."""
    return where if isinstance(where, tuple) else (where,)


def _declared_modules() -> set[str]:
    """The modules `[project] dependencies` installs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11: the installed metadata lists the same requirements
        from importlib.metadata import requires

        requirements = [r for r in requires("ddpdoctor") or [] if "extra ==" not in r]
    else:
        requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in requirements}
    return {MODULE_OF.get(name, name.replace("-", "_")) for name in names}


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is new in 3.10")
def test_every_import_is_stdlib_ours_declared_or_optional():
    allowed = set(sys.stdlib_module_names) | {"ddpdoctor"} | _declared_modules()
    wrong = []
    for module, places in sorted(_imports_by_module().items()):
        if module in allowed:
            continue
        where, why = OPTIONAL.get(module, (None, None))
        wrong += [f"{file}: {module}" + (" at import time" if where == file else " is not declared")
                  for file, in_function in places if file not in _places(where) or not in_function]
    assert not wrong, "imports a fresh `pip install -e .` lacks:\n" + "\n".join(wrong)


def test_declared_and_optional_lists_name_what_the_code_imports():
    """A renamed module (pynvml) or a dropped adapter must not leave the lists above vouching for nothing."""
    imported = _imports_by_module()
    assert _declared_modules() <= set(imported), _declared_modules() - set(imported)
    for module, (where, why) in OPTIONAL.items():
        for place in _places(where):
            assert (place, True) in imported.get(module, []), f"{module}: no longer imported in {place} ({why})"


def test_weights_digest_is_the_hand_checked_one():
    # 0.0 .. 5.0 as little-endian float32, the bytes numpy's tobytes() gave on x86 and arm64.
    expected = "e2c0a71510b5394df7773b63fb5f54372b84c3564e67811bde7d665be227976d"
    assert hashlib.sha256(struct.pack("<6f", 0, 1, 2, 3, 4, 5)).hexdigest() == expected
    assert weights_sha256(torch.arange(6, dtype=torch.float32)) == expected
    assert weights_sha256(torch.empty(0)) == hashlib.sha256(b"").hexdigest()


def test_weights_digest_is_the_one_numpy_gave():
    """The same weights keep their digest across the change: reports stay comparable."""
    pytest.importorskip("numpy")
    model = build_model(torch.device("cpu"), seed=7)
    flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])
    assert weights_sha256(flat) == hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    for view in (flat[5:1005], flat[:600].reshape(20, 30).t()):  # an offset and a strided view
        assert weights_sha256(view) == hashlib.sha256(view.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture
def no_numpy_env(tmp_path: Path) -> dict[str, str]:
    """Environment variables under which no Python process (ranks included) can import numpy."""
    folder = tmp_path / "no-numpy"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(NO_NUMPY)
    path = [str(folder), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_every_module_imports_without_numpy(no_numpy_env):
    script = textwrap.dedent('''
        import importlib, importlib.util, pkgutil, sys
        try:
            import numpy
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("numpy was not blocked")
        assert importlib.util.find_spec("numpy") is None
        import ddpdoctor, ddpdoctor.probes
        names = [info.name for package in (ddpdoctor, ddpdoctor.probes)
                 for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
        for name in names:
            importlib.import_module(name)
        assert "numpy" not in sys.modules
        print(len(names), " ".join(names))
    ''')
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **no_numpy_env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = done.stdout.split()
    assert "ddpdoctor.runtime.workload" in imported and "ddpdoctor.probes.allreduce.outputs" in imported
    assert int(imported[0]) > 50, done.stdout


@pytest.mark.ranks
@pytest.mark.slow
def test_check_passes_without_numpy(tmp_path, no_numpy_env):
    """check on 2 ranks where numpy cannot be imported: OK, the same weights' hash, no NumPy warning.

    Default twin: tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm (the same
    check on 2 ranks, asserting no NumPy line on stderr; CI's fresh venv has no numpy at all, so there
    it runs exactly this; numpy is hidden here for machines that have it)."""
    from tests.ranks.harness import assert_nothing_left, probe_section, run_check

    run = run_check(tmp_path, "--nproc", "2", "--timeout", "60", env=no_numpy_env)
    assert run.returncode == 0, run.explain()
    assert run.report["verdict"] == "ok", run.explain()
    hashes = {r["param_sha256"] for r in probe_section(run.report, "ddp-smoke")["facts"].values()}
    assert len(hashes) == 1 and len(hashes.pop()) == 64, run.explain()
    # torch warns "Failed to initialize NumPy" on import without numpy: not a line for our users
    # (and it broke every "one line" error of the launch-mode tests in a fresh venv).
    assert "NumPy" not in run.stderr, run.stderr
    assert_nothing_left(run)
