"""Probe `init-hang`: its judging on a recorded run and on multi-node variants of it, and its readings.

The multi-node cases start from the facts this VM really recorded and change only what
the case is about (a host name, an interface, an arrival time), so every other field is
what a real rank writes.
"""

from __future__ import annotations

import copy
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.measure import net as net_facts
from ddpdoctor.probes import RunView
from ddpdoctor.probes.init_hang import LATE_ARRIVAL_S, InitHang
from tests.dropping_port import dropping_port

RECORDED = json.loads((Path(__file__).parent.parent / "fixtures" / "init_hang" / "cpu_vm_2rank_recorded.json")
                      .read_text())
PROBE = InitHang()


def recorded_facts() -> dict[int, dict[str, Any]]:
    return {int(r): copy.deepcopy(f) for r, f in RECORDED["facts"].items()}


def two_nodes(n: int = 4) -> tuple[dict[int, dict[str, Any]], RunView]:
    """n ranks over nodes a and b, reaching the store on node a at 10.0.0.1 through eth0."""
    base = recorded_facts()[0]
    facts = {}
    for r in range(n):
        f = copy.deepcopy(base)
        host = "node-a" if r < n // 2 else "node-b"
        f.update(hostname=host, master_addr="node-a", resolved=["10.0.0.1"],
                 route={"source": "10.0.0.1" if host == "node-a" else "10.0.0.2", "interface": "eth0"},
                 hostname_resolves_to=["10.0.0.1" if host == "node-a" else "10.0.0.2"],
                 socket_ifname={}, arrived_t=base["arrived_t"] + 0.1 * r, backend="gloo",
                 rendezvous_s=0.5 - 0.1 * r)  # each waits until the last hello lands
        f["interfaces"]["eth0"]["ipv4"] = [f["route"]["source"]]
        facts[r] = f
    return facts, RunView(world_size=n, hosts={r: facts[r]["hostname"] for r in facts})


def codes(findings) -> list[str]:
    return [f.code for f in findings]


def test_the_recorded_healthy_run_is_ok_and_says_how_the_ranks_met():
    facts = recorded_facts()
    findings = PROBE.diagnose(facts, RunView(world_size=2, hosts={0: "vm", 1: "vm"}))
    assert codes(findings) == ["INIT000"]
    ok = findings[0]
    assert ok.ranks == (0, 1) and ok.evidence["resolved_to"] == ["127.0.0.1"]
    assert ok.evidence["route_to_master"] == ["vm: lo"]
    spread = max(f["rendezvous_s"] for f in facts.values()) - min(f["rendezvous_s"] for f in facts.values())
    assert ok.evidence["arrival_spread_s"] == pytest.approx(spread, abs=1e-3)


def test_healthy_two_nodes_give_no_alarm():
    facts, run = two_nodes()
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]


def test_a_missing_rank_leaves_the_verdict_to_the_run_finding():
    facts = recorded_facts()
    del facts[1]
    assert PROBE.diagnose(facts, RunView(world_size=2, hosts={0: "vm"})) == []


@pytest.mark.parametrize("var, value, expected", [
    ("NCCL_SOCKET_IFNAME", "ib0", "Bootstrap : no socket interface found"),
    ("NCCL_SOCKET_IFNAME", "^eth,lo", "Bootstrap : no socket interface found"),
    ("GLOO_SOCKET_IFNAME", "eth", "Unable to find address for: eth"),  # gloo wants exact names
])
def test_an_ifname_that_selects_no_live_interface_is_critical_on_that_node(var, value, expected):
    facts, run = two_nodes()
    for r in facts:
        facts[r]["backend"] = "nccl" if var.startswith("NCCL") else "gloo"  # the backend that reads it
    for r in (2, 3):
        facts[r]["socket_ifname"] = net_facts.ifname_facts({var: value}, facts[r]["interfaces"])
    findings = PROBE.diagnose(facts, run)
    bad = [f for f in findings if f.code == "INIT001"]
    assert len(bad) == 1 and bad[0].ranks == (2, 3) and bad[0].nodes == ("node-b",)
    assert bad[0].severity.label == "critical" and bad[0].evidence["expected_error"].endswith(expected)
    assert "eth0" in bad[0].evidence["interfaces_up"] and bad[0].evidence["route_to_master"] == ["eth0"]
    assert "INIT000" not in codes(findings)


def test_an_ifname_the_runs_backend_does_not_read_is_a_warning_only():
    # A site-wide module sets NCCL_SOCKET_IFNAME=ib0; this gloo check initialised fine without it.
    facts, run = two_nodes()
    for f in facts.values():
        f["socket_ifname"] = net_facts.ifname_facts({"NCCL_SOCKET_IFNAME": "ib0"}, f["interfaces"])
    bad, = [f for f in PROBE.diagnose(facts, run) if f.code == "INIT001"]
    assert bad.severity.label == "warn" and bad.evidence["backend_of_this_run"] == ["gloo"]


def test_gloo_needs_every_name_in_its_list():
    facts, run = two_nodes()
    for f in facts.values():
        f["socket_ifname"] = net_facts.ifname_facts({"GLOO_SOCKET_IFNAME": "eth0,ib0"}, f["interfaces"])
    bad, = [f for f in PROBE.diagnose(facts, run) if f.code == "INIT001"]
    assert bad.severity.label == "critical" and bad.evidence["not_on_this_host"] == ["ib0"]
    assert bad.evidence["expected_error"] == "Unable to find address for: ib0"


def test_an_ifname_that_matches_is_not_flagged():
    facts, run = two_nodes()
    for f in facts.values():
        f["socket_ifname"] = net_facts.ifname_facts({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0"},
                                                    f["interfaces"])
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]


def test_a_host_name_on_loopback_breaks_gloo_across_nodes():
    facts, run = two_nodes()
    for r in (2, 3):
        facts[r]["hostname_resolves_to"] = ["127.0.1.1"]  # Debian's hosts-file line
    findings = PROBE.diagnose(facts, run)
    loop = [f for f in findings if f.code == "INIT002"]
    assert len(loop) == 1 and loop[0].ranks == (2, 3) and loop[0].severity.label == "critical"
    assert loop[0].evidence["hostname_resolves_to"] == ["node-b -> 127.0.1.1"]
    # With GLOO_SOCKET_IFNAME set, gloo does not look at the host name at all.
    for r in (2, 3):
        facts[r]["socket_ifname"] = net_facts.ifname_facts({"GLOO_SOCKET_IFNAME": "eth0"}, facts[r]["interfaces"])
    assert "INIT002" not in codes(PROBE.diagnose(facts, run))


def test_a_host_name_on_loopback_is_right_on_one_node():
    facts = recorded_facts()  # this VM: `vm` resolves to 127.0.0.1, and all ranks are here
    assert facts[0]["hostname_resolves_to"] == ["127.0.0.1"]
    assert "INIT002" not in codes(PROBE.diagnose(facts, RunView(world_size=2, hosts={0: "vm", 1: "vm"})))


def test_master_addr_resolving_differently_names_the_odd_ranks():
    facts, run = two_nodes(6)
    facts[5]["resolved"] = ["10.9.9.9"]  # a stale /etc/hosts entry on one rank's node
    findings = PROBE.diagnose(facts, run)
    split = [f for f in findings if f.code == "INIT003"]
    assert len(split) == 1 and split[0].ranks == (5,)
    assert split[0].evidence["resolved_by_ranks"] == {"10.0.0.1": "0-4", "10.9.9.9": "5"}


def test_loopback_on_the_store_host_is_the_same_place_as_its_lan_address():
    facts, run = two_nodes()
    for r in (0, 1):
        facts[r]["resolved"] = ["127.0.0.1"]
    assert "INIT003" not in codes(PROBE.diagnose(facts, run))


def test_a_late_rank_is_named_with_its_gap_and_its_own_start_up():
    facts, run = two_nodes()
    # Rank 3 came 12.5 s after rank 0: the others waited that much longer for it.
    for r in (0, 1, 2):
        facts[r]["rendezvous_s"] = 12.6 - 0.1 * r
    facts[3]["rendezvous_s"] = 0.1
    facts[3]["start_to_arrival_s"] = 11.9
    late = [f for f in PROBE.diagnose(facts, run) if f.code == "INIT004"]
    assert len(late) == 1 and late[0].ranks == (3,) and late[0].nodes == ("node-b",)
    assert late[0].evidence["arrival_after_first_s"]["3"] == pytest.approx(LATE_ARRIVAL_S + 2.5, abs=0.01)
    assert late[0].evidence["start_to_arrival_s"] == {"3": 11.9}
    for r in (0, 1, 2):
        facts[r]["rendezvous_s"] = LATE_ARRIVAL_S - 1
    assert "INIT004" not in codes(PROBE.diagnose(facts, run))


def test_a_skewed_clock_on_a_node_is_no_late_rank():
    facts, run = two_nodes()
    for r in (2, 3):
        facts[r]["arrived_t"] += 12.0  # node-b's clock runs 12 s ahead; the waits are what they were
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]


def test_an_init_that_did_not_finish_everywhere_is_not_called_ok():
    facts, run = two_nodes()
    del facts[1]["init_s"]  # rank 1 published its arrival, then hung in init_process_group
    assert PROBE.diagnose(facts, run) == []


def test_unreadable_facts_never_raise():
    facts, run = two_nodes()
    facts[1] = {"resolved": {"unknown": "gaierror: -2"}, "interfaces": {"unknown": "x"}, "route": {"unknown": "y"}}
    facts[2] = {}
    PROBE.diagnose(facts, run)


# -- the readings --------------------------------------------------------------

@pytest.mark.parametrize("spec, exact, expected", [
    ("eth", False, ["eth0", "eth1"]),
    ("=eth", False, []),
    ("=eth0", False, ["eth0"]),
    ("^eth", False, ["ib0", "lo"]),
    ("^=eth0,lo", False, ["eth1", "ib0"]),
    ("ib,eth1", False, ["eth1", "ib0"]),
    ("eth", True, []),
    ("eth1,ib0", True, ["eth1", "ib0"]),
])
def test_ifname_rules_follow_nccl_and_gloo(spec, exact, expected):
    assert sorted(net_facts.ifname_matches(spec, ["eth0", "eth1", "ib0", "lo"], exact_only=exact)) == expected


def test_ifname_facts_ignore_down_interfaces_and_unset_variables():
    ifaces = {"eth0": {"up": False, "ipv4": ["10.0.0.1"], "ipv6": []},
              "eth1": {"up": True, "ipv4": [], "ipv6": []},
              "ib0": {"up": True, "ipv4": ["10.1.0.1"], "ipv6": []}}
    got = net_facts.ifname_facts({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": ""}, ifaces)
    assert got == {"NCCL_SOCKET_IFNAME": {"value": "eth", "selects": []}}


def test_this_hosts_interfaces_and_route_to_loopback_are_read():
    ifaces = net_facts.interfaces()
    assert "127.0.0.1" in [a for i in ifaces.values() for a in i["ipv4"]]
    route = net_facts.route_to("127.0.0.1", 29500, ifaces)
    assert route["source"] == "127.0.0.1" and "127.0.0.1" in ifaces[route["interface"]]["ipv4"]
    addrs, problem, _ = net_facts.resolve("localhost", 1)
    assert problem is None and addrs and all(net_facts.is_loopback(a) for a in addrs)
    addrs, problem, _ = net_facts.resolve("no-such-host.invalid", 1)
    assert addrs == [] and "unknown" in problem


def test_waiting_for_a_port_tells_refused_from_dropped_from_open():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    why = net_facts.wait_for_port("127.0.0.1", port, 0.6)  # closed: refused, retried to the deadline
    assert why.startswith(f"connection refused at 127.0.0.1:{port}") and 0.4 < time.monotonic() - start < 1.5
    with dropping_port() as port:
        start = time.monotonic()
        why = net_facts.wait_for_port("127.0.0.1", port, 1.0)
        took = time.monotonic() - start
    assert why.startswith(f"no answer from 127.0.0.1:{port}") and took < 2.0
    with socket.socket() as open_:
        open_.bind(("127.0.0.1", 0))
        open_.listen(8)
        assert net_facts.wait_for_port("127.0.0.1", open_.getsockname()[1], 1.0) is None


def test_several_addresses_in_another_order_are_the_same_place():
    facts, run = two_nodes(6)
    for r in (0, 1, 2):
        facts[r]["resolved"] = ["10.0.0.1", "10.1.0.1"]
    for r in (3, 4, 5):
        facts[r]["resolved"] = ["10.1.0.1", "10.0.0.1"]  # RFC 6724 order on another subnet
    assert "INIT003" not in codes(PROBE.diagnose(facts, run))


def test_a_host_name_on_loopback_is_only_a_note_for_nccl():
    facts, run = two_nodes()
    for r in facts:
        facts[r]["backend"] = "nccl"
    for r in (2, 3):
        facts[r]["hostname_resolves_to"] = ["127.0.1.1"]
    loop, = [f for f in PROBE.diagnose(facts, run) if f.code == "INIT002"]
    assert loop.severity.label == "info"


def test_a_resolver_that_never_answers_costs_its_deadline_not_the_stage(monkeypatch):
    def stuck(*_a, **_k):
        time.sleep(30)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    start = time.monotonic()
    addrs, problem, took = net_facts.resolve("head-node", 29500, deadline_s=0.3)
    assert addrs == [] and "no answer from the resolver within 0.3s" in problem["unknown"]
    assert time.monotonic() - start < 1.5


# -- INIT005: nodes that cannot open TCP connections to each other (measure/peer_reach.py) ------------

def test_a_dial_says_ok_refused_or_no_answer_as_the_socket_did():
    """Real sockets on loopback: a listener that never accepts still completes the handshake (the
    kernel's backlog), a closed port refuses, a full backlog drops the SYN as a firewall does."""
    from ddpdoctor.measure import peer_reach

    listener = peer_reach.listen()
    assert listener is not None
    with listener:
        assert peer_reach.dial("127.0.0.1", listener.getsockname()[1], 1.0) == peer_reach.OK
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert peer_reach.dial("127.0.0.1", closed, 1.0).startswith("Connection refused")
    with dropping_port() as port:
        began = time.monotonic()
        found = peer_reach.dial_all({"a": ("127.0.0.1", port), "b": ("127.0.0.1", closed)}, 0.5)
        assert time.monotonic() - began < 2.0  # in parallel, each within its timeout
    assert found["a"].startswith("timed out: no answer") and found["b"].startswith("Connection refused")
    assert peer_reach.is_loopback("127.0.1.1") and not peer_reach.is_loopback("10.0.0.2")


def _reach(facts: dict[int, dict[str, Any]], rank: int, source: str, to: dict[str, str]) -> None:
    facts[rank]["peer_reach"] = {"source": source, "to": {h: {"address": f"{h}:40001", "result": r}
                                                           for h, r in to.items()}}


def test_nodes_that_reach_the_store_but_not_each_other_are_named_first_above_the_init_that_hung():
    """A firewall that passes MASTER_PORT only: every rank arrived, node-b's first rank could not
    connect to node-a's. INIT005 names both nodes and leads the run's RUN004 of the init (causal order)."""
    from ddpdoctor.core.findings import Finding, Severity
    from ddpdoctor.judge import causal_order

    facts, run = two_nodes()
    for f in facts.values():
        f.pop("init_s", None)  # the init never ended
    _reach(facts, 0, "10.0.0.1", {"node-b": "timed out: no answer (a firewall drops the packets)"})
    _reach(facts, 2, "10.0.0.2", {"node-a": "timed out: no answer (a firewall drops the packets)"})
    found = PROBE.diagnose(facts, run)
    [init005] = [f for f in found if f.code == "INIT005"]
    assert init005.severity == Severity.CRITICAL and init005.ranks == (0, 1, 2, 3)
    assert init005.nodes == ("node-a", "node-b") and init005.evidence["failed_total"] == 2
    assert init005.title.startswith("2 of 2 connections between the nodes' first ranks failed, node-a to node-b "
                                    "first (timed out: no answer), though every rank reached the rendezvous store")
    assert "firewall-cmd" in init005.fix and "MASTER_PORT" in init005.why
    hung = Finding(code="RUN004", severity=Severity.CRITICAL, probe="run", title="Rank 0-3 hung in init",
                   ranks=(0, 1, 2, 3))
    ordered = causal_order.ordered([hung, init005])
    assert [f.code for f in ordered] == ["INIT005", "RUN004"] and ordered[1].explained_by == "INIT005"


def test_nodes_that_reach_each_other_and_a_single_node_give_no_init005():
    facts, run = two_nodes()
    _reach(facts, 0, "10.0.0.1", {"node-b": "ok"})
    _reach(facts, 2, "10.0.0.2", {"node-a": "ok"})
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]
    one = recorded_facts()  # one node: nothing was dialled, nothing is said
    assert "INIT005" not in codes(PROBE.diagnose(one, RunView(world_size=2, hosts={0: "vm", 1: "vm"})))


# -- INIT006: a *_SOCKET_IFNAME whose interface the other nodes cannot reach ------------------------------

def _bridge(facts: dict[int, dict[str, Any]], var: str, name: str, addr_of: dict[str, str]) -> None:
    """Each rank's host gets interface `name` at its address in addr_of, and `var` set to it, as
    measure.net.ifname_facts reads it (a container bridge: docker0 with 172.17.0.1 on every host)."""
    for f in facts.values():
        f["interfaces"][name] = {"up": True, "ipv4": [addr_of[f["hostname"]]], "ipv6": [], "speed_mbps": 0}
        f["socket_ifname"][var] = {"value": name, "selects": [name],
                                   **({"missing": []} if var.startswith("GLOO") else {})}


def test_docker0_on_every_node_is_named_first_above_the_init_it_hangs():
    """docker0 has 172.17.0.1 on every Docker host: GLOO_SOCKET_IFNAME=docker0 makes each rank bind there, and
    a peer that connects to it reaches its own node. Named from the facts alone, before any dial; it leads
    the init that hung (RUN004) in the causal order. Where gloo's init finished all the same, a warning."""
    from ddpdoctor.core.findings import Finding, Severity
    from ddpdoctor.judge import causal_order

    facts, run = two_nodes()
    _bridge(facts, "GLOO_SOCKET_IFNAME", "docker0", {"node-a": "172.17.0.1", "node-b": "172.17.0.1"})
    assert [f.severity for f in PROBE.diagnose(facts, run) if f.code == "INIT006"] == [Severity.WARN]
    for f in facts.values():
        f.pop("init_s", None)
    found = PROBE.diagnose(facts, run)
    [init006] = [f for f in found if f.code == "INIT006"]
    assert init006.severity == Severity.CRITICAL and init006.ranks == (0, 1, 2, 3)
    assert init006.nodes == ("node-a", "node-b")
    assert init006.title.startswith("GLOO_SOCKET_IFNAME=docker0 selects docker0 (172.17.0.1) on 2 nodes, the same "
                                    "address on each")
    assert init006.evidence["same_address_on_nodes"] == {"172.17.0.1": ["node-a", "node-b"]}
    assert init006.evidence["route_to_master"] == ["eth0"] and "(eth0: the route to MASTER_ADDR" in init006.fix
    hung = Finding(code="RUN004", severity=Severity.CRITICAL, probe="run", title="Rank 0-3 hung in init",
                   ranks=(0, 1, 2, 3))
    ordered = causal_order.ordered([hung, init006])
    assert [f.code for f in ordered] == ["INIT006", "RUN004"] and ordered[1].explained_by == "INIT006"
    assert causal_order.verdict_line(ordered).startswith("INIT006 (ranks 0-3): GLOO_SOCKET_IFNAME=docker0")


def test_lo_for_the_other_backend_warns_and_explains_none_of_this_runs_failures():
    """NCCL_SOCKET_IFNAME=lo across nodes, in a check on gloo whose init hung for another reason: a warning for
    a job on NCCL, which is no cause of this run's hang (the hang leads, INIT006 stands apart)."""
    from ddpdoctor.core.findings import Finding, Severity
    from ddpdoctor.judge import causal_order

    facts, run = two_nodes()
    for f in facts.values():
        f.pop("init_s", None)
        f["interfaces"]["lo"] = {"up": True, "ipv4": ["127.0.0.1"], "ipv6": [], "speed_mbps": 0}
        f["socket_ifname"]["NCCL_SOCKET_IFNAME"] = {"value": "lo", "selects": ["lo"]}
    [init006] = [f for f in PROBE.diagnose(facts, run) if f.code == "INIT006"]
    assert init006.severity == Severity.WARN and init006.evidence["backend_of_this_run"] == ["gloo"]
    assert init006.evidence["same_address_on_nodes"] == {"127.0.0.1": ["node-a", "node-b"]}
    assert "This check ran on gloo, which does not read it." in init006.why
    hung = Finding(code="RUN004", severity=Severity.CRITICAL, probe="run", title="Rank 0-3 hung in init",
                   ranks=(0, 1, 2, 3))
    ordered = causal_order.ordered([init006, hung])
    assert [f.code for f in ordered] == ["RUN004", "INIT006"] and not ordered[0].explained_by


def test_host_names_that_share_one_network_stack_are_one_node_for_the_same_address_rule():
    """Two host names on one machine's network (containers with --network host: one docker0, one route
    address): the same docker0 address is one interface, not two. And an NCCL prefix that selects two
    interfaces is not judged (NCCL takes the first in the kernel's order, which the facts do not keep)."""
    facts, run = two_nodes()
    for f in facts.values():
        f["route"]["source"] = "10.0.0.1"
    _bridge(facts, "GLOO_SOCKET_IFNAME", "docker0", {"node-a": "172.17.0.1", "node-b": "172.17.0.1"})
    assert "INIT006" not in codes(PROBE.diagnose(facts, run))
    facts, run = two_nodes()
    _bridge(facts, "NCCL_SOCKET_IFNAME", "docker0", {"node-a": "172.17.0.1", "node-b": "172.17.0.1"})
    for f in facts.values():
        f["socket_ifname"]["NCCL_SOCKET_IFNAME"] = {"value": "^lo", "selects": ["docker0", "eth0"]}
    assert "INIT006" not in codes(PROBE.diagnose(facts, run))
    facts[0]["socket_ifname"]["NCCL_SOCKET_IFNAME"]["selects"] = ["docker0"]  # the same, one interface each
    facts[2]["socket_ifname"]["NCCL_SOCKET_IFNAME"]["selects"] = ["docker0"]
    assert "INIT006" in codes(PROBE.diagnose(facts, run))


def test_an_interface_the_other_node_cannot_dial_is_named_with_the_dial_and_a_firewall_is_not():
    """Each node's docker0 on its own subnet (172.17.0.1, 172.18.0.1): no address is shared, but the dials of
    the other node's docker0 address failed while the route's own dials got through (no INIT005). Where the
    route's dials failed too, the cause is a firewall between the nodes: INIT005 alone."""
    facts, run = two_nodes()
    _bridge(facts, "GLOO_SOCKET_IFNAME", "docker0", {"node-a": "172.17.0.1", "node-b": "172.18.0.1"})
    for f in facts.values():
        f.pop("init_s", None)
    unreachable = "Network is unreachable (no route to that address)"

    def dials(route: str, over: str) -> None:
        _reach(facts, 0, "10.0.0.1", {"node-b": route})
        _reach(facts, 2, "10.0.0.2", {"node-a": route})
        for rank, to, addr in ((0, "node-b", "172.18.0.1"), (2, "node-a", "172.17.0.1")):
            facts[rank]["peer_reach"]["over_ifname"] = [{"to": to, "variable": "GLOO_SOCKET_IFNAME",
                                                         "interface": "docker0", "address": f"{addr}:40001",
                                                         "result": over}]

    dials("ok", unreachable)
    found = PROBE.diagnose(facts, run)
    assert "INIT005" not in codes(found)
    [init006] = [f for f in found if f.code == "INIT006"]
    assert init006.title == ("GLOO_SOCKET_IFNAME=docker0: node-a cannot connect to node-b's docker0 address "
                             "172.18.0.1:40001 (Network is unreachable), which the backend would connect to, though "
                             "the rendezvous store was reached")
    assert [d["from"] for d in init006.evidence["failed"]] == ["node-a", "node-b"]
    assert "same_address_on_nodes" not in init006.evidence
    dials("timed out: no answer (a firewall drops the packets)", "timed out: no answer (a firewall drops the packets)")
    assert [c for c in codes(PROBE.diagnose(facts, run)) if c.startswith("INIT")] == ["INIT005"]


def test_an_ifname_on_the_interface_between_the_nodes_gives_no_init006():
    """The right setting: GLOO_SOCKET_IFNAME=eth0, the route's interface, each node its own address; and
    another interface whose dials got through (ib0 on its own subnet). Nothing said, INIT000."""
    facts, run = two_nodes()
    for f in facts.values():
        f["socket_ifname"]["GLOO_SOCKET_IFNAME"] = {"value": "eth0", "selects": ["eth0"], "missing": []}
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]
    facts, run = two_nodes()
    _bridge(facts, "NCCL_SOCKET_IFNAME", "ib0", {"node-a": "192.168.7.1", "node-b": "192.168.7.2"})
    _reach(facts, 0, "10.0.0.1", {"node-b": "ok"})
    facts[0]["peer_reach"]["over_ifname"] = [{"to": "node-b", "variable": "NCCL_SOCKET_IFNAME", "interface": "ib0",
                                              "address": "192.168.7.2:40001", "result": "ok"}]
    assert codes(PROBE.diagnose(facts, run)) == ["INIT000"]


def test_a_node_publishes_dials_and_records_the_address_its_ifname_selects(monkeypatch):
    """The session's side, on real hellos: the first rank publishes its IFNAME address beside its route's (not
    a loopback one, not the route's own again), a peer dials it unless it has that address itself, and the
    dials land in the facts, each where the judge reads it (`to` for the route's, `over_ifname` for the other)."""
    from types import SimpleNamespace

    from ddpdoctor.core import keys
    from ddpdoctor.measure import peer_reach
    from ddpdoctor.measure.peer_reach import ReachFrom
    from ddpdoctor.probes.init_hang import InitHangFacts, reach_from
    from ddpdoctor.session import rank as session

    facts, _ = two_nodes()
    _bridge(facts, "GLOO_SOCKET_IFNAME", "docker0", {"node-a": "172.17.0.1", "node-b": "172.18.0.1"})
    facts[0]["interfaces"]["lo"] = {"up": True, "ipv4": ["127.0.0.1"], "ipv6": [], "speed_mbps": 0}
    facts[0]["socket_ifname"]["NCCL_SOCKET_IFNAME"] = {"value": "lo", "selects": ["lo"]}
    reach = reach_from(InitHangFacts.from_json(facts[0]))
    assert (reach.source, reach.ifnames) == ("10.0.0.1", {"GLOO_SOCKET_IFNAME": ("docker0", "172.17.0.1"),
                                                          "NCCL_SOCKET_IFNAME": ("lo", "127.0.0.1")})
    assert {"10.0.0.1", "172.17.0.1", "127.0.0.1"} <= reach.own

    class Store(dict):
        def get(self, key, default=None):  # the channel's get
            return super().get(key, default)

        def set(self, key, value):
            self[key] = value

    def ctx(rank: int, reach: ReachFrom) -> Any:
        store = Store({keys.result("init-hang", rank): facts[rank]})
        return SimpleNamespace(env=SimpleNamespace(local_rank=0), rank=rank, cfg=SimpleNamespace(probes=("init-hang",)),
                               shared=SimpleNamespace(reach=reach, reach_listener=None), channel=store)

    a = ctx(0, reach)
    hello_a = session._reach_endpoint(a)
    try:
        assert hello_a["reach_ifname"] == {"GLOO_SOCKET_IFNAME": ["docker0", "172.17.0.1"]}  # lo is never published
        port = hello_a["reach"][1]
        b = ctx(2, reach_from(InitHangFacts.from_json(facts[2])))
        hellos = {0: {"host": "node-a", **hello_a}, 2: {"host": "node-b", "reach": ["10.0.0.2", 40001]}}
        targets = session._reach_targets(b, hellos)
        assert targets == {"node-a": ("10.0.0.1", port), "node-a over GLOO_SOCKET_IFNAME": ("172.17.0.1", port)}
        monkeypatch.setattr(peer_reach, "dial_all", lambda t: {"node-a": "ok", "node-a over GLOO_SOCKET_IFNAME":
                                                               "Network is unreachable (no route to that address)"})
        session._dial_other_nodes(b, targets, hellos)
        recorded = b.channel[keys.result("init-hang", 2)]["peer_reach"]
        assert recorded["to"] == {"node-a": {"address": f"10.0.0.1:{port}", "result": "ok"}}
        assert recorded["over_ifname"] == [{"to": "node-a", "variable": "GLOO_SOCKET_IFNAME", "interface": "docker0",
                                            "address": f"172.17.0.1:{port}",
                                            "result": "Network is unreachable (no route to that address)"}]
        facts[2]["interfaces"]["docker0"]["ipv4"] = ["172.17.0.1"]  # node-b has the same address: not dialled
        b.shared.reach = reach_from(InitHangFacts.from_json(facts[2]))
        assert "172.17.0.1" in b.shared.reach.own
        assert session._reach_targets(b, hellos) == {"node-a": ("10.0.0.1", port)}
    finally:
        a.shared.reach_listener.close()
