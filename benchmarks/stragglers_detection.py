"""How reliably does the `stragglers` probe name a slow rank, with the right cause, and stay quiet when healthy?

Each case runs `ddpdoctor check --probes stragglers` --runs times on --nproc CPU ranks and counts the runs whose
findings name exactly the injected rank with the expected cause (or, healthy, name nobody).

    python benchmarks/stragglers_detection.py --runs 20                    # the issue's bar: healthy, 20% slower
    python benchmarks/stragglers_detection.py --runs 10 --factors 1.05,1.1,1.15   # the smallest slowdown detected
    python benchmarks/stragglers_detection.py --runs 3 --keep /tmp/runs    # keep every JSON report
    python benchmarks/stragglers_detection.py --outside --runs 10          # faults made from outside the rank
    python benchmarks/stragglers_detection.py --shapes 0.5,2,10,50 --runs 20 --seconds 9   # the callback's false alarms
    python benchmarks/stragglers_detection.py --replay DIR                 # today's rules on a kept pass's windows

--outside: each fault a separate process makes on rank 1 (runtime/outside_faults.py) at two strengths, judged by
the default `check`, the `stragglers` probe and the training callback (tests/ranks/doctor_loop.py, a plain loop):
named right / named wrong / missed, with the job's slowdown (the median step of the probe and of the callback's loop
against the healthy runs' in the same place); first the healthy runs (2 ranks on 2 cores in each place and in a
Lightning fit with the adapter, tests/ranks/adapter_fit.py, where --lightning-python has lightning; 4 ranks on 2
cores in check and probe): false alarms.
--shapes: the training callback's false-alarm matrix, healthy runs of tests/ranks/shape_loop.py at each target
step time (its MLP's width calibrated here), 2 and 4 ranks on the 2 cores, pinned (rank r on core r mod 2) and
not, a plain loop and a Lightning fit: a run with any warn or critical finding is a false alarm. Two-rank
runs are pinned one rank to a core (`taskset`, as srun --cpu-bind=cores does). Before each run the 1-minute load
average must be at most --max-load (waits up to --patience seconds): the table says the median load its runs saw.
--replay DIR: the callback's runs of an --outside pass kept with --keep DIR (each run's `.facts`: the merged
windows of every check, as rank 0 judged them) judged again with the rules as they are now, as the callback
would: `diagnose_stragglers` at each check from its 3rd, the callback's bar (`worth_naming_online`), and a
verdict only where the check before reached it too. No rank runs: a rule change is measured on the same windows.
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


# (name, --inject spec for rank 1, the cause it must be named with). The memory toucher is not pinned: the
# scheduler puts it on either rank's core, where it takes time, caches and memory bandwidth, or on both in
# turn. Naming nobody is right for it, and so is naming the rank whose core it sat on for CPU contention;
# any other verdict is wrong (NEIGHBOUR_ANY_RANK).
NEIGHBOUR_ANY_RANK = ("mempressure 2 GiB",)
OUTSIDE_CASES = [
    ("hog 100%", "hog:rank=1:pct=100", "CPU contention"),
    ("hog 50%", "hog:rank=1:pct=50", "CPU contention"),
    ("quota 30%", "quota:rank=1:pct=30", "CPU quota"),
    ("quota 60%", "quota:rank=1:pct=60", "CPU quota"),
    ("preempt 40%", "preempt:rank=1:pct=40", "stopped from outside"),
    ("preempt 20%", "preempt:rank=1:pct=20", "stopped from outside"),
    ("mempressure 2 GiB", "mempressure:rank=1:mb=2048", "CPU contention"),
]
LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ranks", "doctor_loop.py")
FIT = os.path.join(os.path.dirname(LOOP), "adapter_fit.py")
CODES = {"check": "HOM006", "stragglers": "STR001", "callback": "STR001", "lightning": "STR001"}


def wait_for_quiet(max_load: float, patience_s: float = 120.0) -> float:
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pinned_ranks(cmd: list[str], world: int, env: dict) -> None:
    port = _port()
    procs = [subprocess.Popen((["taskset", "-c", str(r % (os.cpu_count() or 1))] if world == 2 else []) + cmd,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(world)]
    for proc in procs:
        proc.wait(timeout=600)


LOOP_EPOCHS = 70  # about 560 steps, 4 s: see _run


def _loop_run(cmd: list[str], env: dict, inject: Optional[str], pinned: bool = True) -> None:
    """Two ranks of a user's script, pinned one to a core (unless `pinned` is False), the fault made on rank 1 from
    outside. Also benchmarks/end_of_run_detection.py's."""
    from ddpdoctor.runtime import outside_faults

    made = None
    port = _port()
    procs = [subprocess.Popen((["taskset", "-c", str(r % (os.cpu_count() or 1))] if pinned else []) + cmd,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
    try:
        if inject:
            kind, rest = inject.split(":", 1)
            opts = dict(kv.split("=") for kv in rest.split(":")[1:])
            made = outside_faults.start(kind, procs[1].pid, pct=float(opts.get("pct", 100)),
                                        mb=float(opts.get("mb", 512)), cpu=1)
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if made is not None:
            made.stop()


def outside_run(place: str, inject: Optional[str], world: int, seconds: float, keep: Optional[str] = None,
                tag: str = "report", lightning_python: str = sys.executable) -> dict:
    """One run in one place; the findings of the place's code, and the job's median step (the
    stragglers probe's rank 0, or the callback's last verdict's steps on rank 0)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    step = None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"{tag}.json")
        if place == "callback":
            # 70 epochs, about 560 steps of 7 ms and 28 checks: the callback judges a straggler from its 3rd
            # check with 64 steps and says it once the checks have named it for 2 s of the job (CONFIRM_S).
            # 14 epochs (about 100 steps, the table of issue 31) left a verdict 2 or 3 checks, and a noisy
            # one a miss; 28 (200 steps, 1.5 s) were right until the 2 s.
            _loop_run([sys.executable, LOOP, "--case", "healthy", "--json", path, "--epochs", str(LOOP_EPOCHS),
                       "--facts", f"{path}.facts"], env, inject)
            judged = json.load(open(f"{path}.facts"))
            steps = judged[-1]["facts"]["0"]["steps"]["step_ms"] if judged else []
            step = sorted(steps)[len(steps) // 2] if steps else None
        elif place == "lightning":
            prefix = path[:-len(".json")]  # adapter_fit.py writes PREFIX.SCENARIO.json: the healthy fit's is `path`
            _loop_run([lightning_python, FIT, "lightning", "--json", prefix, "--scenarios", "healthy"], env, inject)
            os.replace(f"{prefix}.healthy.json", path)
        else:
            cmd = [sys.executable, "-m", "ddpdoctor", "check", "--no-live", "--json", path]
            if place == "stragglers":
                cmd += ["--probes", "stragglers", "--straggler-seconds", str(seconds)]
            if inject:
                cmd += ["--inject", inject]
            if world == 2:
                _pinned_ranks(cmd, 2, env)
            else:
                subprocess.run(cmd + ["--nproc", str(world)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=600)
        report = json.load(open(path))
    named = [f for f in report["findings"] if f["code"] == CODES[place]]
    for probe in report.get("probes", []):
        if probe.get("name") == "stragglers" and probe.get("facts"):
            steps = probe["facts"]["0"]["steps"]["step_ms"]
            step = sorted(steps)[len(steps) // 2] if steps else None
    return {"named": sorted(r for f in named for r in f["ranks"]),
            "causes": [f["evidence"].get("cause") for f in named], "step_ms": step}


def _has_lightning(python: str) -> bool:
    return subprocess.run([python, "-c", "import lightning"], capture_output=True).returncode == 0


def outside_table(runs: int, healthy_runs: int, seconds: float, max_load: float, places: list[str], patience_s: float,
                  cases: str, keep: Optional[str] = None, lightning_python: str = sys.executable) -> None:
    import statistics

    print(f"outside faults on rank 1, {runs} runs per fault cell, {healthy_runs} per healthy one; right / wrong / "
          "missed; slowdown: the job's median step (the stragglers probe, the callback's loop) against the healthy "
          "2-rank runs' in the same place", flush=True)
    base: dict[str, float] = {}
    rows = []

    def cell(place: str, inject: Optional[str], world: int, n: int, tag: str) -> tuple[list[dict], float]:
        loads, results = [], []
        for i in range(n):
            loads.append(wait_for_quiet(max_load, patience_s))
            results.append(outside_run(place, inject, world, seconds, keep, f"{tag}-{place}-{i}", lightning_python))
        return results, statistics.median(loads)

    healthy = [("healthy 2 ranks/2 cores", 2, p) for p in places]
    if "callback" in places and healthy_runs and _has_lightning(lightning_python):
        healthy.append(("healthy 2 ranks/2 cores, Lightning fit", 2, "lightning"))
    healthy += [("healthy 4 ranks/2 cores", 4, p) for p in places if p in ("check", "stragglers")]
    for name, world, place in healthy if healthy_runs else []:
        results, load = cell(place, None, world, healthy_runs, f"healthy-{world}")
        steps = [r["step_ms"] for r in results if r["step_ms"]]
        if world == 2 and steps:
            base[place] = statistics.median(steps)
        alarms = sum(bool(r["named"]) for r in results)
        odd = sorted({f"{r['named']} {'/'.join(map(str, r['causes']))}" for r in results if r["named"]})
        rows.append(f"| {name} | {place} | {alarms}/{healthy_runs} false alarms{f' ({chr(59).join(odd)})' if odd else ''}"
                    f" | | {load:.1f} |")
        print(rows[-1], flush=True)
    for name, inject, cause in [c for c in OUTSIDE_CASES if not cases or c[0].split()[0] in cases.split(",")]:
        for place in [p for p in places if p != "lightning"]:
            results, load = cell(place, inject, 2, runs, name.replace(" ", "_"))
            any_rank = name in NEIGHBOUR_ANY_RANK

            def ok(r: dict) -> bool:
                return (len(r["named"]) == 1 or r["named"] == [1]) if any_rank else r["named"] == [1]

            right = sum(bool(r["named"]) and ok(r) and r["causes"] == [cause] for r in results)
            wrong = sum(bool(r["named"]) and not (ok(r) and r["causes"] == [cause]) for r in results)
            missed = runs - right - wrong
            steps = [r["step_ms"] for r in results if r["step_ms"]]
            slowdown = f"{statistics.median(steps) / base[place]:.2f}x" if steps and place in base else ""
            verdict = (f"{missed} quiet, {right} named its neighbour / {wrong} wrong" if any_rank
                       else f"{right} / {wrong} / {missed}")
            odd = sorted({f"{r['named']} {'/'.join(map(str, r['causes']))}" for r in results
                          if r["named"] and not (ok(r) and r["causes"] == [cause])})
            verdict += f" (wrong: {'; '.join(odd)})" if odd else ""
            rows.append(f"| {name} | {place} | {verdict} | {slowdown} | {load:.1f} |")
            print(rows[-1], flush=True)
    print("\n| case | where | right / wrong / missed | job slowdown | load |\n|---|---|---|---|---|")
    print("\n".join(rows))


def replayed(path: str) -> list[tuple[tuple[int, ...], str]]:
    """The callback's straggler verdicts on one kept run's checks, judged by today's rules: (ranks, cause)."""
    from ddpdoctor.callback.doctor import MIN_JUDGED_CHECKS, ONLINE_MIN_STEPS, named_since, said, worth_naming_online
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    since: dict = {}  # (code, ranks) -> the job's time at the first check of its run of checks
    out: set = set()
    for check in json.load(open(path)):
        facts = check["facts"]
        if (not facts or len(check.get("contention_by_window") or []) < MIN_JUDGED_CHECKS
                or min(len(f["steps"]["step_ms"]) for f in facts.values()) < ONLINE_MIN_STEPS):
            continue  # as `Doctor._stragglers`: not judged, the runs of checks go on
        run = RunView(world_size=len(facts), hosts={int(r): f.get("host", "vm") for r, f in facts.items()})
        judged = diagnose_stragglers(facts, run)
        t = _job_s(check)
        since = named_since(since, judged, t)
        out |= {(f.code, f.ranks, str(f.evidence.get("cause", ""))) for f in judged
                if worth_naming_online(f) and said(since, f, t)}
    return sorted((ranks, cause) for code, ranks, cause in out if code == "STR001")


def _job_s(check: dict) -> float:
    """The job's time at a kept check (`Doctor._job_s`); for runs kept before it was recorded, the step count times
    the slowest rank's mean step in the kept windows (an estimate: it leaves out the time of the checks)."""
    if "job_s" in check:
        return float(check["job_s"])
    means = [sum(f["steps"]["step_ms"]) / len(f["steps"]["step_ms"]) for f in check["facts"].values() if f["steps"]["step_ms"]]
    return check["step"] * max(means, default=0.0) / 1e3


def replay_table(folder: str) -> None:
    import collections
    import glob

    cells: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(glob.glob(os.path.join(folder, "*.json.facts"))):
        tag = os.path.basename(path).rsplit("-", 1)[0]
        verdict = replayed(path)
        cells[tag]["; ".join(f"{list(r)} {c}" for r, c in verdict) or "nobody named"] += 1
    print(f"the callback's verdicts on the windows kept in {folder}, judged by today's rules\n")
    print("| cell | runs | verdicts |\n|---|---|---|")
    for tag, count in sorted(cells.items()):
        print(f"| {tag} | {sum(count.values())} | {', '.join(f'{n}x {v}' for v, n in count.most_common())} |")


SHAPE_LOOP = os.path.join(os.path.dirname(LOOP), "shape_loop.py")


def shape_run(step_ms: float, width: int, world: int, pinned: bool, lightning: bool, seconds: float, python: str,
              keep: Optional[str], tag: str, extra: Optional[list[str]] = None) -> dict:
    """One healthy run of tests/ranks/shape_loop.py (the Doctor at its defaults): its warn-or-worse findings
    and its real mean step."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"{tag}.json")
        cmd = [python, SHAPE_LOOP, "--json", path, "--step-ms", str(step_ms), "--width", str(width),
               "--seconds", str(seconds)] + (["--lightning"] if lightning else []) + (extra or [])
        port = _port()
        procs = [subprocess.Popen((["taskset", "-c", str(r % cores)] if pinned else []) + cmd,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(world)]
        try:
            codes = [proc.wait(timeout=600) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        found = json.load(open(path))["findings"] if os.path.exists(path) else []
        shape = json.load(open(f"{path}.shape")) if os.path.exists(f"{path}.shape") else {}
    alarms = [f"{f['code']} {f['ranks']} {f['evidence'].get('cause', '')}".strip() for f in found
              if f["severity"] in ("warn", "critical")]
    return {"exit": codes, "alarms": alarms, "step_ms": shape.get("mean_step_ms"), "steps": shape.get("steps")}


def shapes_table(shapes: list[float], worlds: list[int], runs: int, seconds: float, loops: list[str], max_load: float,
                 patience_s: float, keep: Optional[str], lightning_python: str) -> None:
    """The callback's false-alarm matrix: healthy runs of every step shape, rank count, pinning and loop."""
    import statistics

    widths = {}
    cores = os.cpu_count() or 1
    for ms in shapes:
        for world in worlds:
            # Each of `world` ranks gets cores/world of a CPU: its compute is calibrated to that share of the
            # step (the all-reduce adds its own time on top).
            share = ms * min(1.0, cores / world)
            out = subprocess.run([sys.executable, SHAPE_LOOP, "--json", "x", "--step-ms", str(share), "--calibrate"],
                                 env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
            widths[ms, world] = int(out.stdout.strip().splitlines()[-1])
    print(f"healthy runs of tests/ranks/shape_loop.py, the Doctor at its defaults, {runs} runs a cell of about "
          f"{seconds:g} s of training; false alarms: runs with a warn or critical finding", flush=True)
    print("| target step | real step (median) | ranks on 2 cores | pinned | loop | false alarms | what was said | load |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    paces: dict[tuple[float, int, bool], float] = {}  # the plain loop's real step, for the Lightning fits' length
    for ms in shapes:
        for world in worlds:
            for pinned in (True, False):
                for loop in loops:
                    if loop == "lightning" and not _has_lightning(lightning_python):
                        continue
                    results, loads = [], []
                    for i in range(runs):
                        loads.append(wait_for_quiet(max_load, patience_s))
                        tag = f"shape{ms:g}-{world}-{'pin' if pinned else 'free'}-{loop}-{i}"
                        # The plain loop runs 310 steps at least (shape_loop.MIN_STEPS: enough checks to judge);
                        # a Lightning fit stops by time, so it gets the time 310 of its steps take.
                        real = paces.get((ms, world, pinned))
                        length = max(seconds, 310 * (real + 5.0) / 1e3) if loop == "lightning" and real else seconds
                        results.append(shape_run(ms, widths[ms, world], world, pinned, loop == "lightning", length,
                                                 lightning_python if loop == "lightning" else sys.executable, keep, tag))
                    steps = [r["step_ms"] for r in results if r["step_ms"]]
                    if loop == "plain" and steps:
                        paces[ms, world, pinned] = statistics.median(steps)
                    alarms = sum(bool(r["alarms"]) for r in results)
                    failed = sum(any(c != 0 for c in r["exit"]) for r in results)
                    said = sorted({a for r in results for a in r["alarms"]})
                    print(f"| {ms:g} ms | {statistics.median(steps) if steps else float('nan'):.2f} ms | {world} | "
                          f"{'yes' if pinned else 'no'} | {loop} | {alarms}/{runs}"
                          f"{f' ({failed} runs failed)' if failed else ''} | {'; '.join(said)[:120]} | "
                          f"{statistics.median(loads):.1f} |", flush=True)


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
    parser.add_argument("--outside", action="store_true", help="the faults made from outside the rank (see above)")
    parser.add_argument("--places", default="check,stragglers,callback", help="with --outside: where to judge")
    parser.add_argument("--max-load", type=float, default=3.0, help="with --outside: wait for this 1-minute load")
    parser.add_argument("--patience", type=float, default=120.0, help="with --outside: seconds to wait for it")
    parser.add_argument("--cases", default="", help="with --outside: only these kinds (e.g. hog,quota)")
    parser.add_argument("--healthy-runs", type=int, default=None, help="with --outside: runs per healthy cell "
                        "(default: twice --runs; 0: none)")
    parser.add_argument("--lightning-python", default=sys.executable,
                        help="with --outside: a python with lightning installed, for the healthy Lightning fit row")
    parser.add_argument("--shapes", help="the callback's false-alarm matrix at these target step times (ms, comma-"
                        "separated): healthy runs, --runs a cell, 2 and 4 ranks, pinned and not, plain and Lightning")
    parser.add_argument("--worlds", default="2,4", help="with --shapes: rank counts")
    parser.add_argument("--loops", default="plain,lightning", help="with --shapes: plain, lightning")
    parser.add_argument("--replay", metavar="DIR", help="judge the callback runs kept in DIR again (no ranks run)")
    args = parser.parse_args()
    if args.keep:  # the ranks write their reports there: the Doctor refuses a folder that does not exist
        os.makedirs(args.keep, exist_ok=True)
    if args.replay:
        replay_table(args.replay)
        return 0
    if args.shapes:
        shapes_table([float(x) for x in args.shapes.split(",")], [int(x) for x in args.worlds.split(",")], args.runs,
                     args.seconds, args.loops.split(","), args.max_load, args.patience, args.keep, args.lightning_python)
        return 0
    if args.outside:
        healthy_runs = 0 if args.no_healthy else (2 * args.runs if args.healthy_runs is None else args.healthy_runs)
        outside_table(args.runs, healthy_runs, args.seconds, args.max_load, [p for p in args.places.split(",") if p],
                      args.patience, args.cases, args.keep, args.lightning_python)
        return 0
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
