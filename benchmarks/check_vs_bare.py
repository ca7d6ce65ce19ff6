"""Is `ddpdoctor check` fast enough to run before every job?

The budget (the project's rule for pre-flight checks): its wall time with the default probes stays within 2x of a
bare `torchrun --standalone` script that inits and all-reduces once on the same ranks.
Each command runs --repeat times, alternating, and the medians are compared.

    python benchmarks/check_vs_bare.py --nproc 2 --nproc 4 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, action="append", help="ranks (repeatable); default 2 and 4")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"{'ranks':>5} {'bare torchrun s':>16} {'ddpdoctor check s':>18} {'ratio':>6}  budget 2.0")
    worst = 0.0
    for nproc in args.nproc or [2, 4]:
        bare_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    os.path.join(HERE, "bare_allreduce.py")]
        check_cmd = [sys.executable, "-m", "ddpdoctor", "check", "--nproc", str(nproc), "--no-live"]
        bare, check = [], []
        for _ in range(args.repeat):
            bare.append(timed(bare_cmd, env))
            check.append(timed(check_cmd, env))
        ratio = statistics.median(check) / statistics.median(bare)
        worst = max(worst, ratio)
        print(f"{nproc:>5} {statistics.median(bare):>16.2f} {statistics.median(check):>18.2f} {ratio:>6.2f}"
              f"  (bare {min(bare):.2f}-{max(bare):.2f}, check {min(check):.2f}-{max(check):.2f})")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
