"""How reliably does the callback name ranks that stop training one model, and stay quiet when they do not?

Runs tests/ranks/divergence_loop.py --runs times on 2 CPU ranks, every case of it side by side in each
run (the 12 bugs and the 6 healthy loops; each its own model, optimizer and Doctor checking every 10
steps), and counts per case the runs whose findings are right: for a bug, its code and cause; for a
healthy loop, nothing above information.

    python benchmarks/divergence_detection.py --runs 20
    python benchmarks/divergence_detection.py --cost --params 100e6     # the comparison's cost on a big model
    python benchmarks/divergence_detection.py --lightning 20            # healthy Lightning fits (needs lightning)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ranks", "divergence_loop.py")
FIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ranks", "adapter_fit.py")
HEALTHY = ["plain", "batchnorm", "amp", "static_graph", "fp16_hook", "accumulate"]
# case -> (the code that must be there, words its DOC013 cause must hold, or None where DOC013 is not expected)
BUGS = {
    "temperature": ("DOC012", "does not average"),
    "clamp_rank0": ("DOC013", "changed outside the optimizer"),
    "lr_by_rank": ("DOC014", "settings differ"),
    "sched_rank0": ("DOC014", "settings differ"),
    "ema_rank0": ("DOC013", "changed outside the optimizer"),
    "resume_rank0": ("DOC013", "changed outside the optimizer"),
    "all_no_sync": ("DOC015", "DDP did not average them"),
    "module_forward": ("DOC015", "DDP did not average them"),
    "unfrozen": ("DOC013", "DDP did not average them"),
    "nan_skip": ("DOC017", "non-finite"),
    "bn_no_broadcast": ("DOC016", None),
    "late_buffer": ("DOC019", None),
}
# Beyond the code and cause: what else a bug's report must hold to count as right.
ALSO = {"nan_skip": lambda found: "DOC018" in found and found["DOC018"]["ranks"] == [1]}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(steps: int) -> dict[str, dict[str, dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r")
        port = _port()
        cmd = [sys.executable, LOOP, "--json", path, "--cases", ",".join(HEALTHY + list(BUGS)), "--steps", str(steps)]
        procs = [subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
        for proc in procs:
            proc.wait(timeout=600)
        out = {}
        for case in HEALTHY + list(BUGS):
            file = f"{path}.{case}"
            out[case] = {f["code"]: f for f in json.load(open(file))["findings"]} if os.path.exists(file) else {}
        return out


def right(case: str, found: dict[str, dict]) -> bool:
    if case in HEALTHY:
        return all(f["severity"] in ("ok", "info") for f in found.values())
    code, cause = BUGS[case]
    if code not in found or not ALSO.get(case, lambda _: True)(found):
        return False
    if cause is None:
        return "DOC013" not in found
    return "DOC013" in found and cause in found["DOC013"]["evidence"]["cause"]


def detection(runs: int, steps: int) -> None:
    tally: dict[str, list[bool]] = {case: [] for case in HEALTHY + list(BUGS)}
    odd: dict[str, set[str]] = {case: set() for case in tally}
    for _ in range(runs):
        for case, found in one_run(steps).items():
            ok = right(case, found)
            tally[case].append(ok)
            if not ok:
                odd[case].add(",".join(sorted(found)) or "nothing")
    print(f"2 CPU ranks, {runs} runs of {steps} steps, checks every 10 steps")
    print("| case | right | what the wrong runs said |\n|---|---|---|")
    for case, oks in tally.items():
        kind = "healthy" if case in HEALTHY else "bug"
        print(f"| {case} ({kind}) | {sum(oks)}/{len(oks)} | {'; '.join(sorted(odd[case]))} |")


def lightning(runs: int) -> None:
    """Healthy Lightning fits through the adapter (2 CPU ranks, 110 steps, checks every 20, the loss passed):
    no finding above information, and the replicas compared equal to the last check."""
    quiet = compared = 0
    said: list[str] = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            prefix, port = os.path.join(tmp, "l"), _port()
            report = f"{prefix}.healthy.json"  # adapter_fit.py writes PREFIX.SCENARIO.json
            procs = [subprocess.Popen([sys.executable, FIT, "lightning", "--json", prefix, "--scenarios", "healthy"],
                                      cwd=tmp,
                                      env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
            for proc in procs:
                proc.wait(timeout=600)
            found = json.load(open(report))["findings"]
            summary = json.load(open(f"{report}.summary0"))
            loud = [f"{f['code']} {f['severity']}" for f in found if f["severity"] not in ("ok", "info")]
            quiet += not loud
            compared += summary.get("replicas_equal_at") == summary["steps"] - summary["steps"] % 20
            said += loud
    print(f"Lightning, 2 CPU ranks, {runs} healthy fits of 110 steps: {quiet}/{runs} quiet, replicas compared equal "
          f"at the last check in {compared}/{runs}; said: {', '.join(said) or 'nothing'}")


def cost(params: float, repeats: int) -> None:
    """The comparison's own work on one rank: the bit sums of a model of `params` float32 parameters, the
    all-reduce vector, and the details (gradients, norms) a difference adds; time and memory."""
    import resource

    import torch
    import torch.distributed as dist

    from ddpdoctor.callback.replicas import ReplicaWatch
    from ddpdoctor.measure import replica_digest as rd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    side = 4096
    layers = max(1, round(params / (side * side)))
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = ReplicaWatch(model, opt, 2, torch.device("cpu"), late=False)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vec, det = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        watch._vector()
        vec.append(time.perf_counter() - began)
        began = time.perf_counter()
        watch._detail()
        det.append(time.perf_counter() - began)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    prints = []
    for _ in range(repeats):
        began = time.perf_counter()
        rd.fingerprint(watch.layout)
        prints.append(time.perf_counter() - began)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.0f}M float32 parameters in {layers} tensors, one CPU thread, median of {repeats}: "
          f"the compared sums {1e3 * statistics.median(vec):.1f} ms (every comparison), the details "
          f"{1e3 * statistics.median(det):.1f} ms (once, on a difference); peak RSS grew {(rss1 - rss0) / 1024:.1f} MB; "
          f"one fingerprint {1e3 * statistics.median(prints):.1f} ms (kept per step only on steps 200x as long)")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cost", action="store_true", help="time the comparison on one big model instead")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lightning", type=int, default=0, help="this many healthy Lightning fits instead")
    args = parser.parse_args()
    if args.lightning:
        lightning(args.lightning)
    elif args.cost:
        cost(args.params, args.repeats)
    else:
        detection(args.runs, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
