"""The topology probe's typed facts (probes/topology/facts.py) keep the wire format.

Every rank's facts in every fixture that holds topology facts (the node snapshots in
tests/fixtures/topology, and any report whose probes include topology) read with
`TopologyFacts.from_json` and write back with `to_json` byte for byte. A freshly built object
writes its keys in the order collect wrote them before the facts were typed: the 2-rank report
in tests/fixtures/allreduce was recorded by that collect, and collect, fed that report's
readings, writes it again. A tolerant read of missing, null or wrong-kind values gives the
defaults and never raises.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from ddpdoctor.probes.topology import probe as topology_probe
from ddpdoctor.probes.topology.facts import (GpuNode, GpuPair, GpuTopology, IfnameSelection, LoadReading, NodeFacts,
                                             Nic, NvLink, PcieLink, Placement, Route, TopologyFacts, Transport)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RECORDED = FIXTURES / "allreduce" / "bench-2rank-gloo.json"  # written by the untyped collect, keys in its order


def _topology_ranks(doc: Any) -> list[dict[str, Any]]:
    """Each rank's topology facts in a snapshot (`probes.topology`: a list) or a report (`probes`: sections)."""
    probes = doc.get("probes") if isinstance(doc, dict) else None
    if isinstance(probes, dict) and isinstance(probes.get("topology"), list):
        return list(probes["topology"])
    if isinstance(probes, list):
        return [facts for section in probes if isinstance(section, dict) and section.get("name") == "topology"
                for facts in (section.get("facts") or {}).values()]
    return []


def _fixtures() -> dict[str, list[dict[str, Any]]]:
    found = {}
    for path in sorted(FIXTURES.rglob("*.json")):
        ranks = _topology_ranks(json.loads(path.read_text(encoding="utf-8")))
        if ranks:
            found[str(path.relative_to(FIXTURES))] = ranks
    return found


FOUND = _fixtures()


def test_every_fixture_with_topology_facts_is_found() -> None:
    topology_dir = {f"topology/{p.name}" for p in (FIXTURES / "topology").glob("*.json")}
    assert topology_dir and topology_dir <= set(FOUND)
    assert "allreduce/bench-2rank-gloo.json" in FOUND  # a report, not a snapshot


@pytest.mark.parametrize("name", sorted(FOUND))
def test_each_ranks_facts_read_and_write_back_byte_identical(name: str) -> None:
    for facts in FOUND[name]:
        typed = TopologyFacts.from_json(facts)
        assert json.dumps(typed.to_json(), sort_keys=False) == json.dumps(facts, sort_keys=False)


@pytest.mark.parametrize("name", sorted(FOUND))
def test_the_fixtures_read_into_the_types(name: str) -> None:
    """Not a pass-through: the nested parts come back as their dataclasses with the recorded values."""
    for facts in FOUND[name]:
        typed = TopologyFacts.from_json(facts)
        assert typed.host == facts["host"] and typed.gpu_uuid == facts["gpu_uuid"]
        assert isinstance(typed.placement, Placement) and typed.placement.cpus == facts["placement"].get("cpus")
        if facts["node"] is None:
            assert typed.node is None
            continue
        assert isinstance(typed.node, NodeFacts) and isinstance(typed.node.transport, Transport)
        assert [n.name for n in typed.node.nics] == [n["name"] for n in facts["node"]["nics"]]
        gpus = facts["node"]["gpus"]
        assert typed.node.gpus.unknown == gpus.get("unknown")
        assert [g.index for g in typed.node.gpus.gpus] == [g["index"] for g in gpus.get("gpus", [])]
        for gpu, raw in zip(typed.node.gpus.gpus, gpus.get("gpus", [])):
            assert isinstance(gpu.pcie_idle, PcieLink) and gpu.pcie_idle.max_width == raw["pcie_idle"]["max_width"]
            assert [link.active for link in gpu.nvlinks] == [link["active"] for link in raw["nvlinks"]]


BAD_VALUES: list[Any] = [None, {"unknown": "Not Supported"}, "x", -1, 3.5, [], {}, True, "0-"]


def _corrupt(value: Any, rng: random.Random, rate: float) -> Any:
    if rng.random() < rate:
        return rng.choice(BAD_VALUES)
    if isinstance(value, dict):
        return {k: _corrupt(v, rng, rate) for k, v in value.items()}
    if isinstance(value, list):
        return [_corrupt(v, rng, rate) for v in value]
    return value


@pytest.mark.parametrize("seed", range(20))
def test_corrupted_facts_read_without_error_and_write_back_as_read(seed: int) -> None:
    rng = random.Random(seed)
    for facts in FOUND["topology/dgx_h100_nvswitch.json"][:2] + FOUND["allreduce/bench-2rank-gloo.json"]:
        bad = {key: _corrupt(value, rng, 0.1) for key, value in copy.deepcopy(facts).items()}  # still an object
        assert json.dumps(TopologyFacts.from_json(bad).to_json()) == json.dumps(bad)


def test_a_tolerant_read_gives_the_defaults() -> None:
    empty = TopologyFacts.from_json({})
    assert (empty.rank, empty.host, empty.gpu_uuid, empty.load, empty.node) == (None, "", None, None, None)
    assert empty.placement == Placement()
    assert TopologyFacts.from_json(None) == TopologyFacts() and TopologyFacts.from_json([1]) == TopologyFacts()
    wrong = TopologyFacts.from_json({"host": 3, "placement": 5, "load": "x", "node": [], "device": None})
    assert (wrong.host, wrong.placement, wrong.load, wrong.node, wrong.device) == ("", Placement(), None, None, "")
    node = NodeFacts.from_json({"numa": None, "gpus": None, "nics": {"unknown": "sysfs unreadable"},
                                "transport": "x"})
    assert (node.numa, node.gpus, node.nics, node.transport) == ({}, GpuTopology(), [], Transport())
    gpus = GpuTopology.from_json({"gpus": [{"index": 0, "pcie_idle": None, "nvlinks": "x"}], "pairs": None})
    assert gpus.gpus == [GpuNode(index=0)] and gpus.pairs == []
    link = NvLink.from_json({"active": "yes", "link": 2})
    assert (link.active, link.link) == (False, 2)
    transport = Transport.from_json({"selected_by_env": {"GLOO_SOCKET_IFNAME": {"selects": None}}, "nccl_net": 1})
    assert transport.selected_by_env["GLOO_SOCKET_IFNAME"] == IfnameSelection() and transport.nccl_net == ""
    assert LoadReading.from_json({"pcie": "x"}).pcie is None and Nic.from_json({"rdma": None}).rdma == []


# -- a fresh object: the keys collect wrote, in its order ----------------------------------------

def test_fresh_objects_write_the_keys_of_the_recorded_report_in_its_order() -> None:
    recorded = FOUND["allreduce/bench-2rank-gloo.json"]
    leader = next(f for f in recorded if f["node"] is not None)
    node, transport = leader["node"], leader["node"]["transport"]
    fresh = TopologyFacts(node=NodeFacts(nics=[Nic()], transport=Transport(
        selected_by_env={"GLOO_SOCKET_IFNAME": IfnameSelection(missing=[])}, route_to_master=Route())),
        placement=Placement(numa_nodes=[0])).to_json()
    assert list(fresh) == list(leader)
    assert list(fresh["node"]) == list(node) and list(fresh["node"]["transport"]) == list(transport)
    assert list(fresh["node"]["nics"][0]) == list(node["nics"][0])
    assert list(fresh["placement"]) == list(leader["placement"])
    assert list(fresh["node"]["transport"]["route_to_master"]) == list(transport["route_to_master"])
    by_env = transport["selected_by_env"]["GLOO_SOCKET_IFNAME"]
    assert list(fresh["node"]["transport"]["selected_by_env"]["GLOO_SOCKET_IFNAME"]) == list(by_env)


# ddpdoctor/measure/topology.py builds the GPU side (the snapshots store it with sorted keys):
# `_gpu`, `_pair`, `_pcie`, `_nvlinks`, `read_gpu_topology` and `read_link_under_load`, in this order.
MEASURED_ORDER = [
    (GpuNode(), ["index", "uuid", "name", "pci_bus_id", "numa_node", "cpu_affinity", "pcie_idle", "nvlinks"]),
    (GpuPair(), ["a", "b", "level", "p2p_read", "p2p_write", "p2p_nvlink", "torch_peer"]),
    (PcieLink(gen=1, max_gen=1, gpu_max_gen=1, width=1, max_width=1, replay_counter=0),
     ["gen", "max_gen", "gpu_max_gen", "width", "max_width", "replay_counter"]),
    (NvLink(), ["link", "active", "version", "remote_bus_id", "remote_type"]),
    (GpuTopology(), ["gpus", "pairs", "torch_peer_error"]),
    (LoadReading(pcie=PcieLink(), copies=1, h2d_gbps=1.0, d2h_gbps=1.0, replays_during_load=0),
     ["pcie", "copies", "h2d_gbps", "d2h_gbps", "replays_during_load"]),
]


@pytest.mark.parametrize("fresh, order", MEASURED_ORDER, ids=[type(fresh).__name__ for fresh, _ in MEASURED_ORDER])
def test_fresh_gpu_parts_write_the_measured_keys_in_order(fresh: Any, order: list[str]) -> None:
    assert list(fresh.to_json()) == order
    snapshot = FOUND["topology/workstation_4gpu_pcie_gpu2_x8.json"][0]
    gpus = snapshot["node"]["gpus"]
    recorded = {"GpuNode": gpus["gpus"][0], "GpuPair": gpus["pairs"][0], "PcieLink": gpus["gpus"][0]["pcie_idle"],
                "GpuTopology": gpus, "LoadReading": snapshot["load"]}
    if type(fresh).__name__ in recorded:
        assert set(order) == set(recorded[type(fresh).__name__])


def test_an_unknown_reading_is_written_alone() -> None:
    assert LoadReading(unknown="RuntimeError: no memory").to_json() == {"unknown": "RuntimeError: no memory"}
    assert GpuTopology(unknown="NVML unavailable").to_json() == {"gpus": [], "pairs": [], "torch_peer_error": None,
                                                                 "unknown": "NVML unavailable"}
    assert PcieLink(gen=4, width=8).to_json() == {"gen": 4, "width": 8}  # what NVML did not give is left out


# -- collect, fed the recorded report's readings, writes that report's facts again ---------------

@pytest.fixture()
def recorded_readings(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The readers collect calls, answering what the recorded leader rank read."""
    leader = copy.deepcopy(next(f for f in FOUND["allreduce/bench-2rank-gloo.json"] if f["node"] is not None))
    node, transport = leader["node"], leader["node"]["transport"]
    for var in topology_probe.TRANSPORT_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in transport["env"].items():
        monkeypatch.setenv(var, value)
    answers = {"numa_nodes": lambda: node["numa"], "cpu_slots": lambda: 2, "nics": lambda: node["nics"],
               "process_placement": lambda numa: leader["placement"], "gpu_uuid": lambda device: None,
               "read_gpu_topology": lambda cpus: node["gpus"], "read_link_under_load": lambda device, uuid: None}
    for name, answer in answers.items():
        monkeypatch.setattr(topology_probe, name, answer)
    net = SimpleNamespace(
        interfaces=lambda: {"lo": {"ipv4": ["127.0.0.1"], "ipv6": []}, "eth0": {"ipv4": ["10.0.0.2"], "ipv6": []}},
        hostname_addresses=lambda host: (["127.0.0.1"], None),
        ifname_facts=lambda environ, ifaces: transport["selected_by_env"],
        route_to=lambda addr, port, ifaces: transport["route_to_master"])
    monkeypatch.setattr(topology_probe, "net_facts", net)
    return leader


def _ctx(published: list[Any], local_rank: int = 0) -> Any:
    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:
        yield

    env = SimpleNamespace(hostname="vm", local_rank=local_rank, master_addr="127.0.0.1", master_port=29500)
    return SimpleNamespace(device="cpu", rank=local_rank, env=env, stage=stage,
                           publish_partial=lambda probe, facts: published.append((probe, facts.to_json())))


def test_collect_writes_what_the_untyped_collect_recorded(recorded_readings: dict[str, Any]) -> None:
    published: list[Any] = []
    facts = topology_probe.Topology().collect(_ctx(published))
    assert json.dumps(facts, sort_keys=False) == json.dumps(recorded_readings, sort_keys=False)
    assert [name for name, _ in published] == ["topology"]
    assert json.dumps(published[0][1]) == json.dumps(recorded_readings)  # published before the load: load null


def test_a_failed_load_and_unreadable_nics_are_facts(recorded_readings: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(device: Any, uuid: Any) -> None:
        raise RuntimeError("CUDA out of memory\nTried to allocate 64 MiB")

    monkeypatch.setattr(topology_probe, "read_link_under_load", no_memory)
    monkeypatch.setattr(topology_probe, "nics", lambda: {"unknown": "/sys/class/net unreadable"})
    facts = topology_probe.Topology().collect(_ctx([]))
    assert facts["load"] == {"unknown": "RuntimeError: CUDA out of memory"}
    assert facts["node"]["nics"] == {"unknown": "/sys/class/net unreadable"}
    assert list(facts["node"]) == ["numa", "gpus", "nics", "transport"]
    assert facts["node"]["transport"]["rdma_devices"] == [] and facts["node"]["transport"]["nccl_net"] == "Socket"


def test_a_rank_that_is_not_its_nodes_first_writes_no_node(recorded_readings: dict[str, Any]) -> None:
    facts = topology_probe.Topology().collect(_ctx([], local_rank=1))
    assert facts["node"] is None and list(facts) == list(recorded_readings)
