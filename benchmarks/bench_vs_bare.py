"""Harness overhead of `ddpdoctor allreduce-bench`: its busbw against a bare timing loop.

The bar: at sizes of 1 MiB and more, the busbw ddpdoctor reports is at least 97% of a bare
`torch.distributed.all_reduce` loop (bare_allreduce_sweep.py) on the same ranks and sizes.
Both run in this one invocation, alternating, --repeat times each; medians are compared.

    python benchmarks/bench_vs_bare.py --nproc 2 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [2**20, 4 * 2**20, 16 * 2**20, 25 * 2**20]


def bare(nproc: int, env: dict[str, str]) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "bare_allreduce_sweep.py"), *map(str, SIZES)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("{"))
    return {int(k): v for k, v in json.loads(line).items()}


def ddpdoctor(nproc: int, env: dict[str, str]) -> dict[int, float]:
    from ddpdoctor.probes.allreduce import merge_results

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.json")
        cmd = [sys.executable, "-m", "ddpdoctor", "allreduce-bench", "--nproc", str(nproc), "--no-live",
               "--min-bytes", "1M", "--max-bytes", "25M", "--factor", "4", "--localise", "never", "--no-check",
               "--json", path]
        subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        with open(path, encoding="utf-8") as handle:
            report = json.load(handle)
    section = next(p for p in report["probes"] if p["name"] == "allreduce")
    results = merge_results({int(r): f for r, f in section["facts"].items()})
    return {r.size_bytes: r.busbw_gbps for r in results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs_bare: dict[int, list[float]] = {s: [] for s in SIZES}
    runs_ours: dict[int, list[float]] = {s: [] for s in SIZES}
    for _ in range(args.repeat):
        for size, value in bare(args.nproc, env).items():
            runs_bare[size].append(value)
        for size, value in ddpdoctor(args.nproc, env).items():
            if size in runs_ours:
                runs_ours[size].append(value)
    print(f"{'size':>8} {'bare busbw GB/s':>16} {'ddpdoctor busbw GB/s':>21} {'ratio':>6}  bar 0.97  ({args.nproc} ranks, gloo/cpu)")
    worst = float("inf")
    for size in SIZES:
        b, o = statistics.median(runs_bare[size]), statistics.median(runs_ours[size])
        worst = min(worst, o / b)
        print(f"{size // 2**20:>7}M {b:>16.3f} {o:>21.3f} {o / b:>6.2f}")
    print(f"worst ratio {worst:.2f}: {'meets' if worst >= 0.97 else 'misses'} the 97% bar")
    return 0 if worst >= 0.97 else 1


if __name__ == "__main__":
    sys.exit(main())
