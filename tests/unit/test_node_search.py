"""The large-N slow-node search (ddpdoctor.judge.node_search), simulated on its timing model.

A group's busbw is its slowest member's speed times lognormal noise, drawn afresh for every
timing; a slow node is 2x to 100x slower. Every case runs over many seeds: the right node(s)
named, never a healthy one, in a number of rounds that grows as log N, with groups that share
no node within a round, at a small fraction of the timings of every pair.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from ddpdoctor.judge.node_search import Group, NodeSearch, SearchResult, model_busbw, replay, run_search


def _nodes(n: int) -> list[str]:
    return [f"node{i:04d}" for i in range(n)]


def _search(n: int, slow: int, sigma: float, seed: int, factor: float = 0.0) -> tuple[SearchResult, set[str]]:
    """One search on n simulated nodes, `slow` of them slowed `factor` times (a random 2-100x
    when 0), every round checked for disjoint groups."""
    rng = random.Random(seed)
    nodes = _nodes(n)
    bad = set(rng.sample(nodes, slow))
    slowdown = {node: factor or rng.uniform(2.0, 100.0) for node in bad}

    def time_round(groups: list[Group]) -> list[float]:
        members = [node for g in groups for node in g]
        assert len(members) == len(set(members)), "a node in two groups of one round"
        assert all(len(g) >= 2 for g in groups), "a group of one node times nothing"
        return model_busbw(groups, lambda node: 100.0 / slowdown.get(node, 1.0), sigma, rng.gauss)

    return run_search(nodes, time_round), bad


# n=1024 is the slow tier in the three tests below: the same search, and test_rounds_grow_as_log_n_not_n
# searches 1024 nodes by default.
BIG = pytest.param(1024, marks=pytest.mark.slow)


@pytest.mark.parametrize("n", [16, 64, 256, BIG])
def test_one_slow_node_is_named_in_log_n_rounds(n: int) -> None:
    results = [_search(n, 1, 0.2, seed, factor=4.0) for seed in range(30)]
    for result, bad in results:
        assert set(result.slow_nodes) == bad, (result.slow_nodes, bad, result.unsure)
        assert result.stopped == "done"
    assert max(r.rounds for r, _ in results) <= 2 * math.log2(n) + 10


def test_rounds_grow_as_log_n_not_n() -> None:
    """16x the nodes (64 -> 1024) is 4 more halvings: the median search takes at most 2 rounds
    more per halving, while every pair would take 16x the rounds."""
    median = {n: statistics.median(_search(n, 1, 0.2, seed, factor=4.0)[0].rounds for seed in range(20))
              for n in (64, 1024)}
    assert median[1024] - median[64] <= 2 * 4


@pytest.mark.parametrize("n", [64, BIG])
def test_no_slow_node_names_none(n: int) -> None:
    for seed in range(30):
        result, _ = _search(n, 0, 0.3, seed)
        assert result.slow_nodes == [] and result.unsure == [], seed
        assert result.stopped == "done"


@pytest.mark.parametrize("n", [5, 8, 16])
def test_no_slow_node_among_few_names_none(n: int) -> None:
    """Few nodes give few timings of the healthy level: under 30% noise a healthy node may be
    left unsure now and then (said, not named), never named."""
    unsure = 0
    for seed in range(30):
        result, _ = _search(n, 0, 0.3, seed)
        assert result.slow_nodes == [], seed
        unsure += len(result.unsure)
    assert unsure <= 6


@pytest.mark.parametrize("n", [8, 16, 256, BIG])
def test_two_slow_nodes_are_both_named(n: int) -> None:
    for seed in range(30):
        result, bad = _search(n, 2, 0.2, seed)
        assert set(result.slow_nodes) == bad, (seed, result.slow_nodes, bad)


@pytest.mark.parametrize("n", [8, 64, 256])
def test_loud_noise_and_a_faint_slowdown_never_blame_a_healthy_node(n: int) -> None:
    """30% noise against a 2x slowdown, the hardest case: a node the evidence cannot settle is
    left unsure (said, not named), never swapped for a healthy one; most are still named."""
    named = unsure_healthy = 0
    for seed in range(40):
        result, bad = _search(n, 1, 0.3, seed, factor=2.0)
        assert set(result.slow_nodes) <= bad, (seed, result.slow_nodes, bad)
        named += len(result.slow_nodes)
        unsure_healthy += len({e.node for e in result.unsure} - bad)
    assert named >= 30
    assert unsure_healthy <= 4


def test_a_named_node_was_timed_several_times_beside_different_partners() -> None:
    result, bad = _search(256, 1, 0.2, seed=7, factor=3.0)
    (evidence,) = result.slow
    assert evidence.node in bad
    assert len(evidence.busbw) >= 3 and len(set(evidence.groups)) >= 2
    assert all(evidence.node in g for g in evidence.groups)
    assert evidence.ratio < 0.5 and evidence.healthy_busbw == pytest.approx(100.0, rel=0.2)


def test_far_fewer_timings_than_every_pair() -> None:
    """Every pair of 1,024 nodes: 523,776 timings in 1,023 rounds of disjoint pairs."""
    n = 1024
    results = [_search(n, 2, 0.2, seed)[0] for seed in range(10)]
    assert max(r.rounds for r in results) < (n - 1) / 20
    assert max(r.timings for r in results) < n * (n - 1) / 2 / 1000


@pytest.mark.parametrize("slow", [5, 25])
def test_more_slow_nodes_than_two_is_widespread_not_a_node(slow: int) -> None:
    """Five or 25 of 256 nodes slow is no one node's fault (a switch, a rack, the fabric): the
    search stops there and names none."""
    for seed in range(10):
        result, _ = _search(256, slow, 0.1, seed, factor=4.0)
        assert result.stopped == "widespread" and result.slow_nodes == [], seed


def test_the_first_round_covers_every_node_once() -> None:
    search = NodeSearch(_nodes(100))
    groups = search.plan()
    members = [node for g in groups for node in g]
    assert sorted(members) == _nodes(100)


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError):
        NodeSearch(_nodes(3))
    with pytest.raises(ValueError):
        NodeSearch(["a", "b", "c", "a"])
    search = NodeSearch(_nodes(16))
    groups = search.plan()
    with pytest.raises(ValueError):
        search.record([1.0] * (len(groups) - 1))
    with pytest.raises(RuntimeError):
        search.plan()
    with pytest.raises(ValueError):
        search.record([0.0] * len(groups))


def test_a_recorded_search_replays_to_the_same_verdict() -> None:
    """The ranks record each round's groups and busbw; the diagnosis replays them."""
    rng = random.Random(3)
    nodes = _nodes(64)
    search, rounds = NodeSearch(nodes), []
    while groups := search.plan():
        figures = model_busbw(groups, lambda node: 30.0 if node == "node0017" else 100.0, 0.2, rng.gauss)
        search.record(figures)
        rounds.append((groups, figures))
    result = replay(nodes, rounds)
    assert result.slow_nodes == search.result().slow_nodes == ["node0017"]
    assert result.rounds == len(rounds)
    with pytest.raises(ValueError):
        replay(nodes, rounds[1:])
