"""The node search on real ranks: six gloo ranks named as six nodes (DDPDOCTOR_NODE_NAME), one
node's link to every other slowed by the injector, and a healthy run beside it.

Above 4 nodes `allreduce-bench` runs the search of ddpdoctor/judge/node_search.py: rounds of
disjoint groups of node leaders, each group one all-reduce, all of a round at once. What is
checked: the rounds rank 0 recorded replay to the same verdict, the slowed node is the one named
(never another), and a healthy run names none. Only the search's own findings are held here:
the node pairs' rule (BW005 from the leader ring) has its own tests.
"""

from __future__ import annotations

import pytest

from ddpdoctor.judge.node_search import replay

from .harness import probe_section, run_hand_set_ranks, tagged_processes

SMALL = ("--min-bytes", "4K", "--max-bytes", "1M", "--factor", "16", "--warmup", "1", "--iters", "5")
NODES = 6


def _run(tmp_path, *inject: str):
    env = {r: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "DDPDOCTOR_NODE_NAME": f"n{r + 1}"} for r in range(NODES)}
    procs, report, tag = run_hand_set_ranks(tmp_path, NODES, env, *SMALL, "--timeout", "60", *inject,
                                            command="allreduce-bench", timeout_s=240)
    assert report is not None, procs[0].stdout + procs[0].stderr
    assert not tagged_processes(tag)
    nodes = probe_section(report, "allreduce")["facts"]["0"]["nodes"]
    rounds = list(zip(nodes["search_groups"], nodes["search_busbw"]))
    return report, replay([f"n{r + 1}" for r in range(NODES)], [([tuple(g) for g in gs], v) for gs, v in rounds])


@pytest.mark.slow
def test_the_search_names_the_slowed_node_and_no_other(tmp_path):
    """Node n4's link to every other node slowed: the search names n4 and no other.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named
    (the same allreduce-bench over ranks named as nodes by DDPDOCTOR_NODE_NAME, launched by hand, and
    the same node judging, probes/allreduce/probe.py's _slow_nodes; above 4 nodes it adds the search,
    whose rounds and replay are tests/unit/test_node_search.py's)."""
    slow = 3  # node n4: its link to every other node is slowed
    faults = ",".join(f"slowlink:ranks={slow},{r}" for r in range(NODES) if r != slow)
    report, result = _run(tmp_path, "--inject", faults)
    assert result.slow_nodes == ["n4"], (result.slow_nodes, result.unsure)
    assert result.stopped == "done" and 3 <= result.rounds <= 30
    assert {n for f in _from_search(report) for n in f["nodes"]} <= {"n4"}, report["findings"]
    assert any("n4" in f["nodes"] for f in report["findings"] if f["code"] == "BW005"), report["findings"]


@pytest.mark.slow
def test_a_healthy_run_names_none(tmp_path):
    """Six healthy nodes: the search names none.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_across_nodes_a_slow_node_and_a_slow_path_are_named
    (the same allreduce-bench over ranks named as nodes by DDPDOCTOR_NODE_NAME, launched by hand, and
    the same node judging, probes/allreduce/probe.py's _slow_nodes; above 4 nodes it adds the search,
    whose rounds and replay are tests/unit/test_node_search.py's)."""
    report, result = _run(tmp_path)
    assert result.slow_nodes == [] and result.stopped == "done", result
    assert not _from_search(report), report["findings"]


def _from_search(report) -> list[dict]:
    """The BW005 findings the search made (the node pairs make the others)."""
    return [f for f in report["findings"] if f["code"] == "BW005" and "search_busbw_gbps" in f["evidence"]]
