"""How reliably does each framework adapter name each fault, and stay quiet on a healthy fit?

Runs tests/ranks/adapter_fit.py --runs times per framework on 2 CPU ranks (gloo, unpinned but for
the hog scenario), every scenario in one job after the other (healthy, a slow dataset on rank 1, a
busy process on rank 1's core, an unsharded loader, rank 1's loss going NaN), and with --hang one
more job per run where rank 1 deadlocks in a training step. A scenario is right when its fault is
named first with the right rank and cause and nothing else is above information; a healthy fit is
right when nothing is (adapter_fit.wrong). Needs lightning, transformers and accelerate
(`pip install -e ".[adapters]"`).

    python benchmarks/adapters_detection.py --runs 20
    python benchmarks/adapters_detection.py --runs 5 --frameworks hf --hang
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ranks"))
import adapter_fit  # noqa: E402  (tests/ranks/adapter_fit.py: the fits and what is right for each)

FIT = os.path.join(HERE, "..", "tests", "ranks", "adapter_fit.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_job(framework: str, scenarios: list[str], timeout_s: float = 300, extra_env: dict | None = None) -> dict[str, str]:
    """Each scenario's verdict: "" (right) or what was wrong. `extra_env`: ADAPTER_FIT_STEPS, ADAPTER_FIT_DEFAULTS."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix, port = os.path.join(tmp, framework), _port()
        cmd = [sys.executable, FIT, framework, "--json", prefix, "--scenarios", ",".join(scenarios)]
        procs = [subprocess.Popen(cmd, cwd=tmp, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                         OMP_NUM_THREADS="1", **(extra_env or {})),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            errs = [p.communicate(timeout=timeout_s)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        out = {}
        for scenario in scenarios:
            path = f"{prefix}.{scenario}.json"
            if scenario == "hang":
                out[scenario] = hang_wrong(path)
            elif not os.path.exists(path):
                out[scenario] = f"no report (exit {[p.returncode for p in procs]}: {errs[0][-300:]!r})"
            else:
                with open(path) as f:
                    out[scenario] = adapter_fit.wrong(scenario, json.load(f)["findings"])
        return out


def hang_wrong(path: str) -> str:
    """Rank 0's DOC007 names rank 1, stuck in its own code, and rank 0 only waited."""
    try:
        with open(path) as f:
            found = {x["code"]: x for x in json.load(f)["findings"]}
    except (OSError, ValueError):
        return "no report"
    hang = found.get("DOC007")
    if hang is None:
        return f"no DOC007: {sorted(found)}"
    if hang["ranks"] != [1] or hang["evidence"].get("cause_by_rank") != {"1": "own code"}:
        return f"DOC007 named {hang['ranks']} {hang['evidence'].get('cause_by_rank')}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--frameworks", default="lightning,hf,accelerate")
    parser.add_argument("--scenarios", default=",".join(adapter_fit.SCENARIOS))
    parser.add_argument("--hang", action="store_true", help="one more job per run: a rank deadlocked in a step")
    parser.add_argument("--steps", type=int, help="every fit this many steps (the end of the run's verdict, issue 53)")
    parser.add_argument("--doctor-defaults", action="store_true",
                        help="the Doctor's own check schedule (every 50 steps, at most every 2 s), not the tests' 20")
    args = parser.parse_args()
    frameworks, scenarios = args.frameworks.split(","), args.scenarios.split(",")
    wrong: dict[tuple[str, str], list[str]] = defaultdict(list)
    began = time.monotonic()
    for i in range(args.runs):
        for framework in frameworks:
            extra = ({"ADAPTER_FIT_STEPS": str(args.steps)} if args.steps else {}) | (
                {"ADAPTER_FIT_DEFAULTS": "1"} if args.doctor_defaults else {})
            result = one_job(framework, scenarios, extra_env=extra)
            if args.hang:
                result.update(one_job(framework, ["hang"], timeout_s=120))
            for scenario, why in result.items():
                wrong[(framework, scenario)].append(why)
            print(f"run {i + 1} {framework}: " + ", ".join(f"{s} {'ok' if not w else w}" for s, w in result.items()),
                  flush=True)
    print(f"\n{args.runs} runs in {time.monotonic() - began:.0f} s\n")
    print("| framework | scenario | right | what was wrong |\n|---|---|---|---|")
    for (framework, scenario), whys in wrong.items():
        bad = [w for w in whys if w]
        print(f"| {framework} | {scenario} | {len(whys) - len(bad)}/{len(whys)} | {'; '.join(bad) or ''} |")


if __name__ == "__main__":
    main()
