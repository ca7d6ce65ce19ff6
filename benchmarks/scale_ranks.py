"""How `ddpdoctor check` grows with the ranks: wall time and memory at 2, 4, 8, 16 CPU ranks.

    python benchmarks/scale_ranks.py [--ranks 2,4,8,16] [--probes default] [--timeout 120]

Each size is one real standalone `ddpdoctor check --nproc N` (gloo, CPU, OMP_NUM_THREADS=1).
Memory is sampled every 0.1 s from /proc through psutil: the launcher's RSS, the largest
rank's RSS, and the sum over the launcher and all its descendants (the whole run's
footprint). On a machine with fewer cores than ranks the ranks time-share the cores, so wall
time grows with the CPU work of starting N Python processes that import torch; that is the
point of the table, not a flaw in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil


def _measure(nproc: int, probes: str, timeout: float) -> dict:
    folder = tempfile.mkdtemp(prefix="ddpd-scale-")
    report = os.path.join(folder, "report.json")
    cmd = [sys.executable, "-m", "ddpdoctor", "check", "--nproc", str(nproc), "--no-live", "--timeout", str(timeout),
           "--json", report]
    if probes != "default":
        cmd += ["--probes", probes]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    errors = open(os.path.join(folder, "stderr.txt"), "w+")  # a file: a pipe read at the end can fill and block
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    launcher = psutil.Process(proc.pid)
    peak_total = peak_launcher = peak_rank = 0
    while proc.poll() is None:
        try:
            children = launcher.children(recursive=True)
            rss = {p.pid: p.memory_info().rss for p in [launcher, *children] if p.is_running()}
        except psutil.Error:
            rss = {}
        if rss:
            peak_total = max(peak_total, sum(rss.values()))
            peak_launcher = max(peak_launcher, rss.get(proc.pid, 0))
            peak_rank = max([peak_rank] + [v for pid, v in rss.items() if pid != proc.pid])
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    data = json.load(open(report)) if os.path.exists(report) else {}
    errors.seek(0)
    stderr = errors.read()[-500:]
    errors.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {"ranks": nproc, "exit": proc.returncode, "wall_s": round(wall, 1),
            "report_duration_s": data.get("duration_s"),
            "launcher_mib": round(peak_launcher / 2**20), "largest_rank_mib": round(peak_rank / 2**20),
            "total_mib": round(peak_total / 2**20), "findings": [f["code"] for f in data.get("findings", [])],
            "stderr": stderr if proc.returncode not in (0, 1) else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--probes", default="default")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    rows = [_measure(int(n), args.probes, args.timeout) for n in args.ranks.split(",")]
    print(f"ddpdoctor check, probes {args.probes}, {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM")
    print("| ranks | exit | wall s | launcher MiB | largest rank MiB | total MiB | total / rank MiB | findings |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['exit']} | {r['wall_s']} | {r['launcher_mib']} | {r['largest_rank_mib']} | "
              f"{r['total_mib']} | {r['total_mib'] / r['ranks']:.0f} | {' '.join(r['findings'])} |")
        if r["stderr"]:
            print(f"  stderr: {r['stderr']}")


if __name__ == "__main__":
    main()
