"""How many rounds the large-N slow-node search takes, and whether it names the right nodes,
simulated on its timing model (ddpdoctor.judge.node_search.model_busbw).

A group's busbw is its slowest member's speed times lognormal noise drawn afresh per timing;
the slow nodes (0, 1 or 2, picked at random) are `factor` times slower. Each row is `--seeds`
searches; a round is one set of disjoint groups timed at once. Compared with timing every
pair: N(N-1)/2 timings in N-1 rounds of disjoint pairs.

    python benchmarks/node_search_sim.py [--seeds 200] [--nodes 4 16 64 256 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

from ddpdoctor.judge.node_search import Group, SearchResult, model_busbw, run_search

# (noise: sd of a timing's log, slowdown of a slow node)
CASES = [(0.1, 2.0), (0.3, 2.0), (0.3, 10.0), (0.1, 100.0)]


@dataclass
class Tally:
    """One row: what the searches found, node by node, and what they cost."""

    rounds: list[int]
    timings: list[int]
    groups: list[int]
    right: int = 0  # slow nodes named
    wrong: int = 0  # healthy nodes named
    unsure_slow: int = 0  # slow nodes left unsure (said, not named)
    unsure_healthy: int = 0  # healthy nodes left unsure
    missed: int = 0  # slow nodes neither named nor unsure

    def add(self, result: SearchResult, bad: set[str]) -> None:
        named, unsure = set(result.slow_nodes), {e.node for e in result.unsure}
        self.rounds.append(result.rounds)
        self.timings.append(result.timings)
        self.groups.append(result.groups)
        self.right += len(named & bad)
        self.wrong += len(named - bad)
        self.unsure_slow += len(unsure & bad)
        self.unsure_healthy += len(unsure - bad)
        self.missed += len(bad - named - unsure)


def one(n: int, slow: int, sigma: float, factor: float, seed: int) -> tuple[SearchResult, set[str]]:
    rng = random.Random(seed)
    nodes = [f"node{i:04d}" for i in range(n)]
    bad = set(rng.sample(nodes, slow))

    def time_round(groups: list[Group]) -> list[float]:
        return model_busbw(groups, lambda node: 100.0 / factor if node in bad else 100.0, sigma, rng.gauss)

    return run_search(nodes, time_round), bad


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64, 256, 1024])
    args = parser.parse_args(argv)
    start = time.monotonic()
    print(f"{args.seeds} seeds a row; noise = sd of log busbw per timing; a slow node `x` times slower")
    print("| nodes | slow | noise | x | rounds median (max) | timings median | groups median "
          "| right | wrong | unsure slow / healthy | missed | every pair: rounds, timings |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.nodes:
        for slow in (0, 1, 2):
            for sigma, factor in CASES:
                if slow == 0 and factor != CASES[0][1]:
                    continue  # no slow node: the slowdown does not matter
                tally = Tally([], [], [])
                for seed in range(args.seeds):
                    tally.add(*one(n, slow, sigma, factor, seed))
                x = f"{factor:g}" if slow else "-"
                print(f"| {n} | {slow} | {sigma:.0%} | {x} "
                      f"| {statistics.median(tally.rounds):g} ({max(tally.rounds)}) "
                      f"| {statistics.median(tally.timings):g} | {statistics.median(tally.groups):g} "
                      f"| {tally.right}/{slow * args.seeds} | {tally.wrong} "
                      f"| {tally.unsure_slow} / {tally.unsure_healthy} | {tally.missed} "
                      f"| {n - 1}, {n * (n - 1) // 2:,} |", flush=True)
    print(f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
