"""topology's diagnosis on node snapshots of six machine types, and on variants with one fault each.

The snapshots in tests/fixtures/topology are modeled from public `nvidia-smi topo -m`
outputs (see the README there), not recorded on GPUs. They load through
ddpdoctor.snapshot.load_inputs, as `ddpdoctor diagnose` loads them. Each variant changes a
copy the way the machine would really read after that fault: an NVLink that is down
reports inactive, a GPU pinned to the far socket has the other node's CPUs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.judge.link_model import Hop, hop_gbps, pcie_gbps, ring_expectation
from ddpdoctor.probes import RunView
from ddpdoctor.probes.topology.checks import cell, diagnose_topology, node_views
from ddpdoctor.probes.topology.render import render_matrices
from ddpdoctor.snapshot import load_inputs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
H100, A100 = "dgx_h100_nvswitch.json", "dgx_a100_nvswitch.json"
WORKSTATION, WORKSTATION_X8 = "workstation_4gpu_pcie_healthy.json", "workstation_4gpu_pcie_gpu2_x8.json"
PCIE_SERVER, RTX4090, SINGLE = "pcie_server_2socket_8gpu.json", "rtx4090_server_2socket_8gpu.json", "single_gpu_h100_pcie.json"
HEALTHY = (H100, A100, WORKSTATION, PCIE_SERVER, RTX4090, SINGLE)


def load(*names: str) -> dict[int, dict[str, Any]]:
    return load_inputs([str(FIXTURES / n) for n in names]).facts["topology"]


def judge(facts: dict[int, dict[str, Any]]) -> list[Finding]:
    hosts = {r: f["host"] for r, f in facts.items() if isinstance(f, dict) and isinstance(f.get("host"), str)}
    return diagnose_topology(facts, RunView(world_size=len(facts), hosts=hosts))


def alarms(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity >= Severity.WARN]


def variant(name: str, change: Callable[[dict[int, dict[str, Any]]], None]) -> dict[int, dict[str, Any]]:
    facts = copy.deepcopy(load(name))
    change(facts)
    return facts


def gpus(facts: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return facts[0]["node"]["gpus"]["gpus"]


def pair(facts: dict[int, dict[str, Any]], a: int, b: int) -> dict[str, Any]:
    return next(p for p in facts[0]["node"]["gpus"]["pairs"] if (p["a"], p["b"]) == (a, b))


def test_modeled_files_are_what_the_committed_generator_builds() -> None:
    spec = importlib.util.spec_from_file_location("build_topology", FIXTURES / "build_modeled.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    built = module.build()
    assert set(built) == {p.name for p in FIXTURES.glob("*.json")}
    for name, text in built.items():
        assert (FIXTURES / name).read_text(encoding="utf-8") == text, f"{name} is stale: rerun build_modeled.py"


@pytest.mark.parametrize("name, expected_gbps, bottleneck, also", [
    (H100, 360.0, "NVLink 4.0 x18", []),  # 18 x 25 GB/s x 0.8; nccl-tests measures ~370 on 8xH100 rings
    (A100, 240.0, "NVLink 3.1 x12", []),  # 12 x 25 x 0.8; ~230 measured on 8xA100
    (WORKSTATION, 15.8, "host memory (PHB)", []),  # Gen4 x16 31.5 x 0.5
    # The 2-socket servers also say what crossing the sockets costs (TOP011) and which GPUs reach their
    # NIC only across them (TOP012): information on one node, nothing broken.
    (PCIE_SERVER, 6.3, "host memory across sockets (SYS)", ["TOP011", "TOP012"]),  # Gen3 x16 15.75 x 0.4
    (RTX4090, 12.6, "host memory across sockets (SYS)", ["TOP011", "TOP012"]),  # Gen4 x16 x 0.4
])
def test_healthy_machine_gives_no_warning_and_its_expected_bandwidth(name: str, expected_gbps: float,
                                                                     bottleneck: str, also: list[str]) -> None:
    findings = judge(load(name))
    assert alarms(findings) == []
    assert sorted(f.code for f in findings if f.code != "TOP007") == also
    assert all(f.severity == Severity.INFO for f in findings)
    [info] = [f for f in findings if f.code == "TOP007"]
    assert info.code == "TOP007" and info.severity == Severity.INFO
    assert info.evidence["expected_busbw_gbps"] == pytest.approx(expected_gbps)
    assert info.evidence["expected_busbw_gbps_at_full_link_speed"] == pytest.approx(expected_gbps)
    assert info.evidence["bottleneck"].startswith(bottleneck)


def test_a_single_gpu_machine_gives_no_finding_at_all() -> None:
    assert judge(load(SINGLE)) == []


def test_matrix_cells_are_what_nvidia_smi_topo_prints() -> None:
    facts = load(PCIE_SERVER)
    view = node_views(facts, RunView(world_size=8))[0]
    assert [cell(view, 0, b) for b in range(8)] == ["X", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]
    h100 = node_views(load(H100), RunView(world_size=8))[0]
    assert {cell(h100, a, b) for a in range(8) for b in range(8) if a != b} == {"NV18"}


def test_a_gpu_downtrained_to_x8_under_load_is_named_with_its_bus_and_bandwidth() -> None:
    findings = judge(load(WORKSTATION_X8))
    [top001] = alarms(findings)
    assert (top001.code, top001.severity, top001.ranks, top001.nodes) == ("TOP001", Severity.WARN, (2,), ("ws-4gpu",))
    assert top001.evidence["link_under_load"] == "Gen4 x8" and top001.evidence["link_max"] == "Gen4 x16"
    assert top001.evidence["host_to_device_gbps"] == 12.4
    assert "lspci -vv -s 0000:41:00.0" in top001.fix
    [top007] = [f for f in findings if f.code == "TOP007"]
    assert top007.evidence["expected_busbw_gbps"] == pytest.approx(7.9)  # the x8 link bounds the ring
    assert top007.evidence["expected_busbw_gbps_at_full_link_speed"] == pytest.approx(15.8)


def test_an_idle_link_at_gen1_is_not_judged() -> None:
    """Every modeled GPU's idle reading is Gen1 (power saving); only the loaded reading counts."""
    facts = load(H100)
    assert {g["pcie_idle"]["gen"] for g in gpus(facts)} == {1}
    facts[3]["load"] = None  # the rank on GPU 3 could not load it: its link is not judged at all
    assert alarms(judge(facts)) == []


def _links_down(facts: dict[int, dict[str, Any]], gpu: int, count: int) -> None:
    for link in gpus(facts)[gpu]["nvlinks"][:count]:
        link["active"] = False


def test_nvlinks_down_are_named_critical_when_all_and_warn_when_some() -> None:
    facts = variant(H100, lambda f: (_links_down(f, 3, 18), _links_down(f, 5, 2)))
    findings = {f.code + str(f.evidence.get("gpu")): f for f in alarms(judge(facts))}
    assert set(findings) == {"TOP0023", "TOP0025"}  # no TOP003 on top: TOP002 names the cause
    assert findings["TOP0023"].severity == Severity.CRITICAL and findings["TOP0023"].ranks == (3,)
    assert findings["TOP0025"].severity == Severity.WARN
    assert findings["TOP0025"].evidence["active_links"] == 16 and findings["TOP0025"].evidence["inactive_links"] == [0, 1]
    view = node_views(facts, RunView(world_size=8))[0]
    assert cell(view, 3, 0) == "NODE" and cell(view, 3, 4) == "SYS" and cell(view, 5, 6) == "NV16"
    [top007] = [f for f in judge(facts) if f.code == "TOP007"]
    assert top007.evidence["bottleneck"].startswith("host memory")  # GPU 3's hop falls back to PCIe


def test_nvlink_judging_does_not_depend_on_gpu_order() -> None:
    for faulty in (0, 1):  # two GPUs: the faulty one is named whichever index it has
        facts = variant(H100, lambda f: _links_down(f, faulty, 3))
        [top002] = alarms(judge(facts))
        assert top002.evidence["gpu"] == faulty and top002.evidence["active_links"] == 15


def _bridged(facts: dict[int, dict[str, Any]], pairs: list[tuple[int, int]], inactive: list[int]) -> None:
    """RTX A6000s with 4-link NVLink bridges between the pairs given; the others report 4 inactive links."""
    board = {g["index"]: g for g in gpus(facts)}
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            board[x]["nvlinks"] = [{"link": i, "active": True, "version": 5, "remote_bus_id": board[y]["pci_bus_id"],
                                    "remote_type": "gpu"} for i in range(4)]
    for g in inactive:
        board[g]["nvlinks"] = [{"link": i, "active": False, "version": {"unknown": "Not Supported"},
                                "remote_bus_id": {"unknown": "Not Supported"}, "remote_type": {"unknown": "x"}}
                               for i in range(4)]


def test_bridged_boards_without_a_bridge_are_information_and_a_broken_bridge_link_a_warning() -> None:
    findings = judge(variant(WORKSTATION, lambda f: _bridged(f, [(0, 1)], [2, 3])))
    assert alarms(findings) == []
    assert sorted(f.evidence["gpu"] for f in findings if f.code == "TOP002") == [2, 3]
    view = node_views(variant(WORKSTATION, lambda f: _bridged(f, [(0, 1)], [2, 3])), RunView(world_size=4))[0]
    assert cell(view, 0, 1) == "NV4" and cell(view, 2, 3) == "PHB"

    def one_link_down(facts: dict[int, dict[str, Any]]) -> None:
        _bridged(facts, [(0, 1), (2, 3)], [])
        gpus(facts)[3]["nvlinks"][2]["active"] = False
    [top002] = alarms(judge(variant(WORKSTATION, one_link_down)))
    assert (top002.severity, top002.ranks, top002.evidence["inactive_links"]) == (Severity.WARN, (3,), [2])


def test_a_lone_bridge_capable_gpu_and_a_gpu_the_job_does_not_use_raise_no_alarm() -> None:
    lone = variant(SINGLE, lambda f: gpus(f)[0].update(nvlinks=[{"link": i, "active": False} for i in range(4)]))
    assert judge(lone) == []
    unused = variant(H100, lambda f: _links_down(f, 7, 18))
    del unused[7]  # a 7-rank job that leaves GPU 7 out
    [top002] = [f for f in judge(unused) if f.code == "TOP002"]
    assert top002.severity == Severity.INFO and top002.ranks == ()


def test_a_gpu_reached_only_across_the_socket_is_named() -> None:
    def move_gpu7(facts: dict[int, dict[str, Any]]) -> None:
        for other in (4, 5, 6):  # GPU 7 on a root port of the other socket, away from its old switch mate
            pair(facts, other, 7)["level"] = "SYS"
    findings = alarms(judge(variant(PCIE_SERVER, move_gpu7)))
    [top003] = findings
    assert (top003.code, top003.ranks, top003.evidence["closest_peer_path"]) == ("TOP003", (7,), "SYS")
    assert top003.evidence["others_closest_path"] == "PIX"


def test_peer_to_peer_blocked_where_the_switch_allows_it_is_named() -> None:
    def block(facts: dict[int, dict[str, Any]]) -> None:
        pair(facts, 0, 1)["p2p_read"] = "NS"  # NVML: not supported (ACS on the switch)
        pair(facts, 2, 3)["torch_peer"] = False  # NVML says OK, CUDA refuses: an IOMMU
        pair(facts, 0, 4)["p2p_read"] = "NS"  # SYS pair: NCCL would not use P2P there anyway
    [top004] = alarms(judge(variant(PCIE_SERVER, block)))
    assert top004.code == "TOP004" and top004.ranks == (0, 1, 2, 3)
    assert [p["gpus"] for p in top004.evidence["pairs"]] == ["0-1", "2-3"]


def test_consumer_gpus_without_p2p_are_not_an_alarm() -> None:
    facts = load(RTX4090)
    assert {p["p2p_read"] for p in facts[0]["node"]["gpus"]["pairs"]} == {"GNS"}
    assert alarms(judge(facts)) == []


def test_ranks_pinned_to_the_far_socket_are_named_and_unpinned_ones_are_information() -> None:
    def pin(facts: dict[int, dict[str, Any]]) -> None:
        numa = facts[0]["node"]["numa"]
        for rank in (4, 5):  # their GPUs are on NUMA 1; pinned to NUMA 0
            facts[rank]["placement"].update(cpus=numa["0"], numa_nodes=[0])
        for rank in (6, 7):
            facts[rank]["placement"].update(cpus="0-79", numa_nodes=[0, 1])
    findings = judge(variant(PCIE_SERVER, pin))
    [top005] = alarms(findings)
    assert top005.code == "TOP005" and top005.ranks == (4, 5)
    assert top005.evidence["ranks"][0]["gpu_local_cpus"] == "20-39,60-79"
    [top006] = [f for f in findings if f.code == "TOP006"]
    assert top006.severity == Severity.INFO and top006.ranks == (6, 7)


def test_a_cpuset_over_both_sockets_minus_housekeeping_cores_is_not_a_warning() -> None:
    facts = variant(PCIE_SERVER, lambda f: [f[r]["placement"].update(cpus="2-39,42-79") for r in range(8)])
    findings = judge(facts)
    assert alarms(findings) == []
    assert [f.ranks for f in findings if f.code == "TOP006"] == [tuple(range(8))]


def test_a_path_nvml_did_not_give_is_not_named_as_the_slow_one() -> None:
    def unknown_row(facts: dict[int, dict[str, Any]]) -> None:
        for other in range(7):
            pair(facts, other, 7)["level"] = {"unknown": "nvmlDeviceGetTopologyCommonAncestor: Unknown Error"}
    assert alarms(judge(variant(PCIE_SERVER, unknown_row))) == []


def test_affinity_is_not_judged_on_a_one_numa_node_host() -> None:
    facts = variant(WORKSTATION, lambda f: f[1]["placement"].update(cpus="3", numa_nodes=[0]))
    assert alarms(judge(facts)) == []


def test_replays_under_load_and_a_slot_that_caps_the_generation() -> None:
    def fault(facts: dict[int, dict[str, Any]]) -> None:
        facts[1]["load"]["replays_during_load"] = 7
        facts[2]["load"]["pcie"]["gpu_max_gen"] = 5
    findings = judge(variant(WORKSTATION, fault))
    assert [(f.code, f.ranks, f.severity) for f in findings if f.code in ("TOP008", "TOP010")] == [
        ("TOP008", (1,), Severity.WARN), ("TOP010", (2,), Severity.INFO)]


def test_two_nodes_are_judged_each_and_the_network_bounds_the_expectation() -> None:
    facts = load(WORKSTATION, WORKSTATION_X8)
    findings = judge(facts)
    [top001] = alarms(findings)
    assert top001.ranks == (6,) and top001.nodes[0].startswith("ws-4gpu (")  # the second file's ranks 4-7
    [top007] = [f for f in findings if f.code == "TOP007"]
    assert top007.evidence["expected_busbw_gbps"] == pytest.approx(1.1)  # one 10 GbE NIC x 0.9
    assert "network" in top007.evidence["bottleneck"]


def test_cpu_only_nodes_report_no_gpu_topology_and_nothing_else() -> None:
    facts = {r: {"rank": r, "host": "vm", "device": "cpu", "gpu_uuid": None, "load": None,
                 "placement": {"cpus": "0-1", "numa_nodes": [0]},
                 "node": {"numa": {"0": "0-1"}, "gpus": {"unknown": "NVML Shared Library Not Found"}, "nics": []}
                 if r == 0 else None} for r in range(3)}
    [top009] = judge(facts)
    assert (top009.code, top009.severity, top009.ranks) == ("TOP009", Severity.INFO, (0, 1, 2))
    assert "NVML Shared Library Not Found" in json.dumps(top009.evidence)


def test_a_node_whose_leader_did_not_report_is_skipped_not_misjudged() -> None:
    facts = copy.deepcopy(load(WORKSTATION_X8))
    facts[0]["node"] = None
    assert judge(facts) == []


def test_report_facts_with_string_rank_keys_judge_the_same() -> None:
    facts = load(WORKSTATION_X8)
    as_json = json.loads(json.dumps({str(k): v for k, v in facts.items()}))
    assert [f.to_json() for f in judge(as_json)] == [f.to_json() for f in judge(facts)]


def test_the_matrix_shows_the_links_and_marks_nothing_when_healthy() -> None:
    console = Console(record=True, width=160, color_system="truecolor")
    render_matrices(load(WORKSTATION_X8), console)
    text = console.export_text(clear=False)
    assert "Gen4 x8 / Gen4 x16" in text and text.count("PHB") == 12
    ansi = console.export_text(styles=True)
    assert "31mGPU2" in ansi and ansi.count("31m") == 1  # the faulty GPU's row label, in red, alone
    healthy = Console(record=True, width=160, color_system="truecolor")
    render_matrices(load(H100), healthy)
    assert healthy.export_text(clear=False).count("NV18") == 56
    assert "31m" not in healthy.export_text(styles=True)


BAD_VALUES = [None, {"unknown": "Not Supported"}, "x", -1, 3.5, [], {}, True, "0-", "7-2", "0-1,4"]


def _corrupt(value: Any, rng: random.Random, rate: float) -> Any:
    """Replace some parts with what a file may hold instead: nothing, "unknown", wrong types."""
    if rng.random() < rate:
        return rng.choice(BAD_VALUES)
    if isinstance(value, dict):
        return {k: _corrupt(v, rng, rate) for k, v in value.items()}
    if isinstance(value, list):
        return [_corrupt(v, rng, rate) for v in value]
    return value


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.01, 0.05, 0.2]),
       st.sampled_from([H100, WORKSTATION_X8, PCIE_SERVER, RTX4090]))
def test_diagnose_and_render_never_raise_on_corrupted_facts(seed: int, rate: float, name: str) -> None:
    rng = random.Random(seed)
    facts = {r: _corrupt(f, rng, rate) for r, f in load(name).items()}
    judge(facts)
    render_matrices(facts, Console(record=True, width=160))


# -- the model -------------------------------------------------------------------------------

def test_pcie_bandwidth_is_the_published_figure() -> None:
    assert pcie_gbps(3, 16) == 15.75 and pcie_gbps(4, 16) == 31.51 and pcie_gbps(5, 16) == 63.02
    assert pcie_gbps(4, 8) == pytest.approx(31.51 / 2, abs=0.01)
    assert pcie_gbps(None, 16) is None and pcie_gbps(9, 16) is None


def test_the_slowest_hop_bounds_the_ring() -> None:
    hops = [Hop(0, 1, "PIX", pcie_gbps=15.75), Hop(1, 2, "SYS", pcie_gbps=15.75), Hop(2, 0, "NV4", 4, 3)]
    expectation = ring_expectation(hops)
    assert expectation.busbw_gbps == pytest.approx(6.3) and expectation.hop == (1, 2)
    assert hop_gbps(Hop(0, 1, "PIX", pcie_gbps=15.75, p2p=False))[1] == "host memory (PIX, no P2P)"
    assert ring_expectation([Hop(0, 1, "PHB")]).busbw_gbps is None  # unknown link: not modelled, not guessed


def test_nvlink_versions_are_nvml_codes_not_generations() -> None:
    assert hop_gbps(Hop(0, 1, "NV18", 18, 6)) == (360.0, "NVLink 4.0 x18")  # H100 answers 6
    assert hop_gbps(Hop(0, 1, "NV12", 12, 5)) == (240.0, "NVLink 3.1 x12")  # A100 answers 5, not NVLink5
    assert hop_gbps(Hop(0, 1, "NV18", 18, 7))[0] == 720.0  # NVLink 5.0: 50 GB/s per link
    assert hop_gbps(Hop(0, 1, "NV18", 18, 8))[0] is None  # a code this model does not know: not guessed


def test_a_job_across_the_sockets_that_could_fit_on_one_is_warned_with_the_gpus_to_choose() -> None:
    """TOP011 (issue 41): a 2-rank job on GPUs 0 and 4 of the 2-socket PCIe server crosses the sockets
    where GPUs 0 and 1 (one switch) would not: warn, naming them. The whole machine's 8-GPU job cannot
    avoid it: information (the healthy test above)."""
    facts = load(PCIE_SERVER)
    job = {r: f for r, f in facts.items() if r in (0, 4)}  # rank 0 holds the node's facts
    [top011] = [f for f in judge(job) if f.code == "TOP011"]
    assert top011.severity == Severity.WARN and top011.ranks == (0, 4)
    assert top011.evidence["sys_pairs"] == ["0-4"] and top011.evidence["gpus_without_crossing"] == [0, 1]
    assert "CUDA_VISIBLE_DEVICES=0,1" in top011.fix
    assert top011.evidence["expected_busbw_gbps_per_sys_hop"] == {"this node": pytest.approx(6.3)}  # Gen3 x16 x 0.4
    same_socket = {r: f for r, f in facts.items() if r in (0, 1)}
    assert [f.code for f in judge(same_socket) if f.code == "TOP011"] == []


def test_gpus_far_from_every_nic_are_information_on_one_node_and_a_warning_across_nodes() -> None:
    """TOP012 (issue 41): on the PCIe server the one NIC sits on socket 0, so GPUs 4-7 reach it only
    across the sockets; a job spanning two such nodes sends their traffic that way, one on one node
    never does."""
    [one] = [f for f in judge(load(PCIE_SERVER)) if f.code == "TOP012"]
    assert one.severity == Severity.INFO and one.ranks == (4, 5, 6, 7)
    assert one.evidence["gpus_far_from_every_nic"] == [4, 5, 6, 7] and not one.evidence["job_across_nodes"]
    two = judge(load(PCIE_SERVER, RTX4090))
    far = [f for f in two if f.code == "TOP012"]
    assert len(far) == 2 and all(f.severity == Severity.WARN and f.evidence["job_across_nodes"] for f in far)
