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
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddpdoctor.measure import net as net_facts
from ddpdoctor.core.findings import Finding
from ddpdoctor.measure.host_layout import cpu_slots, nics, numa_nodes, process_placement
from ddpdoctor.runtime.step_timing import gpu_uuid
from ddpdoctor.measure.topology import read_gpu_topology, read_link_under_load

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.topology.checks import NAME, RankFacts, diagnose_topology
from ddpdoctor.probes.topology.facts import (GpuTopology, IfnameSelection, LoadReading, NodeFacts, Nic, Placement,
                                             Route, TopologyFacts, Transport)
from ddpdoctor.probes.topology.render import render_matrices

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from ddpdoctor.runtime.context import RankContext

TRANSPORT_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET",
                 "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE")


def transport_facts(master_addr: str, master_port: int, hostname: str, rdma: list[str]) -> Transport:
    """Which interfaces NCCL and gloo would use, and the environment variables that decide it."""
    ifaces = net_facts.interfaces()
    own_addrs, _ = net_facts.hostname_addresses(hostname)
    gloo_default = [name for name, i in ifaces.items() if set(i["ipv4"] + i["ipv6"]) & set(own_addrs)]
    by_env = {var: IfnameSelection.from_json(chosen)
              for var, chosen in net_facts.ifname_facts(dict(os.environ), ifaces).items()}
    gloo_env = by_env.get("GLOO_SOCKET_IFNAME")
    return Transport(
        env={k: os.environ[k] for k in TRANSPORT_ENV if k in os.environ},
        selected_by_env=by_env,
        route_to_master=Route.from_json(net_facts.route_to(master_addr, master_port, ifaces)),
        # gloo binds to the address its host name resolves to unless GLOO_SOCKET_IFNAME says otherwise.
        gloo_default_interface=gloo_default,
        gloo_interface=(gloo_env.selects if gloo_env is not None else []) or gloo_default,
        # NCCL takes InfiniBand/RoCE when an RDMA device exists and NCCL_IB_DISABLE is not 1, else sockets.
        nccl_net="IB" if rdma and os.environ.get("NCCL_IB_DISABLE") != "1" else "Socket",
        rdma_devices=rdma,
    )


def read_node(numa: Mapping[str, str], master_addr: str, master_port: int, hostname: str) -> dict[str, Any]:
    """What one rank per node reads: the GPUs and their pairs, the NUMA layout, the NICs."""
    cards = nics()
    listed = [Nic.from_json(card) for card in cards] if isinstance(cards, list) else []
    rdma = sorted({dev for card in listed for dev in card.rdma})
    node = NodeFacts(numa=dict(numa), gpus=GpuTopology.from_json(read_gpu_topology(cpu_slots())), nics=listed,
                     transport=transport_facts(master_addr, master_port, hostname, rdma)).to_json()
    if not isinstance(cards, list):
        node["nics"] = cards  # sysfs unreadable: its {"unknown": why} stays on the wire
    return node


def rank_facts(device: torch.device, rank: int, host: str, local_rank: int, numa: Mapping[str, str]) -> TopologyFacts:
    """What every rank reads of itself; the node and the link under load come after."""
    return TopologyFacts(rank=rank, host=host, local_rank=local_rank, device=str(device), gpu_uuid=gpu_uuid(device),
                         placement=Placement.from_json(process_placement(numa)))


def read_rank(device: torch.device, rank: int, host: str, local_rank: int, numa: Mapping[str, str]) -> dict[str, Any]:
    return rank_facts(device, rank, host, local_rank, numa).to_json()


def read_load(device: torch.device, uuid: Optional[str]) -> Optional[LoadReading]:
    """The link under load; a failure (no pinned memory, CUDA out of memory) is a fact, not the end of the rank."""
    try:
        reading = read_link_under_load(device, uuid)
    except Exception as exc:
        text = str(exc).strip()
        return LoadReading(unknown=f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}")
    return LoadReading.from_json(reading) if reading is not None else None


class Topology:
    name = NAME
    trains = False
    summary = "Read GPU links (NVLink, PCIe under load, P2P), NUMA placement and NICs; judge them and the bandwidth they allow."
    facts_type = TopologyFacts

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, Any]:
        numa = numa_nodes()
        facts = rank_facts(ctx.device, ctx.rank, ctx.env.hostname, ctx.env.local_rank, numa)
        if ctx.env.local_rank == 0:
            node = read_node(numa, ctx.env.master_addr, ctx.env.master_port, ctx.env.hostname)
            facts.node = NodeFacts.from_json(node)
        # What was read stays diagnosable if the load below fails or hangs.
        ctx.publish_partial(NAME, facts)
        with ctx.stage("topology_load"):
            facts.load = read_load(ctx.device, facts.gpu_uuid)
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: RankFacts, run: RunView) -> list[Finding]:
        return diagnose_topology(facts, run) if facts else []

    def render_details(self, facts: RankFacts, console: Console) -> None:
        render_matrices(facts, console)
