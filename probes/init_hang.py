"""Probe `init-hang`: how each rank reached the rendezvous and process-group init.

Its facts are published twice: once as soon as a rank reaches the store, before it
waits for anyone (so a rank that then hangs, or a group init that fails, still leaves
the address it tried, its route and its `*_SOCKET_IFNAME` reading in the report), and
again after init with the time each step took. The ranks that never reached the store
at all are the run's own finding (RUN001), which names the cause from their output.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, TypeVar, Union

from ddpdoctor.core import codes, keys
from ddpdoctor.core.facts import Facts, facts_by_rank, nested, nested_list, nested_map
from ddpdoctor.measure import net as net_facts
from ddpdoctor.measure.peer_reach import OK as DIAL_OK, ReachFrom
from ddpdoctor.core.findings import Finding, Severity, rank_ranges

from ddpdoctor.probes.base import RunView

if TYPE_CHECKING:
    from ddpdoctor.runtime.context import RankContext
    from ddpdoctor.runtime.launch_env import LaunchEnv

NAME = "init-hang"
# A rank this much later than the first is worth a word: every other rank sat idle that long,
# and a launcher with a shorter rendezvous timeout (torchrun's --rdzv-timeout) would have failed.
LATE_ARRIVAL_S = 10.0

# A reading that failed: {"unknown": reason} (measure.net writes the resolver's words there).
Unknown = dict[str, Any]
F = TypeVar("F", bound=Facts)


@dataclass
class Route(Facts):
    """measure.net.route_to: the local address and interface the kernel sends to MASTER_ADDR from."""

    source: Optional[str] = None
    interface: Optional[str] = None


@dataclass
class Interface(Facts):
    """One network interface of measure.net.interfaces."""

    up: Optional[bool] = None  # None where psutil has no stats for it
    ipv4: list[str] = field(default_factory=list)
    ipv6: list[str] = field(default_factory=list)
    speed_mbps: Optional[int] = None

    @property
    def usable(self) -> bool:
        """Up (or not known to be down) with an address: what an IFNAME may select."""
        return self.up is not False and bool(self.ipv4 or self.ipv6)


@dataclass
class IfnameReading(Facts):
    """One *_SOCKET_IFNAME (measure.net.ifname_facts): its value, what it selects, and for gloo
    the listed names this host lacks."""

    value: Optional[str] = None
    selects: list[str] = field(default_factory=list)
    missing: Optional[list[str]] = None  # gloo's variable only

    OMIT_NONE = frozenset({"missing"})


@dataclass
class Dial(Facts):
    """One TCP connection a node's first rank tried to another node's (measure/peer_reach.py)."""

    address: Optional[str] = None  # host:port dialled
    result: Optional[str] = None  # "ok", or why not in the socket's words ("timed out: ...", "No route to host ...")


@dataclass
class IfnameDial(Facts):
    """One dial of another node's address on the interface a *_SOCKET_IFNAME selects there, where that
    address is not its route's (session/rank.py's _reach_targets): what the backend will connect to."""

    to: Optional[str] = None  # the other node's host name
    variable: Optional[str] = None  # GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME
    interface: Optional[str] = None  # the interface it selects on that node
    address: Optional[str] = None  # host:port dialled
    result: Optional[str] = None  # "ok", or why not (peer_reach.describe)


@dataclass
class PeerReach(Facts):
    """What a node's first rank found dialling the other nodes' first ranks before init."""

    source: Optional[str] = None  # the address its route to MASTER_ADDR leaves from
    to: dict[str, Dial] = field(default_factory=dict, metadata=nested_map(Dial))  # by the other node's host name
    over_ifname: list[IfnameDial] = field(default_factory=list, metadata=nested_list(IfnameDial))


@dataclass
class InitHangFacts(Facts):
    """One rank's way to the rendezvous: published by before_rendezvous, then completed by collect
    with the time the rendezvous and the group init took (absent where they did not end) and the backend."""

    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    resolved: Union[list[str], Unknown] = field(default_factory=list)  # MASTER_ADDR's addresses here
    resolve_s: Optional[float] = None
    route: Route = field(default_factory=Route, metadata=nested(Route))  # {"unknown": why} reads as empty
    # Interface name -> reading; {"unknown": why} where psutil failed (read back, it is the one name
    # "unknown": see usable_interfaces).
    interfaces: Union[dict[str, Interface], Unknown] = field(default_factory=dict, metadata=nested_map(Interface))
    socket_ifname: dict[str, IfnameReading] = field(default_factory=dict, metadata=nested_map(IfnameReading))
    hostname: Optional[str] = None
    hostname_resolves_to: Union[list[str], Unknown] = field(default_factory=list)
    connect_s: Optional[float] = None
    arrived_t: Optional[float] = None
    start_to_arrival_s: Optional[float] = None
    rendezvous_s: Optional[float] = None
    init_s: Optional[float] = None
    backend: Optional[str] = None
    # A node's first rank in a job of several nodes: the other nodes it could, or could not, connect to.
    peer_reach: Optional[PeerReach] = field(default=None, metadata=nested(PeerReach))

    OMIT_NONE = frozenset({"rendezvous_s", "init_s", "backend", "peer_reach"})

    @property
    def known_interfaces(self) -> dict[str, Interface]:
        """The interfaces, or none where psutil could not list them."""
        return self.interfaces if "unknown" not in self.interfaces else {}


def ifname_address(facts: InitHangFacts, var: str) -> Optional[tuple[str, str]]:
    """The interface a *_SOCKET_IFNAME makes the backend bind to on this host, and its IPv4 address: what
    the backend tells its peers to connect to. Gloo: the first name the value lists (a device per name, in
    that order). NCCL: only a value that selects exactly one interface, since it takes the first match in
    the kernel's order, which the facts do not keep (`^docker0,lo` on a host with eth0 and a compose
    network's br-... selects two: not judged). IPv4 only: the dials listen on IPv4, and an IPv6 link-local
    address is every node's own. None where there is no such interface and address."""
    reading = facts.socket_ifname.get(var)
    if reading is None or not reading.selects:
        return None
    if var.startswith("GLOO"):
        listed = [n.strip() for n in str(reading.value or "").split(",") if n.strip()]
        name = next((n for n in listed if n in reading.selects), None)
    else:
        name = reading.selects[0] if len(reading.selects) == 1 else None
    iface = facts.known_interfaces.get(name) if name else None
    if iface is None or not iface.ipv4:
        return None
    return str(name), iface.ipv4[0]


def reach_from(facts: InitHangFacts) -> ReachFrom:
    """Where the other nodes may dial this rank's node: its route's address, and each *_SOCKET_IFNAME's; and
    its own addresses."""
    found = {var: ifname_address(facts, var) for var in facts.socket_ifname}
    return ReachFrom(source=facts.route.source, ifnames={v: a for v, a in found.items() if a is not None},
                     own=frozenset(a for i in facts.known_interfaces.values() for a in i.ipv4))


def before_rendezvous(env: LaunchEnv, lookup: net_facts.Resolution, connect_s: float, started: float) -> dict[str, Any]:
    """Read as soon as the store answered: what this rank used to get there, and what it would use next.

    `lookup` is the resolution of MASTER_ADDR the rank connected with, not a second one."""
    addrs, problem, resolve_s = lookup
    interfaces: Union[dict[str, Interface], Unknown]
    try:
        ifaces = net_facts.interfaces()
    except Exception as exc:  # psutil on an exotic platform
        ifaces, interfaces = {}, {"unknown": f"{type(exc).__name__}: {exc}"}
    else:
        interfaces = _as_map(Interface, ifaces)
    hostname = socket.gethostname()
    own, own_problem = net_facts.hostname_addresses(hostname)
    route = net_facts.route_to(addrs[0], env.master_port, ifaces) if addrs else {"unknown": "not resolved"}
    return InitHangFacts(
        master_addr=env.master_addr,
        master_port=env.master_port,
        resolved=addrs if problem is None else problem,
        resolve_s=round(resolve_s, 4),
        route=Route.from_json(route),
        interfaces=interfaces,
        socket_ifname=_as_map(IfnameReading, net_facts.ifname_facts(dict(os.environ), ifaces)),
        hostname=hostname,
        hostname_resolves_to=own if own_problem is None else own_problem,
        connect_s=round(connect_s, 4),
        arrived_t=time.time(),
        start_to_arrival_s=round(time.time() - started, 3),
    ).to_json()


def _as_map(kind: type[F], readings: Mapping[str, Any]) -> dict[str, F]:
    """Fresh readings (interfaces, IFNAME variables) typed, each written back exactly as read."""
    return {name: kind.from_json(reading) for name, reading in readings.items()}


class InitHang:
    name = NAME
    trains = False
    summary = ("How each rank reached the rendezvous and init: the address it resolved, its route and "
               "interfaces, *_SOCKET_IFNAME, arrival times; names the ranks that never arrived and why.")
    facts_type = InitHangFacts

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, Any]:
        facts = InitHangFacts.from_json(ctx.channel.get(keys.result(NAME, ctx.rank)))
        for stage in ctx.state.timeline:
            if stage.name in ("rendezvous", "init") and stage.ended:
                setattr(facts, f"{stage.name}_s", round(stage.ended - stage.started, 4))
        facts.backend = ctx.backend
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
        facts = facts_by_rank(InitHangFacts, facts)
        findings = _bad_ifname(facts, run) + _hostname_on_loopback(facts, run) + _split_resolution(facts, run)
        findings += _nodes_unreachable(facts, run) + _ifname_unreachable(facts, run)
        findings += _late_arrivals(facts, run)
        # Fewer facts than ranks, or an init that did not finish everywhere: the run's own
        # findings (RUN001, RUN004, ...) say what happened; "ok" would contradict them.
        initialised = all(isinstance(f.init_s, (int, float)) for f in facts.values())
        if not any(f.severity >= Severity.WARN for f in findings) and len(facts) == run.world_size and initialised:
            findings.append(_healthy(facts, run))
        return findings


def _addresses(reading: Union[list[str], Unknown]) -> list[str]:
    """The addresses of a lookup; none where it failed (a fresh reading holds its {"unknown": why})."""
    return reading if isinstance(reading, list) else []


def _hosts(facts: Mapping[int, InitHangFacts], run: RunView) -> dict[int, str]:
    return {r: run.hosts.get(r) or str(f.hostname or "?") for r, f in facts.items()}


def _init_finished(facts: Mapping[int, InitHangFacts], run: RunView) -> bool:
    """Every rank of the run initialised its process group (INIT005 and INIT006 soften to a warning then)."""
    return all(isinstance(f.init_s, (int, float)) for f in facts.values()) and len(facts) == run.world_size


def _backend_reading(var: str, facts: Iterable[InitHangFacts]) -> tuple[str, list[str], bool]:
    """The backend a *_SOCKET_IFNAME is for, the backends these ranks ran, and whether one of them reads it
    (or a rank never said which backend: then it may)."""
    wanted = "nccl" if var.startswith("NCCL") else "gloo"
    used = sorted({str(f.backend or "") for f in facts})
    return wanted, used, wanted in used or "" in used


def _bad_ifname(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """A *_SOCKET_IFNAME that selects no live interface: the group init fails on that host."""
    hosts = _hosts(facts, run)
    by_var: dict[tuple[str, str], list[int]] = {}
    missing: dict[tuple[str, str], set[str]] = {}
    for r, f in facts.items():
        for var, reading in f.socket_ifname.items():
            if reading.value is None:
                continue  # not a reading collect writes (it always has the variable's value)
            if not reading.selects or reading.missing:
                key = (var, str(reading.value))
                by_var.setdefault(key, []).append(r)
                missing.setdefault(key, set()).update(reading.missing or [])
    out = []
    for (var, value), ranks in sorted(by_var.items()):
        ranks.sort()
        wanted, used, read = _backend_reading(var, (facts[r] for r in ranks))
        # Critical when this run's backend reads it (or init never said which backend); otherwise
        # the check itself was fine, but a job with that backend on this host would not be.
        severity = Severity.CRITICAL if read else Severity.WARN
        available = sorted({n for r in ranks for n, i in facts[r].known_interfaces.items() if i.usable})
        routes = sorted({str(facts[r].route.interface) for r in ranks if facts[r].route.interface})
        absent = sorted(missing[(var, value)])
        message = ("NCCL WARN Bootstrap : no socket interface found" if var.startswith("NCCL")
                   else f"Unable to find address for: {absent[0] if absent else value}")
        out.append(codes.finding(
            "INIT001", NAME, f"{var}={value} selects no usable interface on rank {rank_ranges(ranks)}",
            severity=severity, ranks=tuple(ranks), nodes=tuple(sorted({hosts[r] for r in ranks})),
            evidence={"variable": var, "value": value, "interfaces_up": available,
                      "route_to_master": routes, "expected_error": message,
                      **({"not_on_this_host": absent} if absent else {}),
                      **({"backend_of_this_run": used} if severity == Severity.WARN else {})},
            why=(f"{var} names the interface(s) the {wanted} backend may use; "
                 + (f"{', '.join(absent)} is not up with an address on this host (gloo needs every name it is given)"
                    if absent and var.startswith("GLOO") else
                    f"none that is up and has an address matches '{value}' on this host")
                 + f", so a {wanted} process group fails to initialise with \"{message}\" (a name from another "
                   "machine, or a typo)."
                 + ("" if severity == Severity.CRITICAL else
                    f" This check ran on {', '.join(used)}, which does not read it.")),
            fix=(f"Set {var} to an interface this host has (here: {', '.join(available) or 'none up'}"
                 + (f"; the route to MASTER_ADDR leaves through {', '.join(routes)}" if routes else "")
                 + "), or unset it. Check with `ip -br addr` on that host.")))
    return out


def _hostname_on_loopback(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """The Debian/Ubuntu `127.0.1.1 myhost` line: gloo binds to loopback, other nodes cannot connect."""
    hosts = _hosts(facts, run)
    if len(set(hosts.values())) < 2:
        return []  # one host: loopback is exactly right
    ranks = sorted(r for r, f in facts.items()
                   if _addresses(f.hostname_resolves_to)
                   and all(net_facts.is_loopback(a) for a in _addresses(f.hostname_resolves_to))
                   and "GLOO_SOCKET_IFNAME" not in f.socket_ifname)
    if not ranks:
        return []
    gloo = any(facts[r].backend == "gloo" for r in ranks)
    names = sorted({f"{facts[r].hostname} -> {', '.join(_addresses(facts[r].hostname_resolves_to))}" for r in ranks})
    return [codes.finding(
        "INIT002", NAME,
        f"The host name of {', '.join(sorted({hosts[r] for r in ranks}))} resolves to loopback in a multi-node job",
        # NCCL picks its interface by other rules; only gloo (and code using it in the same job) binds there.
        severity=Severity.CRITICAL if gloo else Severity.INFO, ranks=tuple(ranks),
        nodes=tuple(sorted({hosts[r] for r in ranks})),
        evidence={"hostname_resolves_to": names, "hosts_in_job": len(set(hosts.values()))})]


def _split_resolution(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """Ranks that resolve MASTER_ADDR differently meet at different stores, or not at all."""
    hosts = _hosts(facts, run)
    # Ranks whose answers share an address agree (several A records come back in another order on
    # another subnet, or round robin); a loopback answer on the store's own host is that host too.
    clusters: list[tuple[set[str], list[int]]] = []
    for r, f in sorted(facts.items()):
        resolved = _addresses(f.resolved)
        if not resolved or all(net_facts.is_loopback(a) for a in resolved):
            continue
        addrs = set(map(str, resolved))
        joined = [c for c in clusters if c[0] & addrs]
        merged = (addrs.union(*(c[0] for c in joined)), sorted([r, *(x for c in joined for x in c[1])]))
        clusters = [c for c in clusters if c not in joined] + [merged]
    if len(clusters) < 2:
        return []
    public = {", ".join(sorted(a)): ranks for a, ranks in clusters}
    ordered = sorted(public.items(), key=lambda kv: -len(kv[1]))  # the majority first
    groups = {k: rank_ranges(sorted(v)) for k, v in ordered}
    odd = sorted(r for _, v in ordered[1:] for r in v)
    addr = next(iter(facts.values())).master_addr
    return [codes.finding(
        "INIT003", NAME, f"MASTER_ADDR={addr} resolves to different addresses on different ranks", ranks=tuple(odd),
        nodes=tuple(sorted({hosts[r] for r in odd})), evidence={"resolved_by_ranks": groups})]


def _nodes_unreachable(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """INIT005: nodes whose first ranks could not open a TCP connection to another node's, tried
    after every rank had reached the store (measure/peer_reach.py): the store's port gets through,
    the ports gloo and NCCL open between ranks do not."""
    hosts = _hosts(facts, run)
    failed: list[tuple[str, str, str, str]] = []  # from host, to host, address, result
    tried = 0
    for r, f in sorted(facts.items()):
        if f.peer_reach is None:
            continue
        for host, dial in sorted(f.peer_reach.to.items()):
            tried += 1
            if dial.result and dial.result != "ok":
                failed.append((hosts[r], host, str(dial.address), dial.result))
    if not failed:
        return []
    involved = {h for a, b, _, _ in failed for h in (a, b)}
    ranks = sorted(r for r, h in hosts.items() if h in involved)
    reasons = sorted({res for _, _, _, res in failed})
    short = reasons[0].split(" (")[0]
    first = next(iter(facts.values()))
    store = f"{first.master_addr}:{first.master_port}"
    a, b, _, _ = failed[0]
    what = (f"{a} cannot open a TCP connection to {b}" if len(failed) == 1 else
            f"{len(failed)} of {tried} connections between the nodes' first ranks failed, {a} to {b} first")
    # Init finished everywhere: gloo's connections (or NCCL's bootstrap) found a way, another interface
    # perhaps (*_SOCKET_IFNAME); NCCL's own connections come at its first collective, which may still fail.
    initialised = _init_finished(facts, run)
    return [codes.finding(
        "INIT005", NAME, f"{what} ({short}), though every rank reached the rendezvous store at {store}",
        severity=Severity.WARN if initialised else Severity.CRITICAL, ranks=tuple(ranks), nodes=tuple(sorted(involved)),
        evidence={"failed": [{"from": x, "to": y, "address": addr, "result": res} for x, y, addr, res in failed[:32]],
                  "failed_total": len(failed), "tried": tried, "store": store, "results": reasons,
                  "init_finished": initialised})]


def _ifname_unreachable(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """INIT006: in a job across nodes, a *_SOCKET_IFNAME that selects an interface the other nodes cannot
    reach. The backend binds there and tells its peers to connect to that address, so the rendezvous
    works (the store is reached by the route) and the process group's init or first collective hangs.
    Two ways to know, before it does: the same address on several nodes (docker0's 172.17.0.1, lo's
    127.0.0.1: each node's own, so a peer that dials it reaches itself), and the dials of each node's
    address on that interface (_reach_targets) that failed where the route's own dial between the same
    two nodes got through (where both failed, a firewall is the cause: INIT005's)."""
    hosts = _hosts(facts, run)
    if len(set(hosts.values())) < 2:
        return []  # one node: any interface of its own reaches its own ranks, lo included
    blocked = {(hosts[r], to) for r, f in facts.items() if f.peer_reach is not None
               for to, d in f.peer_reach.to.items() if d.result and d.result != DIAL_OK}
    out = []
    for var in sorted({v for f in facts.values() for v in f.socket_ifname}):
        chosen: dict[str, tuple[str, str]] = {}  # host -> (interface, address), from its first rank that says
        stack: dict[str, str] = {}  # host -> its route's address: two host names on one network stack are one
        for r, f in sorted(facts.items()):
            picked = ifname_address(f, var)
            if picked is not None and hosts[r] not in chosen:
                chosen[hosts[r]] = picked
                stack[hosts[r]] = str(f.route.source or hosts[r])
        by_address: dict[str, list[str]] = {}
        for host, (_, addr) in chosen.items():
            by_address.setdefault(addr, []).append(host)
        # The same address on hosts with one route's address (containers sharing the host's network) is one
        # interface, not two: only distinct network stacks count.
        shared = {a: sorted(h) for a, h in by_address.items() if len({stack[x] for x in h}) > 1}
        failed = [(hosts[r], d) for r, f in sorted(facts.items()) if f.peer_reach is not None
                  for d in f.peer_reach.over_ifname
                  if d.variable == var and d.result and d.result != DIAL_OK and (hosts[r], d.to) not in blocked]
        if not shared and not failed:
            continue
        involved = sorted({h for hs in shared.values() for h in hs} | {h for h, _ in failed}
                          | {str(d.to) for _, d in failed if d.to})
        ranks = sorted(r for r, h in hosts.items() if h in involved)
        value = next(str(facts[r].socket_ifname[var].value) for r in ranks if var in facts[r].socket_ifname)
        wanted, used, read = _backend_reading(var, facts.values())
        # gloo connects every pair in its init: an init that finished everywhere found a way this time (a
        # warning: a job that connects over it may not). NCCL's init is lazy, its connections come at the
        # first collective, so its init finishing says nothing. Not read by this run's backend: a warning
        # for a job on the other one, which explains none of this run's failures (causal_order).
        initialised = _init_finished(facts, run)
        severity = Severity.CRITICAL if read and not (initialised and wanted == "gloo") else Severity.WARN
        routes = sorted({str(f.route.interface) for r, f in facts.items() if hosts[r] in involved and f.route.interface})
        if shared:
            addr, on = max(shared.items(), key=lambda kv: len(kv[1]))
            iface = chosen[on[0]][0]
            title = (f"{var}={value} selects {iface} ({addr}) on {len(on)} nodes, the same address on each: "
                     "a peer that connects to it reaches its own node, not the rank that bound it")
        else:
            src, d = failed[0]
            short = str(d.result).split(" (")[0]
            title = (f"{var}={value}: {src} cannot connect to {d.to}'s {d.interface} address {d.address} ({short}), "
                     "which the backend would connect to, though the rendezvous store was reached")
        evidence: dict[str, Any] = {
            "variable": var, "value": value,
            "selected_by_node": {h: f"{i} {a}" for h, (i, a) in sorted(chosen.items())},
            "route_to_master": routes}
        if shared:
            evidence["same_address_on_nodes"] = shared
        if failed:
            evidence["failed"] = [{"from": h, "to": d.to, "interface": d.interface, "address": d.address,
                                   "result": d.result} for h, d in failed[:32]]
        if not read:
            evidence["backend_of_this_run"] = used
        evidence["init_finished"] = initialised
        out.append(codes.finding(
            "INIT006", NAME, title, severity=severity, ranks=tuple(ranks), nodes=tuple(involved), evidence=evidence,
            why=(f"{var} tells the {wanted} backend which interface to bind to; it then asks every peer to connect "
                 "to that interface's address. The rendezvous store is reached by the route to MASTER_ADDR, so "
                 "every rank arrives; then the process group's init or its first collective waits for connections "
                 "that never arrive, until its timeout, on every rank"
                 + (" (an address every node has, like docker0's 172.17.0.1 or lo's 127.0.0.1, is each node's "
                    "own: the peer connects to itself and gets \"Connection refused\")" if shared else "")
                 + "." + ("" if read else f" This check ran on {', '.join(used)}, which does not read it.")),
            fix=(f"Set {var} to the interface that connects the nodes"
                 + (f" ({', '.join(routes)}: the route to MASTER_ADDR leaves through it)" if routes else "")
                 + ", the same name on every node, or unset it; never lo or a container bridge (docker0, virbr0, "
                   "cni0) in a job across nodes. `ip -br addr` on each node lists the interfaces.")))
    return out


def arrival_gaps(facts: Mapping[int, InitHangFacts]) -> dict[int, float]:
    """Seconds each rank arrived after the first, from how long each waited in the rendezvous.

    Each rank times its own wait on its own clock, and the wait ends for everyone when the
    last hello lands: the first rank waited longest, a late one hardly at all. Wall clocks of
    different hosts are never compared, so a skewed clock is no late rank.
    """
    waits = {r: float(f.rendezvous_s) for r, f in facts.items() if isinstance(f.rendezvous_s, (int, float))}
    if len(waits) < 2:
        return {}
    longest = max(waits.values())
    return {r: longest - w for r, w in waits.items()}


def _late_arrivals(facts: Mapping[int, InitHangFacts], run: RunView) -> list[Finding]:
    """INIT004: ranks that reached the rendezvous LATE_ARRIVAL_S or more after the first."""
    gaps = arrival_gaps(facts)
    limit = LATE_ARRIVAL_S
    late = sorted(r for r, g in gaps.items() if g >= limit)
    if not late:
        return []
    hosts = _hosts(facts, run)
    return [codes.finding(
        "INIT004", NAME,
        f"Rank {rank_ranges(late)} reached the rendezvous {max(gaps[r] for r in late):.1f} s after the first rank",
        ranks=tuple(late), nodes=tuple(sorted({hosts[r] for r in late})),
        evidence={"arrival_after_first_s": {str(r): round(g, 2) for r, g in sorted(gaps.items())},
                  "start_to_arrival_s": {str(r): facts[r].start_to_arrival_s for r in late},
                  "threshold_s": limit})]


def _healthy(facts: Mapping[int, InitHangFacts], run: RunView) -> Finding:
    """INIT000: every rank met and initialised; says where they met, through what, and how fast."""
    spread = max(arrival_gaps(facts).values(), default=0.0)
    hosts = _hosts(facts, run)
    routes = sorted({f"{hosts[r]}: {f.route.interface}" for r, f in facts.items() if f.route.interface})
    inits = [float(f.init_s) for f in facts.values() if isinstance(f.init_s, (int, float))]
    first = next(iter(facts.values()))
    resolved = _addresses(first.resolved)
    return codes.finding(
        "INIT000", NAME,
        (f"{len(facts)} of {run.world_size} ranks reached the rendezvous within {spread:.1f} s"
         + (f"; init took up to {max(inits):.2f} s" if inits else "")),
        ranks=tuple(sorted(facts)), nodes=run.nodes_of(facts),
        evidence={"master": f"{first.master_addr}:{first.master_port}",
                  "resolved_to": resolved, "route_to_master": routes,
                  "arrival_spread_s": round(spread, 3), "init_s_max": round(max(inits), 3) if inits else None})
