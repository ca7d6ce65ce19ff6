"""How short can a run be and still end with the right verdict? The end of the run's check (issue 53), measured.

For each fault, 2-rank runs of tests/ranks/doctor_loop.py (a plain DDP loop, a DistributedSampler, the Doctor at
its defaults: checks every 50 steps but at most every 2 s) of growing length, --runs runs a length; a run is right
when rank 0's JSON names the fault (its code, rank and cause) and nothing else at warn or worse; healthy, when it
names nothing at warn or worse. The first length right in 9 of 10 (--need of --runs) is the answer, in steps and in
seconds (the summary's wall time, median). A length stops once it can no longer reach --need.

Faults, each sized from this host's own healthy step (its median, measured first, `calibrate`), so the job slows as
the issue sets it whatever the host:
- hog: the ranks pinned one to a core, a busy process on rank 1's core (runtime/outside_faults.py, 100%);
- slow4x, slow1.5x: rank 1's loader sleeps 3 and 0.5 healthy steps a step (the job 4x and 1.5x slower);
- backward: rank 1 spins one healthy step inside its backward pass (a hook on a gradient; the job about 2x);
- noepoch: DistributedSampler.set_epoch never called (DOC003; needs a second epoch: 8 steps an epoch here);
- nosampler: no DistributedSampler (DOC001);
- healthy: nothing (false alarms).

    python benchmarks/end_of_run_detection.py                                  # every fault, 10 runs a length
    python benchmarks/end_of_run_detection.py --faults healthy --lengths 100,400 --runs 20
    python benchmarks/end_of_run_detection.py --via run    # the same faults in tests/ranks/plain_train.py, a script
                                                           # with nothing of ddpdoctor in it, under `ddpdoctor run`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stragglers_detection import _loop_run  # noqa: E402  (two ranks pinned or not, a fault from outside on rank 1)

LOOP = os.path.join(HERE, "..", "tests", "ranks", "doctor_loop.py")
PLAIN = os.path.join(HERE, "..", "tests", "ranks", "plain_train.py")  # the same loop and faults, unedited
VIA = {"via": "doctor"}  # --via: "doctor" (doctor_loop.py calls the Doctor) or "run" (`ddpdoctor run` attaches)
BATCHES = 8  # doctor_loop.py's batches per rank and epoch
# fault -> (doctor_loop case, expected code, rank, cause, pinned)
FAULTS: dict[str, tuple[str, Optional[str], Optional[int], Optional[str], bool]] = {
    "healthy": ("healthy", None, None, None, False),
    "hog": ("healthy", "STR001", 1, "CPU contention", True),
    "slow4x": ("slowdata", "STR001", 1, "data loading", False),
    "slow1.5x": ("slowdata", "STR001", 1, "data loading", False),
    "backward": ("backward", "STR001", 1, "compute", False),
    "noepoch": ("noepoch", "DOC003", None, None, False),
    "nosampler": ("nosampler", "DOC001", None, None, False),
}
SLOW_STEPS = {"slow4x": 3.0, "slow1.5x": 0.5}  # rank 1's extra loading, in healthy steps


def one_run(case: str, steps: int, flags: list[str], pinned: bool, hog: bool) -> dict[str, Any]:
    """Two ranks of the loop (started and torn down as stragglers_detection.py's callback runs are); rank 0's JSON
    report (findings and summary)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        epochs = str(max(1, steps // BATCHES))
        if VIA["via"] == "run":
            cmd = [sys.executable, "-m", "ddpdoctor", "run", "--json", path, "--every", "50", "--check-every-s", "2",
                   "--no-summary", PLAIN, "--case", case, "--epochs", epochs, *flags]
        else:
            cmd = [sys.executable, LOOP, "--case", case, "--json", path, "--epochs", epochs,
                   "--every", "50", "--check-every-s", "2", *flags]
        _loop_run(cmd, dict(os.environ, OMP_NUM_THREADS="1"), "hog:rank=1:pct=100" if hog else None, pinned)
        return json.load(open(path)) if os.path.exists(path) else {"findings": [], "summary": None}


def right(report: dict[str, Any], fault: str) -> bool:
    _, code, rank, cause, _ = FAULTS[fault]
    loud = [f for f in report["findings"] if f["severity"] in ("warn", "critical")]
    if code is None:
        return not loud
    hits = [f for f in loud if f["code"] == code and (rank is None or f["ranks"] == [rank])
            and (cause is None or f["evidence"].get("cause") == cause)]
    # Another loud finding beside the right one is wrong, except what the fault itself makes true: a rank 4x
    # slower to load is also "the job waits in its collectives" for the others (STR005 names no rank then).
    others = [f for f in loud if f not in hits and f["code"] not in ("DOC021",)]
    return bool(hits) and not [f for f in others if f["code"] != "STR005"]


def calibrate(runs: int = 3) -> float:
    """This host's healthy median step (ms), from the loop's own summary."""
    medians = [one_run("healthy", 200, [], False, False)["summary"]["step_ms_median"] for _ in range(runs)]
    return statistics.median(medians)


def flags_for(fault: str, healthy_ms: float) -> list[str]:
    if fault in SLOW_STEPS:
        return ["--slow-ms", f"{SLOW_STEPS[fault] * healthy_ms:.2f}"]
    if fault == "backward":
        return ["--spin-ms", f"{healthy_ms:.2f}"]
    return []


def ladder(fault: str, lengths: list[int], runs: int, need: int, healthy_ms: float,
           keep: Optional[str] = None) -> list[dict[str, Any]]:
    """Each length in turn, until one is right in `need` of `runs` (healthy: every length)."""
    case, _, _, _, pinned = FAULTS[fault]
    out = []
    for steps in lengths:
        results, walls, slow = [], [], []
        for _ in range(runs):
            report = one_run(case, steps, flags_for(fault, healthy_ms), pinned, fault == "hog")
            results.append(right(report, fault))
            if keep and not results[-1]:  # a wrong run's report, whole, to read
                with open(os.path.join(keep, f"{fault}-{steps}-{len(results)}.json"), "w") as f:
                    json.dump(report, f, indent=1)
            s = report.get("summary") or {}
            walls.append(s.get("wall_s") or 0.0)
            slow.append(s.get("step_ms_median") or 0.0)
            if fault != "healthy" and results.count(False) > runs - need:
                break  # this length can no longer make it
        row = {"fault": fault, "steps": steps, "right": sum(results), "runs": len(results),
               "wall_s": round(statistics.median(walls), 1), "step_ms": round(statistics.median(slow), 2),
               "slowdown": round(statistics.median(slow) / healthy_ms, 2) if healthy_ms else None}
        out.append(row)
        print(json.dumps(row), flush=True)
        if fault != "healthy" and row["right"] >= need and row["runs"] == runs:
            break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--lengths", default="24,48,104,200,400,800", help="run lengths in steps, shortest first")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--need", type=int, default=9)
    parser.add_argument("--healthy-ms", type=float, help="skip the calibration: this host's healthy step (ms)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--keep", help="a folder: every wrong run's report is written there")
    parser.add_argument("--via", choices=("doctor", "run"), default="doctor",
                        help="run: tests/ranks/plain_train.py (no ddpdoctor in it) under `ddpdoctor run`")
    args = parser.parse_args()
    VIA["via"] = args.via
    began = time.time()
    healthy_ms = args.healthy_ms or calibrate()
    print(f"healthy step here: {healthy_ms:.2f} ms", flush=True)
    rows = []
    for fault in args.faults.split(","):
        rows += ladder(fault, [int(x) for x in args.lengths.split(",")], args.runs, args.need, healthy_ms, args.keep)
    print(f"\n| fault | job slowdown | shortest run right in {args.need} of {args.runs} | its wall time | "
          f"the lengths tried (right/runs) |\n|---|---|---|---|---|")
    for fault in args.faults.split(","):
        mine = [r for r in rows if r["fault"] == fault]
        ok = [r for r in mine if r["right"] >= args.need and r["runs"] == args.runs]
        tried = ", ".join(f"{r['steps']}: {r['right']}/{r['runs']}" for r in mine)
        first = ok[0] if ok and fault != "healthy" else None
        print(f"| {fault} | {mine[-1]['slowdown']}x | {first['steps'] if first else '-'} steps | "
              f"{first['wall_s'] if first else '-'} s | {tried} |")
    print(f"\n{len(rows)} lengths in {time.time() - began:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"healthy_ms": healthy_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
