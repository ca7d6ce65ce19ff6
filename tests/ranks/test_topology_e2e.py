"""End to end on real gloo CPU ranks: the topology probe where there is no GPU.

What can be real here: ranks on two "nodes" (DDPDOCTOR_NODE_NAME), one of them started
under `taskset` as `srun --cpu-bind` would pin it, and this machine's own NUMA layout and
NICs. The GPU-link diagnoses are proven on modeled snapshots (tests/unit/test_topology_diagnose.py).
"""

from __future__ import annotations

import os

import pytest

from ddpdoctor.measure.host_layout import cpulist

from .harness import probe_section, run_hand_set_ranks, tagged_processes

pytestmark = pytest.mark.ranks


@pytest.mark.slow
def test_cpu_ranks_on_two_nodes_report_placement_per_rank_and_the_node_once(tmp_path):
    """Default twin: tests/ranks/test_multinode_e2e.py::test_two_healthy_nodes_give_one_report_grouped_by_node
    (the same topology probe on ranks of two nodes, read once per node; there real network namespaces,
    here named nodes with one rank pinned by taskset)
    """
    env = {r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "DDPDOCTOR_NODE_NAME": f"n{r // 2 + 1}"}
           for r in range(4)}
    mine = sorted(os.sched_getaffinity(0))
    procs, report, tag = run_hand_set_ranks(tmp_path, 4, env, "--probes", "topology", "--timeout", "30",
                                            prefix={3: ["taskset", "-c", str(mine[-1])]}, timeout_s=120)
    assert report is not None, procs[0].stdout + procs[0].stderr
    assert [p.returncode for p in procs] == [0, 0, 0, 0], procs[0].stdout + procs[0].stderr
    [finding] = report["findings"]
    assert (finding["code"], finding["severity"], finding["ranks"], finding["nodes"]) == (
        "TOP009", "info", [0, 1, 2, 3], ["n1", "n2"])
    facts = probe_section(report, "topology")["facts"]
    # The node is read once per node, by its local rank 0; every rank says where it may run.
    assert [r for r, f in sorted(facts.items()) if f["node"]] == ["0", "2"]
    assert facts["3"]["placement"]["cpus"] == str(mine[-1])
    assert all(facts[r]["placement"]["cpus"] == cpulist(mine) for r in ("0", "1", "2"))
    node = facts["0"]["node"]
    assert "lo" in [n["name"] for n in node["nics"]] and node["transport"]["route_to_master"]["interface"] == "lo"
    assert node["numa"] and all(f["load"] is None for f in facts.values())
    assert "no GPU topology" in procs[0].stdout
    assert not tagged_processes(tag)
