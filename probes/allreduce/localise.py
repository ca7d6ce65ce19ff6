"""The slow-link rules, pure: which ring pairs and which nodes are slow, from their timings.

One place for the rule because two sides apply it: collect, between its two rounds of pair
timings, to pick the pairs worth timing again (every rank applies it to the same timings, so
all agree without talking), and diagnose, to name the slow link (BW003) and node (BW004,
BW005). No torch here: the rule is tested on hand-built timings.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

from ddpdoctor.judge import busbw
from ddpdoctor.probes.allreduce.facts import AllReduceFacts, NodeTimings, PairTimings

# A pair below this fraction of the typical pair is a slow link. Real faults halve a link or
# worse (x8 for x16, Gen3 for Gen4, NVLink down to PCIe); CPU ranks on a shared host
# differ by up to ~30% from noise alone (measured on a 2-core VM), so they get a wider margin.
SLOW_LINK_RATIO = {"cuda": 0.8, "cpu": 0.5}

Pair = tuple[int, int]


def device_kind(devices: Iterable[str]) -> str:
    """"cuda" when any rank ran on a GPU, else "cpu": which margin of SLOW_LINK_RATIO applies."""
    return "cuda" if any(str(d).startswith("cuda") for d in devices) else "cpu"


def pair_busbw(times_by_rank: Mapping[int, Mapping[str, Sequence[float]]], size: int) -> dict[Pair, float]:
    """Each measured pair's busbw from its best iteration (slowest member per iteration).

    A link's capability is its best iteration: noise (other pairs, a busy host) only slows
    one down, while a slow link is slow every time.
    """
    times: dict[str, dict[int, Sequence[float]]] = {}
    for r, by_pair in times_by_rank.items():
        for pair, values in by_pair.items():
            times.setdefault(pair, {})[r] = values
    out: dict[Pair, float] = {}
    for pair, per_rank in times.items():
        a, b = (int(x) for x in pair.split("-"))
        try:
            slowest = busbw.slowest_per_iteration(per_rank)
        except ValueError:
            continue
        out[(a, b)] = busbw.busbw_gbps("all_reduce", 2, int(size), min(slowest))
    return out


def _timed_size(parts: Iterable[PairTimings | NodeTimings]) -> int:
    """The size every rank timed its pairs at (the last rank's that says so, as the reading always took)."""
    return next((p.size_bytes for p in reversed(list(parts)) if p.size_bytes), 0)


def ring_pair_busbw(parts: Mapping[int, PairTimings]) -> tuple[dict[Pair, float], int]:
    """The ring pairs' busbw from every rank's pair timings, and the size they were timed at."""
    size = _timed_size(parts.values())
    return pair_busbw({r: p.times_s for r, p in parts.items()}, size), size


def leader_pair_busbw(parts: Mapping[int, NodeTimings]) -> dict[Pair, float]:
    """The node-leader pairs' busbw from every rank's node timings (only leaders timed any)."""
    return pair_busbw({r: p.leader_times_s for r, p in parts.items()}, _timed_size(parts.values()))


def slow_pairs(pair_bw: Mapping[Pair, float], kind: str) -> list[Pair]:
    """The pairs below SLOW_LINK_RATIO of the typical pair, slowest first."""
    return busbw.slowest_link(pair_bw, threshold=SLOW_LINK_RATIO[kind]) if pair_bw else []


def blamed_pairs(parts: Mapping[int, PairTimings], kind: str) -> tuple[list[Pair], dict[Pair, float], int]:
    """The slow pairs the diagnosis may name (slowest first), every pair's busbw and the size.

    Only a pair that was timed twice is blamed: the second round speeds up the pairs a burst of
    noise slowed, which raises the typical pair, and a pair that was fine against the first
    round's typical can then fall under the line without ever having been timed again. Facts
    without a second round (none was needed, or an older version) are judged as they are.
    """
    pair_bw, size = ring_pair_busbw(parts)
    slow = slow_pairs(pair_bw, kind)
    retimed = next((p.retimed for p in parts.values() if p.retimed is not None), None)
    if retimed is not None:
        slow = [pair for pair in slow if f"{pair[0]}-{pair[1]}" in retimed]
    return slow, pair_bw, size


def pairs_to_retime(parts: Mapping[int, PairTimings], kind: str) -> list[Pair]:
    """The pairs the diagnosis would call slow on the first round, in rank order: the same list
    on every rank that reads the same timings."""
    pair_bw, _ = ring_pair_busbw(parts)
    return sorted(slow_pairs(pair_bw, kind))


def intra_node_busbw(facts: Mapping[int, AllReduceFacts], hosts: Sequence[str], size: int) -> dict[str, float]:
    """Each node's busbw among its own ranks (nodes of one rank have none), from its best iteration."""
    own = {r: f.nodes.intra_times_s for r, f in facts.items() if f.nodes is not None}
    out: dict[str, float] = {}
    for host in dict.fromkeys(hosts):
        members = [r for r, h in enumerate(hosts) if h == host]
        per_rank = {r: own[r][host] for r in members if r in own and host in own[r]}
        if len(members) > 1 and per_rank:
            try:
                out[host] = busbw.busbw_gbps("all_reduce", len(members), size,
                                             min(busbw.slowest_per_iteration(per_rank)))
            except ValueError:
                continue
    return out


def slow_hosts(intra: Mapping[str, float], ratio: float) -> tuple[list[str], float]:
    """The nodes below `ratio` of the median node, slowest first, and that median (0 with fewer than 2 nodes)."""
    if len(intra) < 2:
        return [], 0.0
    typical = statistics.median(intra.values())
    return sorted((h for h, v in intra.items() if v < ratio * typical), key=lambda h: intra[h]), typical
