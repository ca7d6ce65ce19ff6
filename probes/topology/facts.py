"""The topology probe's facts: what one rank recorded, and the node its node's local rank 0 read.

Field names are the JSON keys (the wire format does not change), declared in the order the
collect side writes them. Most nested parts are not built here but read, with `from_json`,
from what ddpdoctor.measure returns (NVML, sysfs, the routing table), so they write back
exactly what was measured; their `OMIT_NONE` says which keys the measuring side only writes
sometimes (an `unknown` that replaces the rest, a reading NVML did not give).

An NVML reading is its value or `{"unknown": why}` (nvml.plain): such fields are typed
`IntReading`/`TextReading` and judged only when they hold the plain value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from ddpdoctor.core.facts import Facts, nested, nested_list, nested_map

# An NVML reading: the value, {"unknown": why} where the driver could not give it, or None.
IntReading = Union[int, dict[str, str], None]
TextReading = Union[str, dict[str, str], None]


@dataclass
class PcieLink(Facts):
    """A PCIe link's generation and width: at idle (with its replay counter) or under load.

    Under load only the values NVML gave are written (measure.topology.read_link_under_load).
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {"gen", "max_gen", "gpu_max_gen", "width", "max_width", "replay_counter"})

    gen: IntReading = None
    max_gen: IntReading = None
    gpu_max_gen: IntReading = None
    width: IntReading = None
    max_width: IntReading = None
    replay_counter: IntReading = None


@dataclass
class NvLink(Facts):
    """One NVLink of a GPU: its state, version (an nvmlNvlinkVersion_t code) and far end."""

    link: Optional[int] = None
    active: bool = False
    version: IntReading = None
    remote_bus_id: TextReading = None
    remote_type: TextReading = None  # "gpu", "switch", "ibmnpu", or "type N"


@dataclass
class GpuNode(Facts):
    """One GPU NVML sees on the node; `{"index", "unknown"}` alone when it has no handle."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    index: Optional[int] = None  # NVML's index, not CUDA's
    uuid: TextReading = None
    name: TextReading = None
    pci_bus_id: TextReading = None
    numa_node: Optional[int] = None
    cpu_affinity: TextReading = None  # a cpulist
    pcie_idle: PcieLink = field(default_factory=PcieLink, metadata=nested(PcieLink))
    nvlinks: list[NvLink] = field(default_factory=list, metadata=nested_list(NvLink))
    unknown: Optional[str] = None


@dataclass
class GpuPair(Facts):
    """Two GPUs (a < b): their common PCIe ancestor as `nvidia-smi topo -m` names it, and P2P."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"p2p_pci"})

    a: Optional[int] = None
    b: Optional[int] = None
    level: TextReading = None  # PIX, PXB, PHB, NODE, SYS; NV# where a `topo -m` file shows NVLink instead
    p2p_read: TextReading = None  # `nvidia-smi topo -p2p` letters: OK, CNS, GNS, ...
    p2p_write: TextReading = None
    p2p_nvlink: TextReading = None
    torch_peer: Optional[bool] = None  # torch.cuda.can_device_access_peer; None where CUDA does not see both
    # `nvidia-smi topo -p2p p` (NVML's P2P_CAPS_INDEX_PCI, once "prop"): only from that output,
    # where a user ran it instead of `-p2p r`; the live collect reads `p2p_read`.
    p2p_pci: TextReading = None


@dataclass
class GpuTopology(Facts):
    """Every GPU NVML sees on the node and every pair between them; `{"unknown"}` without NVML."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    gpus: list[GpuNode] = field(default_factory=list, metadata=nested_list(GpuNode))
    pairs: list[GpuPair] = field(default_factory=list, metadata=nested_list(GpuPair))
    torch_peer_error: Optional[str] = None
    unknown: Optional[str] = None


@dataclass
class Nic(Facts):
    """A network interface (or an RDMA device without one) as sysfs describes it."""

    name: Optional[str] = None
    up: bool = False
    speed_mbps: Optional[int] = None
    virtual: bool = False  # no PCI device behind it
    pci_bus_id: Optional[str] = None
    numa_node: Optional[int] = None
    rdma: list[str] = field(default_factory=list)
    # Per GPU index (as a string), the path to this NIC as `nvidia-smi topo -m` names it (PIX ... SYS):
    # only a pasted matrix gives it; a live run compares the NIC's NUMA node with the GPU's instead.
    gpu_paths: Optional[dict[str, str]] = None

    OMIT_NONE = frozenset({"gpu_paths"})  # a live run's NIC has none: its report is as before


@dataclass
class IfnameSelection(Facts):
    """A `*_SOCKET_IFNAME` variable: its value, and the usable interfaces it selects."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"missing"})

    value: str = ""
    selects: list[str] = field(default_factory=list)
    missing: Optional[list[str]] = None  # GLOO_* only: listed names that are not usable


@dataclass
class Route(Facts):
    """The interface the kernel routes to the master through; `{"unknown"}` when it cannot."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    source: Optional[str] = None
    interface: Optional[str] = None
    unknown: Optional[str] = None


@dataclass
class Transport(Facts):
    """What NCCL and gloo would use on this node, and the environment that decides it."""

    env: dict[str, str] = field(default_factory=dict)
    selected_by_env: dict[str, IfnameSelection] = field(default_factory=dict, metadata=nested_map(IfnameSelection))
    route_to_master: Route = field(default_factory=Route, metadata=nested(Route))
    gloo_default_interface: list[str] = field(default_factory=list)
    gloo_interface: list[str] = field(default_factory=list)
    nccl_net: str = ""  # "IB" or "Socket"
    rdma_devices: list[str] = field(default_factory=list)


@dataclass
class NodeFacts(Facts):
    """What one rank per node (its local rank 0) reads: GPUs and pairs, NUMA layout, NICs."""

    numa: dict[str, str] = field(default_factory=dict)  # NUMA node -> its cpulist; or {"unknown": why}
    gpus: GpuTopology = field(default_factory=GpuTopology, metadata=nested(GpuTopology))
    nics: list[Nic] = field(default_factory=list, metadata=nested_list(Nic))  # {"unknown": why} on the wire reads as []
    transport: Transport = field(default_factory=Transport, metadata=nested(Transport))


@dataclass
class Placement(Facts):
    """The CPUs this rank may run on, and their NUMA nodes; `{"unknown"}` when unreadable."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"numa_nodes", "unknown"})

    cpus: Optional[str] = None  # a cpulist
    cpu_count: Optional[int] = None
    host_cpus: Optional[int] = None
    numa_nodes: Optional[list[int]] = None  # absent when the NUMA layout is unknown
    unknown: Optional[str] = None


@dataclass
class LoadReading(Facts):
    """This rank's GPU's PCIe link read during host<->device copies, and their speed.

    `{"unknown": why}` alone when the copies could not run; built here only that way.
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {"pcie", "copies", "h2d_gbps", "d2h_gbps", "replays_during_load", "unknown"})

    pcie: Optional[PcieLink] = field(default=None, metadata=nested(PcieLink))
    copies: Optional[int] = None
    h2d_gbps: Optional[float] = None
    d2h_gbps: Optional[float] = None
    replays_during_load: Optional[int] = None
    unknown: Optional[str] = None


@dataclass
class TopologyFacts(Facts):
    """One rank's topology facts; `node` only on its node's local rank 0, `load` on GPU ranks."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"gpu_index"})

    rank: Optional[int] = None
    host: str = ""
    local_rank: Optional[int] = None
    device: str = ""
    gpu_uuid: Optional[str] = None
    placement: Placement = field(default_factory=Placement, metadata=nested(Placement))
    load: Optional[LoadReading] = field(default=None, metadata=nested(LoadReading))
    node: Optional[NodeFacts] = field(default=None, metadata=nested(NodeFacts))
    # nvidia-smi's index of this rank's GPU, for facts read from a tool output that names no UUID
    # (`topo -m`); a live rank is matched to its GPU by `gpu_uuid` and never writes it.
    gpu_index: Optional[int] = None
