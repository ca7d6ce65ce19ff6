"""How reliably does the `stragglers` probe name a slow rank, with the right cause, and stay quiet when healthy?

Each case runs `ddpdoctor check --probes stragglers` --runs times on --nproc CPU ranks and counts the runs whose
findings name exactly the injected rank with the expected cause (or, healthy, name nobody).

    python benchmarks/stragglers_detection.py --runs 20                    # the issue's bar: healthy, 20% slower
    python benchmarks/stragglers_detection.py --runs 10 --factors 1.05,1.1,1.15   # the smallest slowdown detected
    python benchmarks/stragglers_detection.py --runs 3 --keep /tmp/runs    # keep every JSON report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional


def one_run(nproc: int, inject: Optional[str], keep: Optional[str], tag: str, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"{tag}.json")
        cmd = [sys.executable, "-m", "ddpdoctor", "check", "--nproc", str(nproc), "--probes", "stragglers",
               "--no-live", "--straggler-seconds", str(seconds), "--json", path]
        if inject:
            cmd += ["--inject", inject]
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=600)
        wall = time.perf_counter() - started
        report = json.load(open(path))
    named = [f for f in report["findings"] if f["code"] == "STR001"]
    uneven = [f for f in report["findings"] if f["code"] == "STR003"]
    return {"exit": proc.returncode, "wall_s": round(wall, 1),
            "named": sorted(r for f in named for r in f["ranks"]),
            "causes": [f["evidence"].get("cause") for f in named],
            "uneven": sorted(r for f in uneven for r in f["ranks"])}


def judge(run: dict, rank: Optional[int], cause: Optional[str]) -> bool:
    if rank is None:
        return not run["named"] and not run["uneven"]
    if cause == "uneven work":
        return run["uneven"] == [rank] and not run["named"]
    return run["named"] == [rank] and run["causes"] == [cause]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rank", type=int, default=2, help="the rank made slow")
    parser.add_argument("--factors", default="1.2", help="slow-compute factors to try (comma-separated)")
    parser.add_argument("--data-ms", type=float, default=None, help="also a slowdata case with this stall (ms)")
    parser.add_argument("--no-healthy", action="store_true")
    parser.add_argument("--seconds", type=float, default=5.0, help="--straggler-seconds per run")
    parser.add_argument("--keep", metavar="DIR", help="keep every JSON report in DIR")
    args = parser.parse_args()
    cases: list[tuple[str, Optional[str], Optional[int], Optional[str]]] = []
    if not args.no_healthy:
        cases.append(("healthy", None, None, None))
    for factor in (float(x) for x in args.factors.split(",") if x):
        cases.append((f"slow x{factor:g}", f"slow:rank={args.rank}:factor={factor:g}", args.rank, "compute"))
    if args.data_ms is not None:
        cases.append((f"slowdata {args.data_ms:g} ms", f"slowdata:rank={args.rank}:ms={args.data_ms:g}", args.rank,
                      "data loading"))
    print(f"{args.nproc} CPU ranks, {args.runs} runs per case, {args.seconds:g} s of steps per run")
    print(f"{'case':<18} {'right':>6} {'wrong runs (named ranks / causes)':<40} {'median wall s':>13}")
    for name, inject, rank, cause in cases:
        runs = [one_run(args.nproc, inject, args.keep, f"{name.replace(' ', '_')}-{i}", args.seconds)
                for i in range(args.runs)]
        right = sum(judge(r, rank, cause) for r in runs)
        wrong = [f"{r['named']}/{r['causes']}" + (f" uneven {r['uneven']}" if r["uneven"] else "")
                 for r in runs if not judge(r, rank, cause)]
        walls = sorted(r["wall_s"] for r in runs)
        print(f"{name:<18} {right:>3}/{len(runs):<2} {'; '.join(wrong)[:40]:<40} {walls[len(walls) // 2]:>13}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
