"""Judging a topology: pure functions from recorded facts to findings.

Facts come per rank; the node's GPUs, pairs, NUMA layout and NICs come from one rank per
node (the node's local rank 0), so every check first builds a `NodeView` per host. The
rules and their sources are in docs/probes/topology.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from ddpdoctor.core import codes
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.measure.host_layout import linux_bus_id, parse_cpulist
from ddpdoctor.judge.link_model import (EFFICIENCY, LEVEL_ORDER, Expectation, Hop, hop_gbps, level_rank,
                                        network_expectation, pcie_gbps, ring_expectation)

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.topology.facts import (GpuNode, GpuPair, LoadReading, Nic, NodeFacts, NvLink, PcieLink,
                                             TopologyFacts)

NAME = "topology"
ByRank = Mapping[int, TopologyFacts]
# What the public entry points take: typed facts, or the JSON a report holds (its rank keys are strings).
RankFacts = Union[ByRank, Mapping[int, Mapping[str, object]], Mapping[str, Mapping[str, object]]]


def typed(facts: RankFacts) -> dict[int, TopologyFacts]:
    """Each rank's facts as TopologyFacts; a rank whose facts are not an object at all reported nothing."""
    return facts_by_rank(TopologyFacts, {r: f for r, f in facts.items() if isinstance(f, (Mapping, TopologyFacts))})


@dataclass
class NodeView:
    host: str
    ranks: list[int]
    node: Optional[NodeFacts]  # the leader's node facts; None when no leader reported
    rank_gpu: dict[int, int] = field(default_factory=dict)  # rank -> NVML index of its GPU

    @property
    def gpus(self) -> list[GpuNode]:
        """The GPUs NVML could read, each with an int index (facts from a file may be anything)."""
        listed = self.node.gpus.gpus if self.node is not None else []
        return [g for g in listed if isinstance(g.index, int) and g.unknown is None]

    @property
    def job_gpus(self) -> list[int]:
        return sorted(set(self.rank_gpu.values()))

    def gpu(self, index: int) -> GpuNode:
        return next(g for g in self.gpus if g.index == index)

    def pair(self, a: int, b: int) -> GpuPair:
        lo, hi = min(a, b), max(a, b)
        pairs = self.node.gpus.pairs if self.node is not None else []
        return next((p for p in pairs if p.a == lo and p.b == hi), GpuPair())


def node_views(facts: RankFacts, run: RunView) -> list[NodeView]:
    by_rank = typed(facts)
    views: dict[str, NodeView] = {}
    for rank in sorted(by_rank):
        f = by_rank[rank]
        host = str(f.host or run.hosts.get(rank) or "?")
        view = views.setdefault(host, NodeView(host, [], None))
        view.ranks.append(rank)
        if f.node is not None and view.node is None:
            view.node = f.node
    for view in views.values():
        by_uuid = {g.uuid: g.index for g in view.gpus if isinstance(g.uuid, str)}
        indices = {g.index for g in view.gpus}
        for rank in view.ranks:
            uuid, index = by_rank[rank].gpu_uuid, by_rank[rank].gpu_index
            if isinstance(uuid, str) and uuid in by_uuid:
                view.rank_gpu[rank] = by_uuid[uuid]
            elif isinstance(index, int) and index in indices:  # a tool output's GPU, named by index only
                view.rank_gpu[rank] = index
    return list(views.values())


def _finding(code: str, title: str, ranks: Iterable[int], nodes: Iterable[str], evidence: dict[str, Any],
             severity: Optional[Severity] = None, **words: str) -> Finding:
    """A topology finding in the catalogue's words; `words` holds the fix a case builds at run time
    (TOP001, TOP002: the GPU's own bus id or index in the commands)."""
    return codes.finding(code, NAME, title, severity=severity, ranks=tuple(sorted(set(ranks))),
                         nodes=tuple(dict.fromkeys(nodes)), evidence=evidence, **words)


def ranks_on(view: NodeView, index: Optional[int]) -> list[int]:
    return [r for r, g in view.rank_gpu.items() if g == index]


# -- NVLink ----------------------------------------------------------------------------

def active_links(gpu: GpuNode) -> list[NvLink]:
    return [link for link in gpu.nvlinks if link.active]


def switched(gpu: GpuNode) -> bool:
    return any(link.remote_type == "switch" for link in gpu.nvlinks)


def nvlinks_between(a: GpuNode, b: GpuNode) -> int:
    """Direct links from a to b; through NVSwitch, as many as the GPU with fewer switch links has."""
    direct = sum(1 for link in active_links(a) if link.remote_type == "gpu" and link.remote_bus_id == b.pci_bus_id)
    if direct:
        return direct
    switched_a = sum(1 for link in active_links(a) if link.remote_type == "switch")
    switched_b = sum(1 for link in active_links(b) if link.remote_type == "switch")
    return min(switched_a, switched_b)


def bonded_links(level: object) -> int:
    """The links of a `topo -m` "NV#" cell: a tool output's count where NVML's per-link far ends are not known."""
    return int(level[2:]) if isinstance(level, str) and level[:2] == "NV" and level[2:].isdigit() else 0


def _nvlink_version(gpu: GpuNode) -> Optional[int]:
    versions = [link.version for link in active_links(gpu) if isinstance(link.version, int)]
    return max(versions) if versions else None


def cell(view: NodeView, a: int, b: int) -> str:
    """The `nvidia-smi topo -m` cell for GPUs a and b."""
    if a == b:
        return "X"
    links = nvlinks_between(view.gpu(a), view.gpu(b))
    if links:
        return f"NV{links}"
    level = view.pair(a, b).level
    return level if isinstance(level, str) else "?"


def nvlink_findings(view: NodeView) -> list[Finding]:
    """A GPU with fewer active NVLinks than the best-connected GPU of its model on the node.

    The reference is the most any same-model GPU has, so the order of the GPUs does not
    matter. Bridged boards (NVLink bridges between pairs of PCIe cards) may lack a bridge on
    purpose: a bridged GPU with no active link is information, not a fault. On NVSwitch
    systems every GPU must be on the fabric. A GPU no rank of the job uses is information too.
    """
    findings = []
    by_model: dict[str, list[GpuNode]] = {}
    for gpu in view.gpus:
        if gpu.nvlinks:  # only GPUs whose links NVML reports at all
            by_model.setdefault(str(gpu.name), []).append(gpu)
    for model, gpus in by_model.items():
        counts = {g.index: len(active_links(g)) for g in gpus}
        best = max(counts.values())
        if len(gpus) < 2:
            # No peer to compare with: the GPU's own listing is the reference. All links inactive is
            # a card without a bridge; some up and some down is a link that failed (a real NDv2 V100).
            if not 0 < best < len(gpus[0].nvlinks):
                continue
            best = len(gpus[0].nvlinks)
        fabric = any(switched(g) for g in gpus)
        for gpu in gpus:
            have = counts[gpu.index]
            if have >= best:
                continue
            down = [link.link for link in gpu.nvlinks if not link.active]
            ranks = ranks_on(view, gpu.index)
            none_left = have == 0
            if none_left and not fabric:
                severity = Severity.INFO  # no bridge fitted, or a bridge that is down: NVML cannot tell
            elif not ranks and view.rank_gpu:
                severity = Severity.INFO  # the job does not use this GPU
            else:
                severity = Severity.CRITICAL if none_left else Severity.WARN
            findings.append(_finding(
                "TOP002",
                f"GPU {gpu.index} on {view.host}: "
                f"{'no NVLink active' if none_left else f'{have} of {best} NVLinks active'}"
                f"{'' if fabric or not none_left else ' (no bridge fitted, or a bridge down)'}",
                ranks, [view.host],
                {"gpu": gpu.index, "model": model, "pci_bus_id": gpu.pci_bus_id, "active_links": have,
                 "links_on_its_best_peer": best, "inactive_links": down, "ranks_on_it": ranks,
                 "nvswitch": fabric},
                severity=severity,
                fix=("`nvidia-smi nvlink -s -i {i}` shows each link's state and `nvidia-smi nvlink -e -i {i}` its "
                     "errors. On NVSwitch systems check that the fabric manager runs (`systemctl status "
                     "nvidia-fabricmanager`); with bridged boards, that the bridge is seated. A GPU reset or a reboot "
                     "retrains the links; if a link stays down, drain the node and open a hardware ticket."
                     ).format(i=gpu.index)))
    return findings


# -- PCIe --------------------------------------------------------------------------------

@dataclass
class LoadedLink:
    """One rank's GPU link as read under load, with what every PCIe finding about it cites."""

    rank: int
    host: str
    where: str  # "GPU 2 on host", or the rank's GPU when its NVML index is not known
    bus: Optional[str]
    link: PcieLink
    evidence: dict[str, Any]


def loaded_link(view: NodeView, rank: int, load: LoadReading, link: PcieLink) -> LoadedLink:
    gpu = view.rank_gpu.get(rank)
    where = f"GPU {gpu} on {view.host}" if gpu is not None else f"rank {rank}'s GPU on {view.host}"
    bus = view.gpu(gpu).pci_bus_id if gpu is not None else None
    bus = bus if isinstance(bus, str) else None
    gen, width, max_gen, max_width = link.gen, link.width, link.max_gen, link.max_width
    evidence = {"gpu": gpu, "rank": rank, "pci_bus_id": bus, "link_under_load": f"Gen{gen} x{width}",
                "link_max": f"Gen{max_gen} x{max_width}", "host_to_device_gbps": load.h2d_gbps,
                "device_to_host_gbps": load.d2h_gbps,
                "link_gbps_now": pcie_gbps(gen, width), "link_gbps_at_max": pcie_gbps(max_gen, max_width)}
    return LoadedLink(rank, view.host, where, bus, link, evidence)


def downtrained_finding(loaded: LoadedLink) -> list[Finding]:
    """TOP001: a link below its generation or width while the GPU was busy."""
    gen, width, max_gen, max_width = (loaded.link.gen, loaded.link.width, loaded.link.max_gen,
                                      loaded.link.max_width)
    low_gen = isinstance(gen, int) and isinstance(max_gen, int) and gen < max_gen
    low_width = isinstance(width, int) and isinstance(max_width, int) and width < max_width
    if not (low_gen or low_width):
        return []
    what = " and ".join(s for s, on in ((f"x{width} of x{max_width}", low_width),
                                         (f"Gen{gen} of Gen{max_gen}", low_gen)) if on)
    return [_finding(
        "TOP001", f"PCIe link of {loaded.where} runs at {what} under load", [loaded.rank],
        [loaded.host], loaded.evidence,
        fix=("Compare `nvidia-smi -q -d PCIE` (Link Width / Generation, Current vs Max) and `lspci -vv -s "
             f"{linux_bus_id(loaded.bus) if loaded.bus else '<bus id>'} | grep -E 'LnkCap|LnkSta'` "
             "(\"LnkSta ... (downgraded)\"). Reseat the GPU or its "
             "riser, use a slot wired x16, and check the BIOS for a forced link speed or bifurcation; if it "
             "persists, drain the node and open a hardware ticket."))]


def replay_finding(loaded: LoadedLink, replays: Optional[int]) -> list[Finding]:
    """TOP008: link-level retransmissions during the copies."""
    if not (isinstance(replays, int) and replays > 0):
        return []
    return [_finding(
        "TOP008", f"PCIe link of {loaded.where} retransmitted {replays} times under load",
        [loaded.rank], [loaded.host], dict(loaded.evidence, replays_during_load=replays))]


def capped_slot_finding(loaded: LoadedLink) -> list[Finding]:
    """TOP010: a GPU whose own PCIe generation is above what its slot allows."""
    gpu_max, max_gen = loaded.link.gpu_max_gen, loaded.link.max_gen
    if not (isinstance(gpu_max, int) and isinstance(max_gen, int) and gpu_max > max_gen):
        return []
    return [_finding(
        "TOP010", f"{loaded.where} supports PCIe Gen{gpu_max}, its slot only Gen{max_gen}",
        [loaded.rank], [loaded.host], dict(loaded.evidence, gpu_max_gen=gpu_max, slot_max_gen=max_gen))]


def pcie_findings(view: NodeView, facts: ByRank) -> list[Finding]:
    """Each rank's link under load: downtrained (TOP001), replaying (TOP008), capped by its slot (TOP010)."""
    findings = []
    for rank in view.ranks:
        load = facts[rank].load
        if load is None or load.pcie is None:
            continue
        loaded = loaded_link(view, rank, load, load.pcie)
        findings += downtrained_finding(loaded)
        findings += replay_finding(loaded, load.replays_during_load)
        findings += capped_slot_finding(loaded)
    return findings


# -- pairs: asymmetry and peer-to-peer ---------------------------------------------------

def asymmetry_findings(view: NodeView) -> list[Finding]:
    """A job GPU whose closest peer is across host bridges or sockets while the others' is closer.

    A GPU with NVLinks down is left to TOP002, which names the cause of the same symptom.
    """
    gpus = view.job_gpus
    if len(gpus) < 3:  # with two GPUs there is one pair: nothing to be asymmetric about
        return []
    rows = {g: [c for c in (cell(view, g, o) for o in gpus if o != g) if level_rank(c) < len(LEVEL_ORDER)]
            for g in gpus}
    best = {g: min(row, key=level_rank) for g, row in rows.items() if row}  # a path NVML did not give is no path
    if len(best) < 3:
        return []
    usual = Counter(level_rank(c) for c in best.values()).most_common(1)[0][0]
    findings = []
    for gpu, level in best.items():
        if level_rank(level) <= usual or level_rank(level) < level_rank("NODE") \
                or len(active_links(view.gpu(gpu))) < len(view.gpu(gpu).nvlinks):
            continue
        usual_level = next(c for c in best.values() if level_rank(c) == usual)
        ranks = ranks_on(view, gpu)
        findings.append(_finding(
            "TOP003",
            f"GPU {gpu} on {view.host} reaches the other GPUs only through {level}; the others have {usual_level}",
            ranks, [view.host],
            {"gpu": gpu, "closest_peer_path": level, "others_closest_path": usual_level,
             "row": {str(o): cell(view, gpu, o) for o in gpus if o != gpu}, "ranks_on_it": ranks}))
    return findings


P2P_CAPABLE = ("PIX", "PXB")


def _p2p_blocked(status: object) -> bool:
    """A `topo -p2p` letter that says no: GNS (a board without P2P, GeForce) is by design, not a fault."""
    return isinstance(status, str) and status not in ("OK", "GNS")


def p2p_findings(view: NodeView) -> list[Finding]:
    """Pairs close enough for peer-to-peer that still do not have it (ACS, IOMMU, a VM)."""
    bad = []
    gpus = view.job_gpus
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            pair = view.pair(a, b)
            where = cell(view, a, b)
            status = pair.p2p_read
            nvml_blocks = (where.startswith("NV") or where in P2P_CAPABLE) \
                and (_p2p_blocked(status) or _p2p_blocked(pair.p2p_pci))
            cuda_blocks = pair.torch_peer is False and status == "OK"
            if nvml_blocks or cuda_blocks:
                row = {"gpus": f"{a}-{b}", "path": where, "nvml_p2p_read": status,
                       "nvml_p2p_nvlink": pair.p2p_nvlink, "torch_can_access_peer": pair.torch_peer}
                if pair.p2p_pci is not None:  # only from a `topo -p2p p` file
                    row["nvml_p2p_pci"] = pair.p2p_pci
                bad.append(row)
    if not bad:
        return []
    involved = {int(x) for p in bad for x in p["gpus"].split("-")}
    ranks = [r for g in involved for r in ranks_on(view, g)]
    return [_finding(
        "TOP004",
        f"GPU peer-to-peer is unavailable between {len(bad)} GPU pair{'s' if len(bad) != 1 else ''} on {view.host} "
        "that the topology allows", ranks, [view.host], {"pairs": bad[:16], "pairs_total": len(bad)})]


# -- the CPU sockets: GPUs and NICs across them ------------------------------------------

CROSSING = "SYS"  # PCIe and the interconnect between NUMA nodes (SOC in old drivers, read as SYS)


def _gbps_by_generation(efficiency: float) -> dict[str, float]:
    """What a hop of this efficiency allows at each PCIe generation, x16: the figure to expect where
    the links were not read (a pasted `topo -m`)."""
    return {f"Gen{gen} x16": round(float(pcie_gbps(gen, 16) or 0.0) * efficiency, 1) for gen in (3, 4, 5)}


def _sys_gbps_by_generation() -> dict[str, float]:
    """A SYS hop (the link model's host-memory-across-sockets efficiency), per PCIe generation."""
    return _gbps_by_generation(EFFICIENCY["sys"])


def _sys_cost() -> str:
    """What a SYS hop costs the all-reduce against GPUs under one PCIe switch, in the model's figures."""
    sys, switch = _sys_gbps_by_generation(), _gbps_by_generation(EFFICIENCY["p2p"])
    return (f"about {EFFICIENCY['sys']:.0%} of the PCIe link ({sys['Gen3 x16']:g} GB/s busbw at Gen3 x16, "
            f"{sys['Gen4 x16']:g} at Gen4, {sys['Gen5 x16']:g} at Gen5) against about {EFFICIENCY['p2p']:.0%} for GPUs "
            f"under one PCIe switch ({switch['Gen3 x16']:g}, {switch['Gen4 x16']:g}, {switch['Gen5 x16']:g}) and "
            "several times that over NVLink: DDP's gradient all-reduce moves the model's size every step at that rate")


def _without_crossing(view: NodeView, size: int) -> Optional[list[int]]:
    """`size` GPUs of the node of which no two meet across the sockets, where there are any: the
    first GPU's closer-than-SYS neighbours, greedily (a node's GPUs group by socket or switch)."""
    gpus = [g.index for g in view.gpus if isinstance(g.index, int)]
    for first in gpus:
        chosen = [first]
        for other in gpus:
            if other not in chosen and all(cell(view, other, c) not in (CROSSING, "?") for c in chosen):
                chosen.append(other)
            if len(chosen) == size:
                return chosen
    return None


def _numa_groups(view: NodeView, gpus: list[int]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for g in gpus:
        numa = view.gpu(g).numa_node
        groups.setdefault(str(numa) if isinstance(numa, int) and numa >= 0 else "?", []).append(g)
    return groups


def _pair_names(pairs: list[tuple[int, int]]) -> str:
    """The pairs as `nvidia-smi topo -m` names them (GPU0-GPU1), the first four."""
    named = ", ".join(f"GPU{a}-GPU{b}" for a, b in pairs[:4])
    return named + (f" and {len(pairs) - 4} more" if len(pairs) > 4 else "")


def socket_findings(view: NodeView, named: list[Finding]) -> list[Finding]:
    """TOP011: the job's GPUs meet across the CPU sockets (SYS), where no single GPU is to blame
    (TOP003 names one placed worse than the others: that is the cause then, said once).

    Nothing is broken: a 2-socket PCIe server is built so. What it costs is the all-reduce's
    bandwidth, which goes through host memory and the socket interconnect at a fraction of PCIe
    (issue 41: pasted machines with every pair SYS were judged healthy with no word of it). WARN
    where the same number of GPUs on this node could avoid it (CUDA_VISIBLE_DEVICES), and for a
    2-GPU job (issue 51): its all-reduce is that one pair, and two GPUs never need two sockets (a
    socket of any GPU server holds two), so the placement, not the job's size, costs it. INFO where
    the job needs GPUs of both sockets."""
    gpus = view.job_gpus
    if len(gpus) < 2 or any(f.code == "TOP003" and view.host in f.nodes for f in named):
        return []
    crossing = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1:] if cell(view, a, b) == CROSSING]
    if not crossing:
        return []
    pairs = len(gpus) * (len(gpus) - 1) // 2
    groups = _numa_groups(view, gpus)
    instead = _without_crossing(view, len(gpus))
    where = ", ".join(f"GPU {rank_ranges(g)} on NUMA node {n}" for n, g in sorted(groups.items()) if n != "?")
    evidence: dict[str, Any] = {
        "sys_pairs": [f"{a}-{b}" for a, b in crossing[:32]], "sys_pairs_total": len(crossing), "pairs_total": pairs,
        "gpus_by_numa_node": groups, "expected_busbw_gbps_per_sys_hop": _sys_gbps_by_generation(),
        "expected_busbw_gbps_under_one_pcie_switch": _gbps_by_generation(EFFICIENCY["p2p"]),
        "cost": _sys_cost(), "gpus_without_crossing": instead}
    ring_sys = [h for h in ring_hops(view, {}, at_max=True) if h.level == CROSSING]
    if ring_sys and ring_sys[0].pcie_gbps is not None:
        evidence["expected_busbw_gbps_per_sys_hop"] = {"this node": hop_gbps(ring_sys[0])[0]}
    pair_job = len(gpus) == 2
    severity = Severity.WARN if instead is not None or pair_job else Severity.INFO
    choose = (f"Choose GPUs that share a socket: `CUDA_VISIBLE_DEVICES={','.join(map(str, instead))}` gives this "
              f"job's {len(gpus)} GPUs with no pair across the sockets. " if instead is not None else "")
    if pair_job and instead is None:
        choose = ("Run the job on two GPUs under one socket: a machine or instance whose `nvidia-smi topo -m` shows "
                  "NV#, PIX, PXB, PHB or NODE between them (or move one card to a slot of the other's socket). ")
    pin = ("Until then, pin each rank to its GPU's NUMA node (`numactl --cpunodebind=N --membind=N` per rank; Slurm "
           "`--cpu-bind=cores --gpu-bind=closest`) so its copies do not cross the sockets twice. " if pair_job else "")
    title = (f"GPU{crossing[0][0]} and GPU{crossing[0][1]} on {view.host} meet only across the CPU sockets (SYS)"
             f"{f': {where}' if where else ''}; the 2-GPU all-reduce gets about {EFFICIENCY['sys']:.0%} of the PCIe "
             "link, half what GPUs under one PCIe switch get" if pair_job else
             f"The all-reduce crosses the CPU sockets on {view.host}: {len(crossing)} of {pairs} GPU pairs meet only "
             f"across them (SYS){f': {where}' if where else ''}")
    return [_finding(
        "TOP011", title,
        [r for g in gpus for r in ranks_on(view, g)], [view.host], evidence, severity=severity,
        fix=(f"{choose}{pin}{'Measure' if pair_job else 'Where the job needs GPUs of both sockets, expect this: measure'}"
             " it with `ddpdoctor "
             "allreduce-bench` (NCCL_DEBUG=INFO shows these hops \"via SHM\" or \"via P2P\" with NCCL_P2P_LEVEL=SYS, "
             "which some platforms allow and others corrupt or slow: test it before relying on it; a first all-reduce "
             "that hangs \"via P2P/CUMEM\" across the sockets is fixed by NCCL_P2P_DISABLE=1). GPUs joined by NVLink "
             f"(bridges, SXM boards) keep the all-reduce off the sockets. Pairs: {_pair_names(crossing)}."))]


def _nic_path(nic: Nic, gpu: GpuNode) -> Optional[str]:
    """The GPU's path to the NIC: the pasted matrix's cell, else SYS or NODE by their NUMA nodes."""
    pasted = (nic.gpu_paths or {}).get(str(gpu.index))
    if pasted:
        return pasted
    if isinstance(nic.numa_node, int) and nic.numa_node >= 0 and isinstance(gpu.numa_node, int) and gpu.numa_node >= 0:
        return CROSSING if nic.numa_node != gpu.numa_node else "NODE"
    return None


def nic_findings(view: NodeView, across_nodes: bool) -> list[Finding]:
    """TOP012: job GPUs whose every NIC is across NUMA nodes (a pasted matrix's SYS, or a live run's NIC
    on another NUMA node than the GPU: another socket, or another die of one socket in NPS/SNC modes,
    whose fabric hop NVML also calls SYS). Their traffic to other nodes then crosses that interconnect
    and cannot go NIC to GPU directly (GPUDirect RDMA needs the two under one PCIe switch or host
    bridge). WARN for a job across nodes, INFO for one that is not."""
    if view.node is None:
        return []
    nics = [n for n in view.node.nics if not n.virtual]
    rdma = [n for n in nics if n.rdma or n.gpu_paths]
    nics = rdma or nics
    far: list[int] = []
    near: dict[str, list[int]] = {}
    for g in view.job_gpus:
        paths = {str(n.name): p for n in nics if (p := _nic_path(n, view.gpu(g))) is not None}
        if paths and all(p == CROSSING for p in paths.values()):
            far.append(g)
        for name, p in paths.items():
            if p != CROSSING:
                near.setdefault(name, []).append(g)
    if not far:
        return []
    names = sorted({str(n.name) for n in nics if _nic_path(n, view.gpu(far[0])) is not None})
    cost = ("no GPUDirect RDMA for these GPUs: NCCL stages their traffic to other nodes in host memory on the far "
            f"socket, about {_sys_gbps_by_generation()['Gen4 x16']:g} GB/s at Gen4 x16 whatever the NIC's rate "
            "(nccl-tests#293: 1.1 GB/s over a 200 Gb/s HDR NIC until NCCL_NET_GDR_LEVEL or the BIOS NUMA setting changed)")
    return [_finding(
        "TOP012",
        f"GPU {rank_ranges(far)} on {view.host} reach{'es' if len(far) == 1 else ''} the NICs ({', '.join(names)}) "
        "only across NUMA nodes (SYS)",
        [r for g in far for r in ranks_on(view, g)], [view.host],
        {"gpus_far_from_every_nic": far, "nics_near_gpus": near, "job_across_nodes": across_nodes,
         "cost": cost if across_nodes else "none while the job stays on one node: " + cost},
        severity=Severity.WARN if across_nodes else Severity.INFO)]


# -- CPU placement ------------------------------------------------------------------------

def _cpus(text: object) -> Optional[set[int]]:
    try:
        return parse_cpulist(text) if isinstance(text, str) else None
    except ValueError:
        return None


def affinity_findings(view: NodeView, facts: ByRank) -> list[Finding]:
    numa = view.node.numa if view.node is not None else {}
    if "unknown" in numa or len(numa) < 2 or not view.rank_gpu:
        return []  # one NUMA node: every CPU is local to every GPU
    if any(_cpus(c) is None for c in numa.values()):
        return []
    remote, unpinned = [], []
    for rank, index in sorted(view.rank_gpu.items()):
        placement, gpu = facts[rank].placement, view.gpu(index)
        mine, near = _cpus(placement.cpus), _cpus(gpu.cpu_affinity)
        if not mine or not near:
            continue
        row = {"rank": rank, "gpu": index, "gpu_numa_node": gpu.numa_node,
               "rank_cpus": placement.cpus, "rank_numa_nodes": placement.numa_nodes,
               "gpu_local_cpus": gpu.cpu_affinity}
        if not mine & near:
            remote.append(row)  # not one CPU local to its GPU: the fault
        elif not mine <= near:
            unpinned.append(row)  # its GPU's CPUs and others: every node, or a socket in NPS4, or a cgroup
    findings = []
    if remote:
        rows = remote
        findings.append(_finding(
            "TOP005",
            f"Rank {rank_ranges(r['rank'] for r in rows)} on {view.host} runs on CPUs of another NUMA node than its GPU",
            [r["rank"] for r in rows], [view.host], {"ranks": rows[:16], "ranks_total": len(rows)}))
    if unpinned:
        findings.append(_finding(
            "TOP006",
            f"Rank {rank_ranges(r['rank'] for r in unpinned)} on {view.host} may run on CPUs of other NUMA nodes "
            "than its GPU's", [r["rank"] for r in unpinned], [view.host],
            {"ranks": unpinned[:16], "ranks_total": len(unpinned)}))
    return findings


# -- the bandwidth this topology allows ---------------------------------------------------

def _loaded_pcie(view: NodeView, facts: ByRank, index: int, at_max: bool) -> Optional[float]:
    """A GPU's PCIe GB/s: as measured under load by a rank on it, else (or `at_max`) its max."""
    if not at_max:
        for rank in ranks_on(view, index):
            load = facts[rank].load
            link = load.pcie if load is not None else None
            if link is not None and pcie_gbps(link.gen, link.width) is not None:
                return pcie_gbps(link.gen, link.width)
    idle = view.gpu(index).pcie_idle
    return pcie_gbps(idle.max_gen, idle.max_width)


def ring_hops(view: NodeView, facts: ByRank, at_max: bool = False) -> list[Hop]:
    """The job's GPUs on this node as a ring in PCI order, which is how they sit on the switches."""
    gpus = view.job_gpus
    if len(gpus) < 2:
        return []
    hops: list[Hop] = []
    for a, b in zip(gpus, gpus[1:] + gpus[:1]):
        if len(gpus) == 2 and hops:
            break  # two GPUs: one pair
        ga, gb = view.gpu(a), view.gpu(b)
        pair = view.pair(a, b)
        links = nvlinks_between(ga, gb) or bonded_links(pair.level)
        pcie = [gbps for gbps in (_loaded_pcie(view, facts, g, at_max) for g in (a, b)) if gbps is not None]
        status = pair.p2p_read
        hops.append(Hop(a, b, cell(view, a, b), links, _nvlink_version(ga) if links else None,
                        min(pcie) if len(pcie) == 2 else None,
                        p2p=(status in ("OK", None) or isinstance(status, Mapping))
                        and not _p2p_blocked(pair.p2p_pci)))
    return hops


def _network_mbps(view: NodeView) -> list[int]:
    """The speeds of the NICs NCCL would use between nodes: every RDMA one, else the fastest."""
    usable: list[tuple[int, Nic]] = []
    for nic in view.node.nics if view.node is not None else []:
        if not nic.virtual and nic.up and isinstance(nic.speed_mbps, int):
            usable.append((int(nic.speed_mbps), nic))
    rdma = [speed for speed, nic in usable if nic.rdma]
    return rdma or sorted((speed for speed, _ in usable), reverse=True)[:1]


def expectation(views: list[NodeView], facts: ByRank, at_max: bool = False) -> Expectation:
    """The job's all-reduce bound: its slowest node's ring, and the network when it spans nodes."""
    bounds = []
    for view in views:
        if view.node is None or not view.gpus:
            return Expectation(None, f"{view.host} has no GPU topology")
        ring = ring_expectation(ring_hops(view, facts, at_max))
        bounds.append((ring, view.host))
        if len(views) > 1:
            bounds.append((network_expectation(_network_mbps(view)), view.host))
    limited = [(e.busbw_gbps, e, h) for e, h in bounds if e.busbw_gbps is not None]
    unknown = [(e, h) for e, h in bounds if e.busbw_gbps is None and not e.bottleneck.startswith("one GPU")]
    if unknown:
        e, host = unknown[0]
        return Expectation(None, f"{e.bottleneck} on {host}")
    if not limited:
        return Expectation(None, "one GPU per node and one node: the all-reduce moves no data between GPUs")
    gbps, e, host = min(limited, key=lambda item: item[0])
    return Expectation(gbps, f"{e.bottleneck} on {host}", e.hop, e.wire_gbps)


def expected_busbw(facts: RankFacts, run: RunView) -> dict[str, Any]:
    """TOP007's figure as plain values, for the allreduce probe to set its measurement against:
    `gbps` (None with `why` when not modelled), at the links' full speed, and the bottleneck."""
    by_rank = typed(facts)
    views = node_views(by_rank, run)
    if sum(len(v.job_gpus) for v in views) < 2:
        hosts = ", ".join(sorted({v.host for v in views if v.node is not None and not v.gpus}))
        return {"gbps": None, "why": f"{hosts} has no GPU topology" if hosts else "fewer than 2 GPUs in the job"}
    now, at_max = expectation(views, by_rank), expectation(views, by_rank, at_max=True)
    if now.busbw_gbps is None:
        return {"gbps": None, "why": now.bottleneck}
    return {"gbps": now.busbw_gbps, "at_full_link_gbps": at_max.busbw_gbps, "bottleneck": now.bottleneck,
            "wire_gbps": now.wire_gbps, "nodes": len(views),
            "model": "slowest ring hop x efficiency (docs/probes/topology.md)"}


def expectation_finding(views: list[NodeView], facts: ByRank) -> list[Finding]:
    if sum(len(v.job_gpus) for v in views) < 2:
        return []  # one GPU in all: the all-reduce moves nothing between GPUs
    now, at_max = expectation(views, facts), expectation(views, facts, at_max=True)
    evidence = {"expected_busbw_gbps": now.busbw_gbps, "bottleneck": now.bottleneck,
                "expected_busbw_gbps_at_full_link_speed": at_max.busbw_gbps,
                "slowest_hop_gpus": list(now.hop) if now.hop else None,
                "model": "slowest ring hop x efficiency (docs/probes/topology.md)"}
    title = (f"This topology allows about {now.busbw_gbps:g} GB/s all-reduce bus bandwidth ({now.bottleneck})"
             if now.busbw_gbps is not None else f"All-reduce bandwidth not modelled: {now.bottleneck}")
    return [_finding("TOP007", title, [], [v.host for v in views], evidence)]


def no_gpu_findings(views: list[NodeView]) -> list[Finding]:
    """Nodes without GPUs NVML can see: the probe still recorded CPU placement and NICs."""
    reasons = {v.host: str(v.node.gpus.unknown or "NVML sees no GPU") for v in views if v.node is not None and not v.gpus}
    if not reasons:
        return []
    bare = [v for v in views if v.host in reasons]
    return [_finding("TOP009",
                     f"No GPU topology on {len(bare)} node{'s' if len(bare) != 1 else ''}: CPU placement and NICs only",
                     [r for v in bare for r in v.ranks], list(reasons), {"why_no_gpus": reasons})]


def diagnose_topology(facts: RankFacts, run: RunView) -> list[Finding]:
    by_rank = typed(facts)  # a report read back from JSON has string keys and plain objects
    views = node_views(by_rank, run)
    findings = no_gpu_findings(views)
    for view in views:
        if view.node is None:
            continue  # its local rank 0 did not report: the run's findings say why
        findings += nvlink_findings(view)
        findings += pcie_findings(view, by_rank)
        findings += asymmetry_findings(view)
        findings += p2p_findings(view)
        findings += affinity_findings(view, by_rank)
        findings += socket_findings(view, findings)
        # Across nodes where any input names another host (an nccl-tests run pasted beside one node's topo -m).
        findings += nic_findings(view, across_nodes=len(views) > 1 or len(set(run.hosts.values()) | {view.host}) > 1)
    findings += expectation_finding(views, by_rank)
    return findings
