"""The slow-link rules, pure: which ring pairs and which nodes are slow, from their timings.

One place for the rule because two sides apply it: collect, between its two rounds of pair
timings, to pick the pairs worth timing again (every rank applies it to the same timings, so
all agree without talking), and diagnose, to name the slow link (BW003) and node (BW004,
BW005). No torch here: the rule is tested on hand-built timings.

A pair is judged against the FASTEST pair of its kind, never the median: with three nodes one
slow node spoils two of the three node pairs, and the median is then slow itself. Pairs inside
a node and pairs across nodes are two kinds (NVLink against a NIC differ tenfold on a healthy
cluster), so each is held against its own best. Across nodes, where the facts say what a NIC
declares, a node pair is also held against that rate: with two nodes there is one pair and no
peer to compare with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, TypeVar

from ddpdoctor.judge import busbw
from ddpdoctor.probes.allreduce.facts import AllReduceFacts, NodeTimings, PairTimings

# A pair below this fraction of the fastest pair of its kind is slow. Real faults halve a link or
# worse (x8 for x16, Gen3 for Gen4, NVLink down to PCIe, a NIC at 10 of 100 Gbit/s, a tc-throttled
# link at 1/50); CPU ranks on a shared host differ by up to ~30% from noise alone (measured on a
# 2-core VM, each pair by its best call), so they get a wider margin.
SLOW_LINK_RATIO = {"cuda": 0.8, "cpu": 0.5}
# Nodes (their own ranks, BW004; pairs of nodes, BW005) on CPU ranks get wider still: on namespace
# nodes sharing 2 busy cores (load 4-9) healthy node pairs and nodes came down to 0.46 of the fastest
# (benchmarks/README.md), while a node throttled to 1 Gbit/s sits near 0.1 and to 200 Mbit/s near 0.02.
# Across nodes the ring pairs are held to it too (pair_ratio): with 2 ranks a node, a pair inside a node
# is the very all-reduce BW004 times (the node's ranks among themselves, every node's at once), and at
# 0.5 a healthy one was named BW003 beside the right BW005, twice, on a host twice as fast as ours.
NODE_RATIO = {"cuda": 0.8, "cpu": 0.3}
# Below this share of what a node pair should carry with nothing to compare it with (its slower
# NIC's declared rate; on CPU ranks also what the nodes' own ranks reach among themselves), a node
# pair is slow. Far from the rate on purpose: NCCL reaches ~80-95% of a NIC, gloo on CPUs a small
# share of a fast one (1.3-1.7 GB/s over a 10 Gbit/s veth here, far less over 100 Gbit/s), while a
# link that trained low or is throttled carries a tenth or a fiftieth.
FAR_BELOW = {"cuda": 0.5, "cpu": 0.1}

Pair = tuple[int, int]
NodePair = tuple[str, str]
K = TypeVar("K", Pair, NodePair)


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


def crosses_nodes(pair: Pair, hosts: Sequence[str]) -> bool:
    """Whether the pair's two ranks are on different nodes (unknown ranks count as one node)."""
    a, b = (hosts[r] if 0 <= r < len(hosts) else "?" for r in pair)
    return a != b


def below_fastest(pair_bw: Mapping[K, float], ratio: float) -> list[K]:
    """The pairs below `ratio` of the fastest, slowest first (one pair has nothing to compare with)."""
    if len(pair_bw) < 2:
        return []
    best = max(pair_bw.values())
    return sorted((p for p, v in pair_bw.items() if v < ratio * best), key=lambda p: (pair_bw[p], p))


def pair_ratio(kind: str, hosts: Sequence[str] = ()) -> float:
    """The share of the fastest pair of its kind below which a ring pair is slow: SLOW_LINK_RATIO on
    one node; with `hosts` (the ranks span nodes) NODE_RATIO, the line each node's own ranks and the
    node pairs are held to, since a pair inside a node is timed as they are (every node's at once,
    on CPU ranks on cores the nodes may share) and must not be named where its node would not be."""
    return NODE_RATIO[kind] if hosts else SLOW_LINK_RATIO[kind]


def slow_pairs(pair_bw: Mapping[Pair, float], kind: str, hosts: Sequence[str] = ()) -> list[Pair]:
    """The ring pairs below `pair_ratio` of the fastest pair of their kind, slowest first.

    With `hosts` (every rank's node) the pairs inside a node are judged among themselves and the
    pairs across nodes among themselves; without, all pairs are one kind.
    """
    ratio = pair_ratio(kind, hosts)
    if not hosts:
        return below_fastest(pair_bw, ratio)
    inside = {p: v for p, v in pair_bw.items() if not crosses_nodes(p, hosts)}
    across = {p: v for p, v in pair_bw.items() if crosses_nodes(p, hosts)}
    found = below_fastest(inside, ratio) + below_fastest(across, ratio)
    return sorted(found, key=lambda p: (pair_bw[p], p))


def blamed_pairs(parts: Mapping[int, PairTimings], kind: str,
                 hosts: Sequence[str] = ()) -> tuple[list[Pair], dict[Pair, float], int]:
    """The slow pairs the diagnosis may name (slowest first), every pair's busbw and the size.

    Only a pair that was timed twice is blamed: the second round speeds up the pairs a burst of
    noise slowed, which raises the fastest pair, and a pair that was fine against the first
    round's can then fall under the line without ever having been timed again. Facts without a
    second round (none was needed, or an older version) are judged as they are.
    """
    pair_bw, size = ring_pair_busbw(parts)
    slow = slow_pairs(pair_bw, kind, hosts)
    retimed = next((p.retimed for p in parts.values() if p.retimed is not None), None)
    if retimed is not None:
        slow = [pair for pair in slow if f"{pair[0]}-{pair[1]}" in retimed]
    return slow, pair_bw, size


def pairs_to_retime(parts: Mapping[int, PairTimings], kind: str, hosts: Sequence[str] = ()) -> list[Pair]:
    """The pairs the diagnosis would call slow on the first round, in rank order: the same list
    on every rank that reads the same timings."""
    pair_bw, _ = ring_pair_busbw(parts)
    return sorted(slow_pairs(pair_bw, kind, hosts))


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
    """The nodes below `ratio` of the fastest node, slowest first, and that fastest (0 with fewer than 2 nodes)."""
    if len(intra) < 2:
        return [], 0.0
    best = max(intra.values())
    return sorted((h for h, v in intra.items() if v < ratio * best), key=lambda h: intra[h]), best


def node_pair_busbw(pair_bws: Iterable[Mapping[Pair, float]], hosts: Sequence[str]) -> dict[NodePair, float]:
    """Each pair of nodes' busbw from every pair of their ranks that was timed (the rank ring's
    pairs across nodes and the node leaders'). One pair of ranks timed in several rounds counts
    by its best (noise only slows a call down); two nodes are as slow as their slowest pair of
    ranks (a bad path between two ranks is slow whoever else is fast). Keyed in node order."""
    order = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    best: dict[Pair, float] = {}
    for bw in pair_bws:
        for pair, v in bw.items():
            if crosses_nodes(pair, hosts):
                key = (min(pair), max(pair))
                best[key] = max(v, best.get(key, 0.0))
    out: dict[NodePair, float] = {}
    for (a, b), v in best.items():
        ha, hb = sorted((hosts[a], hosts[b]), key=lambda h: order[h])
        out[(ha, hb)] = min(v, out.get((ha, hb), v))
    return dict(sorted(out.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])))


@dataclass
class NodeVerdict:
    """What the node pairs say: every pair of nodes' figure (its slowest view), the slow nodes
    (every pair they are in is slow, and some node is fine), the slow paths no slow node
    explains, and what they were held against."""

    node_gbps: dict[NodePair, float] = field(default_factory=dict)
    slow_nodes: list[str] = field(default_factory=list)
    slow_paths: list[NodePair] = field(default_factory=list)
    fastest_gbps: Optional[float] = None  # the fastest node pair, where there are two or more
    expected_gbps: dict[NodePair, float] = field(default_factory=dict)  # what each should carry, where known

    def peers_gbps(self, node: str) -> Optional[float]:
        """The fastest pair of nodes that leaves `node` out: what its peers reach."""
        others = [v for p, v in self.node_gbps.items() if node not in p]
        return max(others) if others else None


def judge_nodes(views: Sequence[Mapping[NodePair, float]], kind: str,
                expected: Optional[Mapping[NodePair, float]] = None) -> NodeVerdict:
    """A node pair is slow below NODE_RATIO of the fastest node pair in a view, or below
    FAR_BELOW of what it should carry (`expected`, GB/s, where known). Each view (the node
    leaders' pairs, the rank ring's pairs across nodes) is judged on its own: their pairs run
    beside different numbers of others, and on shared CPUs that alone moves them apart. A node
    whose every pair is slow, with at least two pairs and some node not slow, is the slow node;
    a slow pair with a healthy node at each end is the path between them (with two nodes, one
    pair cannot tell which end is slow)."""
    order = {h: i for i, h in enumerate(dict.fromkeys(h for view in views for p in view for h in p))}
    node_bw: dict[NodePair, float] = {}
    for view in views:
        for pair, v in view.items():
            node_bw[pair] = min(v, node_bw.get(pair, v))
    node_bw = dict(sorted(node_bw.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])))
    expected = {p: v for p, v in (expected or {}).items() if p in node_bw}
    verdict = NodeVerdict(node_gbps=node_bw, expected_gbps=dict(expected))
    if len(node_bw) >= 2:
        verdict.fastest_gbps = max(node_bw.values())
    slow = {p for view in views for p in below_fastest(view, NODE_RATIO[kind])}
    slow |= {p for p, v in node_bw.items() if p in expected and v < FAR_BELOW[kind] * expected[p]}
    nodes = list(order)
    pairs_of = {h: [p for p in node_bw if h in p] for h in nodes}
    all_slow = [h for h in nodes if len(pairs_of[h]) >= 2 and all(p in slow for p in pairs_of[h])]
    if len(all_slow) < len(nodes):
        verdict.slow_nodes = sorted(all_slow, key=lambda h: max(node_bw[p] for p in pairs_of[h]))
    explained = set(verdict.slow_nodes)
    verdict.slow_paths = sorted((p for p in slow if not explained & set(p)), key=lambda p: (node_bw[p], p))
    return verdict
