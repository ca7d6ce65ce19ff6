"""The Python API for `check` and `scaling`: the same runs as the CLI, with your factories as functions.

    import ddpdoctor.api as dd
    report = dd.scaling(model=build_model, batch=make_batch, nproc=4, lr=3e-4)
    print(report["exit_code"], [f["code"] for f in report["findings"]])

The ranks are separate processes started by the standalone launcher (as `ddpdoctor check`
does), so a model factory is passed to them by name: it must be a function at module level
(of an importable module, or of the script being run). The call returns the JSON report
as a dict; the run's verdict is its `exit_code` (0 ok, 1 warning, 2 critical, 3 unknown).
Inside a job that torchrun or srun started, run `python -m ddpdoctor ...` as a step of its
own instead: a rank's process cannot also launch ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional, Union

from ddpdoctor.core.errors import UsageError

Factory = Union[str, Callable[..., Any], None]
RANK_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID")
CHILD_VAR = "DDPDOCTOR_API_CHILD"  # set in the run the API starts: a script that calls the API at import
GRACE_S = 10.0


def factory_spec(value: Factory, flag: str) -> Optional[str]:
    """A function → `module:name`, or `path/to/script.py:name` for the script being run."""
    if value is None or isinstance(value, str):
        return value
    name = getattr(value, "__qualname__", "")
    module = getattr(value, "__module__", None)
    if not callable(value) or not name or "<" in name or not module:
        raise UsageError(f"{flag}: give a function defined at module level (not a lambda, a nested function or "
                         f"{type(value).__name__}), or a 'module:function' string")
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            return f"{spec.name}:{name}"  # `python -m pkg.script`: its own name keeps relative imports working
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main_file:
            raise UsageError(f"{flag}: {name} is defined in an interactive session; put it in a file and pass "
                             "'path/to/file.py:function'")
        return f"{os.path.abspath(main_file)}:{name}"
    return f"{module}:{name}"


def _run(command: str, args: list[str], timeout_s: Optional[float]) -> dict[str, Any]:
    if os.environ.get(CHILD_VAR):
        raise UsageError("ddpdoctor.api was called while loading --model or --batch: the script calls the API at "
                         "import; put that call under `if __name__ == \"__main__\":`")
    busy = [v for v in RANK_VARS if v in os.environ]
    if busy:
        raise UsageError(f"ddpdoctor.api runs its own ranks, but this process is a rank already ({busy[0]} is set): "
                         f"run `python -m ddpdoctor {command}` as a job step of its own")
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-api-") as tmp:
        path = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "ddpdoctor", command, "--no-live", "--json", path, *args]
        path_now = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, CHILD_VAR: "1",  # and the modules the caller imports are found by name there too
               "PYTHONPATH": os.pathsep.join(filter(None, [path_now, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd(),
                                env=env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the launcher stops its ranks and writes what it has
            try:
                stdout, stderr = proc.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            if not os.path.exists(path):
                raise UsageError(f"ddpdoctor {command} did not finish within {timeout_s:g}s") from None
        if not os.path.exists(path):
            said = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise UsageError(said.removeprefix("ddpdoctor: error: "))
        with open(path, encoding="utf-8") as handle:
            report: dict[str, Any] = json.load(handle)
    report["stdout"] = stdout
    return report


def _common(nproc: Optional[int], model: Factory, batch: Factory, extra: dict[str, Any]) -> list[str]:
    args: list[str] = []
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    for flag, value in (("--model", factory_spec(model, "model")), ("--batch", factory_spec(batch, "batch"))):
        if value is not None:
            args += [flag, value]
    for key, value in extra.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple))
                                              else str(value)]
    return args


def check(*, model: Factory = None, batch: Factory = None, nproc: Optional[int] = None,
          probes: Optional[Union[str, list[str]]] = None, timeout: Optional[float] = None,
          run_timeout_s: Optional[float] = 900, **flags: Any) -> dict[str, Any]:
    """`ddpdoctor check`; other CLI flags as keywords (`inject="slow:rank=1:factor=2"`)."""
    return _run("check", _common(nproc, model, batch, dict(flags, probes=probes, timeout=timeout)), run_timeout_s)


def scaling(*, model: Factory = None, batch: Factory = None, nproc: Optional[int] = None,
            sizes: Optional[list[int]] = None, seconds: Optional[float] = None, lr: Optional[float] = None,
            run_timeout_s: Optional[float] = 1800, **flags: Any) -> dict[str, Any]:
    """`ddpdoctor scaling`; other CLI flags as keywords (`min_efficiency="2:90,8:75"`, `no_knobs=True`)."""
    return _run("scaling", _common(nproc, model, batch, dict(flags, sizes=sizes, seconds=seconds, lr=lr)),
                run_timeout_s)
