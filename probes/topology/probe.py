"""Probe `topology`: the links between GPUs, CPUs and NICs, and the bandwidth they allow.

Collect: every rank records the CPUs it may run on and reads its GPU's PCIe link while
host-to-GPU copies keep the link busy (an idle GPU lowers its link speed on purpose);
the node's local rank 0 also reads the node: each GPU's NVLinks, PCIe link, NUMA node and
CPU affinity, each pair's common PCIe ancestor and peer-to-peer status, the NUMA layout
and the NICs, with which ones NCCL and gloo would use.
Gather: the facts go to the store, the node's once.
Diagnose: `topology_checks` (pure) rebuilds `nvidia-smi topo -m` per node and judges it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ddpdoctor.measure import net as net_facts
from ddpdoctor.core.findings import Finding
from ddpdoctor.measure.host_layout import cpu_slots, nics, numa_nodes, process_placement
from ddpdoctor.runtime.step_timing import gpu_uuid
from ddpdoctor.measure.topology import read_gpu_topology, read_link_under_load

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.topology.checks import NAME, diagnose_topology
from ddpdoctor.probes.topology.render import render_matrices

TRANSPORT_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET",
                 "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE")


def read_node(numa: Any, master_addr: str, master_port: int, hostname: str) -> dict[str, Any]:
    """What one rank per node reads: the GPUs and their pairs, the NUMA layout, the NICs."""
    cards = nics()
    ifaces = net_facts.interfaces()
    own_addrs, _ = net_facts.hostname_addresses(hostname)
    gloo_default = [name for name, i in ifaces.items() if set(i["ipv4"] + i["ipv6"]) & set(own_addrs)]
    rdma = sorted({dev for n in cards for dev in n.get("rdma", [])}) if isinstance(cards, list) else []
    by_env = net_facts.ifname_facts(dict(os.environ), ifaces)
    return {
        "numa": numa,
        "gpus": read_gpu_topology(cpu_slots()),
        "nics": cards,
        "transport": {
            "env": {k: os.environ[k] for k in TRANSPORT_ENV if k in os.environ},
            "selected_by_env": by_env,
            "route_to_master": net_facts.route_to(master_addr, master_port, ifaces),
            # gloo binds to the address its host name resolves to unless GLOO_SOCKET_IFNAME says otherwise.
            "gloo_default_interface": gloo_default,
            "gloo_interface": (by_env.get("GLOO_SOCKET_IFNAME") or {}).get("selects") or gloo_default,
            # NCCL takes InfiniBand/RoCE when an RDMA device exists and NCCL_IB_DISABLE is not 1, else sockets.
            "nccl_net": "IB" if rdma and os.environ.get("NCCL_IB_DISABLE") != "1" else "Socket",
            "rdma_devices": rdma,
        },
    }


def read_rank(device: Any, rank: int, host: str, local_rank: int, numa: Any) -> dict[str, Any]:
    return {"rank": rank, "host": host, "local_rank": local_rank, "device": str(device),
            "gpu_uuid": gpu_uuid(device), "placement": process_placement(numa), "load": None, "node": None}


class Topology:
    name = NAME
    trains = False
    summary = "Read GPU links (NVLink, PCIe under load, P2P), NUMA placement and NICs; judge them and the bandwidth they allow."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: Any) -> dict[str, Any]:
        numa = numa_nodes()
        facts = read_rank(ctx.device, ctx.rank, ctx.env.hostname, ctx.env.local_rank, numa)
        if ctx.env.local_rank == 0:
            facts["node"] = read_node(numa, ctx.env.master_addr, ctx.env.master_port, ctx.env.hostname)
        # What was read stays diagnosable if the load below fails or hangs.
        ctx.channel.set(f"result/{NAME}/{ctx.rank}", facts)
        with ctx.stage("topology_load"):
            try:
                facts["load"] = read_link_under_load(ctx.device, facts["gpu_uuid"])
            except Exception as exc:  # no pinned memory, CUDA out of memory: a fact, not the end of the rank
                facts["load"] = {"unknown": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}
        return facts

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
        return diagnose_topology(facts, run) if facts else []

    def render_details(self, facts: Mapping[int, Mapping[str, Any]], console: Any) -> None:
        render_matrices(facts, console)
