"""Slow node localisation on namespace nodes: is the throttled node (or link) named, and no other?

Each run starts N namespace nodes (tests/ranks/multinode.py: network namespaces joined by a
bridge, one `torchrun --nnodes` per node, gloo on CPU ranks), slows the LAST node's link with
`tc` (or not: healthy), runs `ddpdoctor allreduce-bench` across them and reads rank 0's report:

- right:  the slow findings (BW003/BW004/BW005) name exactly the throttled node; at 2 nodes, where
          one pair cannot tell its ends apart, the link between the two nodes (both named);
- wrong:  a slow finding names any other node (or, healthy, any slow finding at all);
- missed: no slow finding although a link was slowed (or the run gave no report).

Needs root, iproute2 (ip, tc) and unshare. Usage (about 20-40 s a run on a 2-core VM):

    python benchmarks/slow_node_matrix.py --runs 10 --nodes 2 3 4 --per-node 1 2 --cases tbf tbf1g healthy
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ranks.multinode import CASES, Outcome, can_shape_links, node_pair_figures, one_run  # noqa: E402

def _shares(out: Outcome, case: str) -> tuple[list[float], list[float], list[float]]:
    """Shares of the fastest node pair of each view the diagnosis judges: each healthy pair's,
    each slowed one's (through the last node), and each node's own ranks' against the fastest
    node's: the margins the 0.5 line sits in (2 nodes have one pair: no share)."""
    views, intra = node_pair_figures(out.run)
    inside = [v / max(intra.values()) for v in intra.values()] if len(intra) > 1 else []
    last = out.run.report["nodes"][-1] if out.run.report else ""
    healthy: list[float] = []
    slowed: list[float] = []
    for view in views:
        if len(view) < 2:
            continue
        best = max(view.values())
        for pair, v in view.items():
            (slowed if CASES[case] is not None and last in pair else healthy).append(v / best)
    return healthy, slowed, inside


def _span(shares: list[float]) -> str:
    return f"{min(shares):.2f}-{max(shares):.2f}" if shares else "n/a"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--per-node", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["tbf", "tbf1g", "healthy"])
    parser.add_argument("--verbose", action="store_true", help="print each run's verdict and what it named")
    args = parser.parse_args(argv)
    reason = can_shape_links(netem="netem" in args.cases)
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 3
    print("| nodes x ranks | link | runs | right | wrong | missed | healthy pairs / fastest | slowed pairs / fastest "
          "| node inside / fastest node | s/run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases:
            for nodes_n in args.nodes:
                for per_node in args.per_node:
                    tally = {"right": 0, "wrong": 0, "missed": 0}
                    healthy_share, slowed_share, inside_share = [], [], []
                    start = time.perf_counter()
                    for i in range(args.runs):
                        out = one_run(Path(folder), nodes_n, per_node, case)
                        tally[out.verdict] += 1
                        healthy, slowed, inside = _shares(out, case)
                        healthy_share += healthy
                        slowed_share += slowed
                        inside_share += inside
                        if args.verbose or out.verdict != "right":
                            print(f"  {nodes_n}x{per_node} {case} run {i}: {out.verdict} {out.named} "
                                  f"{out.wall_s:.0f}s exit {out.run.codes}", file=sys.stderr)
                    per_run = (time.perf_counter() - start) / max(1, args.runs)
                    print(f"| {nodes_n} x {per_node} | {case} | {args.runs} | {tally['right']} | {tally['wrong']} | "
                          f"{tally['missed']} | {_span(healthy_share)} | {_span(slowed_share)} | {_span(inside_share)} | "
                          f"{per_run:.0f} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
