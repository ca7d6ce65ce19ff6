"""The scaling table of this machine: `ddpdoctor scaling` run for real, printed as markdown.

    python benchmarks/scaling_table.py --nproc 4 [--seconds 2] [-- extra ddpdoctor scaling args]

Each row comes from the ranks' own step medians in the JSON report (probes/scaling/judge.py's
arithmetic); nothing is computed here that the report does not already hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("extra", nargs="*", help="more `ddpdoctor scaling` arguments (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "scaling.json")
        cmd = [sys.executable, "-m", "ddpdoctor", "scaling", "--no-live", "--nproc", str(args.nproc),
               "--seconds", str(args.seconds), "--json", path, *args.extra]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
        if not os.path.exists(path):
            raise SystemExit(f"{' '.join(cmd)} wrote no report (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        with open(path, encoding="utf-8") as handle:
            report = json.load(handle)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ddpdoctor.probes.scaling.judge import evaluate

    facts = next(p for p in report["probes"] if p["name"] == "scaling")["facts"]
    print(f"{report['world_size']} ranks, {report['backend']}/{report['device']}, {os.cpu_count()} CPUs, "
          f"batch {facts['0']['batch_size']} per rank, model {facts['0']['model']} ({facts['0']['parameters']:,} "
          f"parameters); exit {report['exit_code']}\n")
    print("| ranks | samples/s | speedup | efficiency | target | step ms | comm | straggler | data | compute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in evaluate({int(k): v for k, v in facts.items()}):
        lost = [f"{r.loss_ms[k]:.1f}" if k in r.loss_ms else "" for k in ("comm", "straggler", "data", "contention")]
        print(f"| {r.n} | {r.samples_per_s:,.0f} | {r.speedup:.2f}x | {r.efficiency_pct:.0f}% | "
              f"{'' if r.target_pct is None else f'{r.target_pct:g}%'} | {r.step_ms:.2f} | {' | '.join(lost)} |")
    print()
    for f in report["findings"]:
        print(f"- {f['code']} ({f['severity']}): {f['title']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
