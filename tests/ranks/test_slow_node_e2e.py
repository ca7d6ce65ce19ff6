"""A node's link really slowed by the kernel (`tc` on its veth, both ways), across namespace nodes
with one `torchrun --nnodes` each: `allreduce-bench` names that node (or, at 2 nodes, the link
between the two), never another; healthy nodes give no slow finding.

All in the slow tier (issue 40: the default subset below took ~60 s of the default run's 10
minutes on 2 cores): the default tier's test of the same node judging is
test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named. The
representative subset: the issue's case (3 nodes, one throttled to 200 Mbit/s, which the median
rule missed), 2 nodes of 2 ranks (one pair: the link is named), and 3 healthy nodes of 2. The
whole 2/3/4 nodes x 1/2 ranks matrix, throttled, delayed (netem, where the kernel has it) and
healthy, is also slow. benchmarks/slow_node_matrix.py counts it over many runs (benchmarks/README.md).
"""

from __future__ import annotations

import json

import pytest

from tests.trace_format import check_rules

from .multinode import CASES, SLOW_CODES, one_run, skip_without_tc, slowed_ceiling_gbps

pytestmark = [pytest.mark.ranks, skip_without_tc()]


def _pair_size(report: dict) -> int:
    """The size the node pairs were timed at (the allreduce facts' node timings)."""
    facts = next(p for p in report["probes"] if p["name"] == "allreduce")["facts"]
    return next(int(f["nodes"]["size_bytes"]) for f in facts.values() if (f.get("nodes") or {}).get("size_bytes"))


def _check(tmp_path, nodes: int, per_node: int, case: str) -> None:
    timeline = tmp_path / "bench.trace.json"
    out = one_run(tmp_path, nodes, per_node, case, extra=("--trace", str(timeline)))
    run = out.run
    assert run.report is not None, run.explain()
    slow = [f for f in run.report["findings"] if f["code"] in SLOW_CODES]
    hosts = run.report["nodes"]
    assert len(hosts) == nodes, hosts
    if CASES[case] is None:
        assert slow == [], [f["title"] for f in slow]
        assert run.codes[0] == 0, run.explain()
        return
    assert out.verdict == "right", (out.named, [f["title"] for f in slow])
    # Named alone: the throttled node, or with two nodes the link between them; never another node.
    assert [f["code"] for f in slow] == ["BW005"], [f["title"] for f in slow]
    finding = slow[0]
    if nodes > 2:
        assert finding["nodes"] == [hosts[-1]]
        assert finding["title"].startswith(f"Slow node {hosts[-1]}: its network reaches at best "), finding["title"]
        # Its figure is the throttled link's: at most what the kernel lets through at that rate (or delay),
        # a ceiling every host keeps however fast; its peers' is this host's own healthy figure, above it.
        # (Not "10x the node's": healthy namespace pairs reached 0.57-0.82 GB/s on a host twice as fast as
        # ours and 0.82 in a 3 x 2 run here, a 1 Gbit/s link 0.07-0.12, and 10x that is above them.)
        ceiling = slowed_ceiling_gbps(CASES[case], _pair_size(run.report))
        evidence = finding["evidence"]
        assert evidence["node_gbps"] <= ceiling < evidence["peers_gbps"], (ceiling, evidence)
    else:
        assert finding["nodes"] == hosts and finding["title"].endswith("one pair of nodes cannot tell which end is slow")
    assert "GLOO_SOCKET_IFNAME" in finding["fix"], finding["fix"]
    assert run.codes[0] == 1, run.explain()  # BW005 is a warning: exit 1
    # The timeline shows it at a glance: the node pairs with the throttled node are the long bars.
    doc = json.loads(timeline.read_text())
    check_rules(doc)
    bars = {e["name"]: e["dur"] for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].startswith("nodes ")}
    slowed = [d for name, d in bars.items() if hosts[-1] in name]
    others = [d for name, d in bars.items() if hosts[-1] not in name]
    assert slowed and (not others or min(slowed) > max(others)), bars


@pytest.mark.slow
@pytest.mark.parametrize("nodes,per_node,case", [(3, 1, "tbf"), (2, 2, "tbf"), (3, 2, "healthy")])
def test_the_throttled_node_or_link_is_named_and_healthy_nodes_are_quiet(tmp_path, nodes, per_node, case):
    """The representative subset: the issue's case, one pair of nodes, and healthy nodes.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named
    (the same allreduce-bench node judging, BW005 from the leader ring of node pairs, on 6 ranks named
    as 3 nodes with the slowness injected; the torchrun --nnodes launch across namespace nodes is
    test_multinode_e2e.py::test_two_healthy_nodes_give_one_report_grouped_by_node's)."""
    _check(tmp_path, nodes, per_node, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tbf", "tbf1g", "healthy"])
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_every_count_and_ranks_per_node(tmp_path, nodes, per_node, case):
    """The whole matrix of node counts and ranks per node, throttled and healthy.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named
    (the same allreduce-bench node judging, BW005 from the leader ring of node pairs, on 6 ranks named
    as 3 nodes with the slowness injected; the torchrun --nnodes launch across namespace nodes is
    test_multinode_e2e.py::test_two_healthy_nodes_give_one_report_grouped_by_node's)."""
    if case == "tbf1g" and nodes == 2:
        pytest.skip("one pair against a 10 Gbit/s veth: a 1 Gbit/s link sits at the 10% line (docs/multinode.md)")
    _check(tmp_path, nodes, per_node, case)


@pytest.mark.slow
@skip_without_tc(netem=True)
@pytest.mark.parametrize("nodes,per_node", [(3, 1), (4, 2)])
def test_a_delayed_link_is_named_too(tmp_path, nodes, per_node):
    """A link delayed by netem instead of throttled by tbf.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named
    (the same allreduce-bench node judging, BW005 from the leader ring of node pairs, on 6 ranks named
    as 3 nodes with the slowness injected; the torchrun --nnodes launch across namespace nodes is
    test_multinode_e2e.py::test_two_healthy_nodes_give_one_report_grouped_by_node's)."""
    _check(tmp_path, nodes, per_node, "netem")
