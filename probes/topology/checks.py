"""Judging a topology: pure functions from recorded facts to findings.

Facts come per rank; the node's GPUs, pairs, NUMA layout and NICs come from one rank per
node (the node's local rank 0), so every check first builds a `NodeView` per host. The
rules and their sources are in docs/probes/topology.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.measure.host_layout import linux_bus_id, parse_cpulist
from ddpdoctor.judge.link_model import (LEVEL_ORDER, Expectation, Hop, level_rank, network_expectation, pcie_gbps,
                                  ring_expectation)

from ddpdoctor.probes.base import RunView

NAME = "topology"
Facts = Mapping[int, Mapping[str, Any]]


@dataclass
class NodeView:
    host: str
    ranks: list[int]
    node: Optional[Mapping[str, Any]]  # the leader's node facts; None when no leader reported
    rank_gpu: dict[int, int] = field(default_factory=dict)  # rank -> NVML index of its GPU

    @property
    def gpus(self) -> list[Mapping[str, Any]]:
        """The GPUs NVML could read, each with an int index (facts from a file may be anything)."""
        topo = (self.node or {}).get("gpus")
        listed = topo.get("gpus") if isinstance(topo, Mapping) else None
        return [g for g in listed if isinstance(g, Mapping) and isinstance(g.get("index"), int) and "unknown" not in g] \
            if isinstance(listed, list) else []

    @property
    def job_gpus(self) -> list[int]:
        return sorted(set(self.rank_gpu.values()))

    def gpu(self, index: int) -> Mapping[str, Any]:
        return next(g for g in self.gpus if g.get("index") == index)

    def pair(self, a: int, b: int) -> Mapping[str, Any]:
        lo, hi = min(a, b), max(a, b)
        topo = (self.node or {}).get("gpus")
        pairs = topo.get("pairs") if isinstance(topo, Mapping) else None
        return next((p for p in pairs if isinstance(p, Mapping) and p.get("a") == lo and p.get("b") == hi), {}) \
            if isinstance(pairs, list) else {}


def node_views(facts: Facts, run: RunView) -> list[NodeView]:
    views: dict[str, NodeView] = {}
    for rank in sorted(r for r in facts if isinstance(facts[r], Mapping)):
        f = facts[rank]
        host = str(f.get("host") or run.hosts.get(rank) or "?")
        view = views.setdefault(host, NodeView(host, [], None))
        view.ranks.append(rank)
        if isinstance(f.get("node"), Mapping) and view.node is None:
            view.node = f["node"]
    for view in views.values():
        by_uuid = {g["uuid"]: g["index"] for g in view.gpus if isinstance(g.get("uuid"), str)}
        for rank in view.ranks:
            uuid = facts[rank].get("gpu_uuid")
            if isinstance(uuid, str) and uuid in by_uuid:
                view.rank_gpu[rank] = by_uuid[uuid]
    return list(views.values())


def as_mapping(value: Any) -> Mapping[str, Any]:
    """Facts read back from a file may hold anything where a mapping belongs."""
    return value if isinstance(value, Mapping) else {}


def _finding(code: str, severity: Severity, title: str, ranks: Iterable[int], nodes: Iterable[str],
             evidence: dict[str, Any], why: str, fix: str) -> Finding:
    return Finding(code=code, severity=severity, title=title, probe=NAME, ranks=tuple(sorted(set(ranks))),
                   nodes=tuple(dict.fromkeys(nodes)), evidence=evidence, why=why, fix=fix)


def ranks_on(view: NodeView, index: int) -> list[int]:
    return [r for r, g in view.rank_gpu.items() if g == index]


# -- NVLink ----------------------------------------------------------------------------

def links(gpu: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    listed = gpu.get("nvlinks")
    return [link for link in listed if isinstance(link, Mapping)] if isinstance(listed, list) else []


def active_links(gpu: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [link for link in links(gpu) if link.get("active") is True]


def switched(gpu: Mapping[str, Any]) -> bool:
    return any(link.get("remote_type") == "switch" for link in links(gpu))


def nvlinks_between(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
    """Direct links from a to b; through NVSwitch, as many as the GPU with fewer switch links has."""
    direct = sum(1 for link in active_links(a) if link.get("remote_type") == "gpu"
                 and link.get("remote_bus_id") == b.get("pci_bus_id"))
    if direct:
        return direct
    switched_a = sum(1 for link in active_links(a) if link.get("remote_type") == "switch")
    switched_b = sum(1 for link in active_links(b) if link.get("remote_type") == "switch")
    return min(switched_a, switched_b)


def _nvlink_version(gpu: Mapping[str, Any]) -> Optional[int]:
    versions = [link.get("version") for link in active_links(gpu) if isinstance(link.get("version"), int)]
    return max(versions) if versions else None


def cell(view: NodeView, a: int, b: int) -> str:
    """The `nvidia-smi topo -m` cell for GPUs a and b."""
    if a == b:
        return "X"
    links = nvlinks_between(view.gpu(a), view.gpu(b))
    if links:
        return f"NV{links}"
    level = view.pair(a, b).get("level")
    return level if isinstance(level, str) else "?"


def nvlink_findings(view: NodeView) -> list[Finding]:
    """A GPU with fewer active NVLinks than the best-connected GPU of its model on the node.

    The reference is the most any same-model GPU has, so the order of the GPUs does not
    matter. Bridged boards (NVLink bridges between pairs of PCIe cards) may lack a bridge on
    purpose: a bridged GPU with no active link is information, not a fault. On NVSwitch
    systems every GPU must be on the fabric. A GPU no rank of the job uses is information too.
    """
    findings = []
    by_model: dict[Any, list[Mapping[str, Any]]] = {}
    for gpu in view.gpus:
        if links(gpu):  # only GPUs whose links NVML reports at all
            by_model.setdefault(str(gpu.get("name")), []).append(gpu)
    for model, gpus in by_model.items():
        if len(gpus) < 2:
            continue  # nothing to compare with: a lone bridge-capable card reports its links inactive
        counts = {g["index"]: len(active_links(g)) for g in gpus}
        best = max(counts.values())
        fabric = any(switched(g) for g in gpus)
        for gpu in gpus:
            have = counts[gpu["index"]]
            if have >= best:
                continue
            down = [link.get("link") for link in links(gpu) if link.get("active") is not True]
            ranks = ranks_on(view, gpu["index"])
            none_left = have == 0
            if none_left and not fabric:
                severity = Severity.INFO  # no bridge fitted, or a bridge that is down: NVML cannot tell
            elif not ranks and view.rank_gpu:
                severity = Severity.INFO  # the job does not use this GPU
            else:
                severity = Severity.CRITICAL if none_left else Severity.WARN
            findings.append(_finding(
                "TOP002", severity,
                f"GPU {gpu['index']} on {view.host}: "
                f"{'no NVLink active' if none_left else f'{have} of {best} NVLinks active'}"
                f"{'' if fabric or not none_left else ' (no bridge fitted, or a bridge down)'}",
                ranks, [view.host],
                {"gpu": gpu["index"], "model": model, "pci_bus_id": gpu.get("pci_bus_id"), "active_links": have,
                 "links_on_its_best_peer": best, "inactive_links": down, "ranks_on_it": ranks,
                 "nvswitch": fabric},
                why=("NCCL routes around a missing NVLink: with some links down this GPU's traffic shares fewer "
                     "links, with all down it falls back to PCIe and host memory, several times slower; every "
                     "all-reduce of the job waits for it."),
                fix=("`nvidia-smi nvlink -s -i {i}` shows each link's state and `nvidia-smi nvlink -e -i {i}` its "
                     "errors. On NVSwitch systems check that the fabric manager runs (`systemctl status "
                     "nvidia-fabricmanager`); with bridged boards, that the bridge is seated. A GPU reset or a reboot "
                     "retrains the links; if a link stays down, drain the node and open a hardware ticket."
                     ).format(i=gpu["index"])))
    return findings


# -- PCIe --------------------------------------------------------------------------------

def pcie_findings(view: NodeView, facts: Facts) -> list[Finding]:
    findings = []
    for rank in view.ranks:
        load = facts[rank].get("load")
        if not isinstance(load, Mapping) or not isinstance(load.get("pcie"), Mapping):
            continue
        link = load["pcie"]
        gen, width, max_gen, max_width = (link.get(k) for k in ("gen", "width", "max_gen", "max_width"))
        gpu = view.rank_gpu.get(rank)
        where = f"GPU {gpu} on {view.host}" if gpu is not None else f"rank {rank}'s GPU on {view.host}"
        bus = view.gpu(gpu).get("pci_bus_id") if gpu is not None else None
        bus = bus if isinstance(bus, str) else None
        evidence = {"gpu": gpu, "rank": rank, "pci_bus_id": bus, "link_under_load": f"Gen{gen} x{width}",
                    "link_max": f"Gen{max_gen} x{max_width}", "host_to_device_gbps": load.get("h2d_gbps"),
                    "device_to_host_gbps": load.get("d2h_gbps"),
                    "link_gbps_now": pcie_gbps(gen, width), "link_gbps_at_max": pcie_gbps(max_gen, max_width)}
        low_gen = all(isinstance(v, int) for v in (gen, max_gen)) and gen < max_gen
        low_width = all(isinstance(v, int) for v in (width, max_width)) and width < max_width
        if low_gen or low_width:
            what = " and ".join(s for s, on in ((f"x{width} of x{max_width}", low_width),
                                                 (f"Gen{gen} of Gen{max_gen}", low_gen)) if on)
            findings.append(_finding(
                "TOP001", Severity.WARN, f"PCIe link of {where} runs at {what} under load", [rank], [view.host],
                evidence,
                why=("The link trained below what the GPU and its slot support, so every copy between host and GPU, "
                     "and any all-reduce that goes over PCIe, has less bandwidth. Read while the GPU was busy, so "
                     "this is not the power saving of an idle link."),
                fix=("Compare `nvidia-smi -q -d PCIE` (Link Width / Generation, Current vs Max) and `lspci -vv -s "
                     f"{linux_bus_id(bus) if bus else '<bus id>'} | grep -E 'LnkCap|LnkSta'` (\"LnkSta ... (downgraded)\"). Reseat the GPU or its "
                     "riser, use a slot wired x16, and check the BIOS for a forced link speed or bifurcation; if it "
                     "persists, drain the node and open a hardware ticket.")))
        replays = load.get("replays_during_load")
        if isinstance(replays, int) and replays > 0:
            findings.append(_finding(
                "TOP008", Severity.WARN, f"PCIe link of {where} retransmitted {replays} times under load",
                [rank], [view.host], dict(evidence, replays_during_load=replays),
                why=("Replays are link-level retransmissions after errors: a marginal link (riser, slot, signal "
                     "integrity) that costs bandwidth and may get worse. A healthy link replays rarely, if ever, "
                     "in a quarter of a second."),
                fix=("Watch `nvidia-smi -q -d PCIE` (Replays Since Reset) while training; node health checkers fail "
                     "a GPU at 80 replays over their test. Reseat the GPU or riser; drain the node if it keeps "
                     "counting.")))
        gpu_max = link.get("gpu_max_gen")
        if isinstance(gpu_max, int) and isinstance(max_gen, int) and gpu_max > max_gen:
            findings.append(_finding(
                "TOP010", Severity.INFO, f"{where} supports PCIe Gen{gpu_max}, its slot only Gen{max_gen}",
                [rank], [view.host], dict(evidence, gpu_max_gen=gpu_max, slot_max_gen=max_gen),
                why="The slot (or the CPU's root port) caps the link below the GPU's own generation.",
                fix="Nothing to repair; a newer platform or slot would double host-to-GPU bandwidth per generation."))
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
                or len(active_links(view.gpu(gpu))) < len(links(view.gpu(gpu))):
            continue
        usual_level = next(c for c in best.values() if level_rank(c) == usual)
        ranks = ranks_on(view, gpu)
        findings.append(_finding(
            "TOP003", Severity.WARN,
            f"GPU {gpu} on {view.host} reaches the other GPUs only through {level}; the others have {usual_level}",
            ranks, [view.host],
            {"gpu": gpu, "closest_peer_path": level, "others_closest_path": usual_level,
             "row": {str(o): cell(view, gpu, o) for o in gpus if o != gpu}, "ranks_on_it": ranks},
            why=("Every ring or tree through this GPU crosses a slower path (the CPU's host bridge or the socket "
                 "interconnect) than the others use, so the whole all-reduce runs at that path's speed."),
            fix=("Run on GPUs that share a switch or socket (choose them with CUDA_VISIBLE_DEVICES; in Slurm, "
                 "`--gpus-per-node` with `--gpu-bind=closest`), or ask the admins whether this GPU's NVLink or "
                 "slot is as designed (`nvidia-smi topo -m`).")))
    return findings


P2P_CAPABLE = ("PIX", "PXB")


def p2p_findings(view: NodeView) -> list[Finding]:
    """Pairs close enough for peer-to-peer that still do not have it (ACS, IOMMU, a VM)."""
    bad = []
    gpus = view.job_gpus
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            pair = view.pair(a, b)
            where = cell(view, a, b)
            status = pair.get("p2p_read")
            nvml_blocks = (where.startswith("NV") or where in P2P_CAPABLE) and isinstance(status, str) \
                and status not in ("OK", "GNS")
            cuda_blocks = pair.get("torch_peer") is False and status == "OK"
            if nvml_blocks or cuda_blocks:
                bad.append({"gpus": f"{a}-{b}", "path": where, "nvml_p2p_read": status,
                            "nvml_p2p_nvlink": pair.get("p2p_nvlink"), "torch_can_access_peer": pair.get("torch_peer")})
    if not bad:
        return []
    involved = {int(x) for p in bad for x in p["gpus"].split("-")}
    ranks = [r for g in involved for r in ranks_on(view, g)]
    return [_finding(
        "TOP004", Severity.WARN,
        f"GPU peer-to-peer is unavailable between {len(bad)} GPU pair{'s' if len(bad) != 1 else ''} on {view.host} "
        "that the topology allows", ranks, [view.host], {"pairs": bad[:16], "pairs_total": len(bad)},
        why=("These GPUs sit behind one PCIe switch (or share NVLink), so their data could go GPU to GPU; without "
             "P2P, NCCL stages every byte in host memory (\"via SHM\" instead of \"via P2P/IPC\" in NCCL_DEBUG=INFO "
             "output), at a fraction of the bandwidth. The usual causes are PCIe ACS enabled on the switch, an "
             "IOMMU in translation mode, a VM without P2P passthrough, or NCCL_P2P_DISABLE."),
        fix=("Check `nvidia-smi topo -p2p r` (it should say OK). Disable ACS on the PCIe switches (BIOS, or "
             "`setpci` at boot) and boot with `iommu=pt` (or the IOMMU off), as NCCL's troubleshooting guide "
             "describes; in a VM, enable P2P in the hypervisor. Make sure NCCL_P2P_DISABLE is not set."))]


# -- CPU placement ------------------------------------------------------------------------

def _cpus(text: Any) -> Optional[set[int]]:
    try:
        return parse_cpulist(text) if isinstance(text, str) else None
    except ValueError:
        return None


def affinity_findings(view: NodeView, facts: Facts) -> list[Finding]:
    numa = as_mapping(view.node).get("numa")
    if not isinstance(numa, Mapping) or "unknown" in numa or len(numa) < 2 or not view.rank_gpu:
        return []  # one NUMA node: every CPU is local to every GPU
    if any(_cpus(c) is None for c in numa.values()):
        return []
    remote, unpinned = [], []
    for rank, index in sorted(view.rank_gpu.items()):
        placement = facts[rank].get("placement")
        placement = placement if isinstance(placement, Mapping) else {}
        mine, near = _cpus(placement.get("cpus")), _cpus(view.gpu(index).get("cpu_affinity"))
        if not mine or not near:
            continue
        row = {"rank": rank, "gpu": index, "gpu_numa_node": view.gpu(index).get("numa_node"),
               "rank_cpus": placement["cpus"], "rank_numa_nodes": placement.get("numa_nodes"),
               "gpu_local_cpus": view.gpu(index).get("cpu_affinity")}
        if not mine & near:
            remote.append(row)  # not one CPU local to its GPU: the fault
        elif not mine <= near:
            unpinned.append(row)  # its GPU's CPUs and others: every node, or a socket in NPS4, or a cgroup
    findings = []
    if remote:
        rows = remote
        findings.append(_finding(
            "TOP005", Severity.WARN,
            f"Rank {rank_ranges(r['rank'] for r in rows)} on {view.host} runs on CPUs of another NUMA node than its GPU",
            [r["rank"] for r in rows], [view.host], {"ranks": rows[:16], "ranks_total": len(rows)},
            why=("Data loading, kernel launches and host-to-GPU copies of such a rank cross the socket "
                 "interconnect, and its pinned memory lives on the far node: slower steps, and the one rank "
                 "everyone else waits for."),
            fix=("Bind each rank to its GPU's NUMA node: in Slurm `srun --cpu-bind=cores --gpu-bind=closest`; "
                 "by hand `numactl --cpunodebind=N --membind=N` per rank; or remove a wrong `taskset`/cgroup "
                 "cpuset. `nvidia-smi topo -m` shows each GPU's CPU Affinity and NUMA Affinity.")))
    if unpinned:
        findings.append(_finding(
            "TOP006", Severity.INFO,
            f"Rank {rank_ranges(r['rank'] for r in unpinned)} on {view.host} may run on CPUs of other NUMA nodes "
            "than its GPU's", [r["rank"] for r in unpinned], [view.host],
            {"ranks": unpinned[:16], "ranks_total": len(unpinned)},
            why=("Not an error: the scheduler may keep each rank near its GPU, or may not. Binding makes step "
                 "times steadier on multi-socket hosts."),
            fix=("Optional: `srun --cpu-bind=cores --gpu-bind=closest`, or `numactl --cpunodebind=N --membind=N` "
                 "with N the GPU's NUMA node from `nvidia-smi topo -m`.")))
    return findings


# -- the bandwidth this topology allows ---------------------------------------------------

def _loaded_pcie(view: NodeView, facts: Facts, index: int, at_max: bool) -> Optional[float]:
    """A GPU's PCIe GB/s: as measured under load by a rank on it, else (or `at_max`) its max."""
    idle = view.gpu(index).get("pcie_idle")
    idle = idle if isinstance(idle, Mapping) else {}
    if not at_max:
        for rank in ranks_on(view, index):
            load = facts[rank].get("load")
            link = load.get("pcie") if isinstance(load, Mapping) else None
            if isinstance(link, Mapping) and pcie_gbps(link.get("gen"), link.get("width")) is not None:
                return pcie_gbps(link.get("gen"), link.get("width"))
    return pcie_gbps(idle.get("max_gen"), idle.get("max_width"))


def ring_hops(view: NodeView, facts: Facts, at_max: bool = False) -> list[Hop]:
    """The job's GPUs on this node as a ring in PCI order, which is how they sit on the switches."""
    gpus = view.job_gpus
    if len(gpus) < 2:
        return []
    hops = []
    for a, b in zip(gpus, gpus[1:] + gpus[:1]):
        if len(gpus) == 2 and hops:
            break  # two GPUs: one pair
        ga, gb = view.gpu(a), view.gpu(b)
        links = nvlinks_between(ga, gb)
        pcie = [_loaded_pcie(view, facts, g, at_max) for g in (a, b)]
        status = view.pair(a, b).get("p2p_read")
        hops.append(Hop(a, b, cell(view, a, b), links, _nvlink_version(ga) if links else None,
                        min(pcie) if all(p is not None for p in pcie) else None,
                        p2p=status in ("OK", None) or isinstance(status, Mapping)))
    return hops


def _network_mbps(view: NodeView) -> list[int]:
    listed = as_mapping(view.node).get("nics")
    nics = [n for n in (listed if isinstance(listed, list) else []) if isinstance(n, Mapping)
            and not n.get("virtual") and n.get("up") and isinstance(n.get("speed_mbps"), int)]
    rdma = [n for n in nics if n.get("rdma")]
    chosen = rdma or sorted(nics, key=lambda n: -n["speed_mbps"])[:1]
    return [int(n["speed_mbps"]) for n in chosen]


def expectation(views: list[NodeView], facts: Facts, at_max: bool = False) -> Expectation:
    """The job's all-reduce bound: its slowest node's ring, and the network when it spans nodes."""
    bounds = []
    for view in views:
        if view.node is None or not view.gpus:
            return Expectation(None, f"{view.host} has no GPU topology")
        ring = ring_expectation(ring_hops(view, facts, at_max))
        bounds.append((ring, view.host))
        if len(views) > 1:
            bounds.append((network_expectation(_network_mbps(view)), view.host))
    limited = [(e, h) for e, h in bounds if e.busbw_gbps is not None]
    unknown = [(e, h) for e, h in bounds if e.busbw_gbps is None and not e.bottleneck.startswith("one GPU")]
    if unknown:
        e, host = unknown[0]
        return Expectation(None, f"{e.bottleneck} on {host}")
    if not limited:
        return Expectation(None, "one GPU per node and one node: the all-reduce moves no data between GPUs")
    e, host = min(limited, key=lambda item: item[0].busbw_gbps)
    return Expectation(e.busbw_gbps, f"{e.bottleneck} on {host}", e.hop, e.wire_gbps)


def expected_busbw(facts: Mapping[Any, Mapping[str, Any]], run: RunView) -> dict[str, Any]:
    """TOP007's figure as plain values, for the allreduce probe to set its measurement against:
    `gbps` (None with `why` when not modelled), at the links' full speed, and the bottleneck."""
    facts = {int(k): v for k, v in facts.items()}
    views = node_views(facts, run)
    if sum(len(v.job_gpus) for v in views) < 2:
        hosts = ", ".join(sorted({v.host for v in views if v.node is not None and not v.gpus}))
        return {"gbps": None, "why": f"{hosts} has no GPU topology" if hosts else "fewer than 2 GPUs in the job"}
    now, at_max = expectation(views, facts), expectation(views, facts, at_max=True)
    if now.busbw_gbps is None:
        return {"gbps": None, "why": now.bottleneck}
    return {"gbps": now.busbw_gbps, "at_full_link_gbps": at_max.busbw_gbps, "bottleneck": now.bottleneck,
            "wire_gbps": now.wire_gbps, "nodes": len(views),
            "model": "slowest ring hop x efficiency (docs/probes/topology.md)"}


def expectation_finding(views: list[NodeView], facts: Facts) -> list[Finding]:
    if sum(len(v.job_gpus) for v in views) < 2:
        return []  # one GPU in all: the all-reduce moves nothing between GPUs
    now, at_max = expectation(views, facts), expectation(views, facts, at_max=True)
    evidence = {"expected_busbw_gbps": now.busbw_gbps, "bottleneck": now.bottleneck,
                "expected_busbw_gbps_at_full_link_speed": at_max.busbw_gbps,
                "slowest_hop_gpus": list(now.hop) if now.hop else None,
                "model": "slowest ring hop x efficiency (docs/probes/topology.md)"}
    title = (f"This topology allows about {now.busbw_gbps:g} GB/s all-reduce bus bandwidth ({now.bottleneck})"
             if now.busbw_gbps is not None else f"All-reduce bandwidth not modelled: {now.bottleneck}")
    return [_finding("TOP007", Severity.INFO, title, [], [v.host for v in views], evidence,
                     why=("What `ddpdoctor allreduce-bench` (or nccl-tests) should come close to on large messages; "
                          "a measurement far below it points at the machine."),
                     fix="")]


def no_gpu_findings(views: list[NodeView]) -> list[Finding]:
    """Nodes without GPUs NVML can see: the probe still recorded CPU placement and NICs."""
    bare = [v for v in views if v.node is not None and not v.gpus]
    if not bare:
        return []
    reasons = {v.host: str(as_mapping(as_mapping(v.node).get("gpus")).get("unknown") or "NVML sees no GPU") for v in bare}
    return [_finding("TOP009", Severity.INFO,
                     f"No GPU topology on {len(bare)} node{'s' if len(bare) != 1 else ''}: CPU placement and NICs only",
                     [r for v in bare for r in v.ranks], list(reasons), {"why_no_gpus": reasons},
                     why="Without NVML there are no GPU links to judge; ranks run on CPU (gloo).", fix="")]


def diagnose_topology(facts: Mapping[Any, Mapping[str, Any]], run: RunView) -> list[Finding]:
    facts = {int(k): v for k, v in facts.items()}  # a report read back from JSON has string keys
    views = node_views(facts, run)
    findings = no_gpu_findings(views)
    for view in views:
        if view.node is None:
            continue  # its local rank 0 did not report: the run's findings say why
        findings += nvlink_findings(view)
        findings += pcie_findings(view, facts)
        findings += asymmetry_findings(view)
        findings += p2p_findings(view)
        findings += affinity_findings(view, facts)
    findings += expectation_finding(views, facts)
    return findings
