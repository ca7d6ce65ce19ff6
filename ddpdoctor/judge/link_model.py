"""What a link can carry, and the all-reduce bus bandwidth a topology allows. Pure arithmetic.

The model is deliberately simple, so that a user can redo it by hand (docs/probes/topology.md):
a ring all-reduce moves every byte over every hop of the ring, so its bus bandwidth
(nccl-tests' busbw) is bounded by the slowest hop, per direction, times the efficiency
that published nccl-tests runs reach on that kind of hop. Across nodes, the bound is the
node's network bandwidth. It answers "what should this machine reach", so that a
measurement far below it points at the machine, not at the workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# GT/s per lane and the line code: Gen1-2 8b/10b, Gen3-5 128b/130b, Gen6 FLIT (242 of 256 bytes carry data).
_PCIE_GTS = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130), 5: (32.0, 128 / 130),
             6: (64.0, 242 / 256)}
# nvmlDeviceGetNvLinkVersion returns an nvmlNvlinkVersion_t code, not the version: 1 = 1.0, 2 = 2.0,
# 3 = 2.2, 4 = 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0 (nvml.h; an A100 answers 5, hwloc#658).
# Per code: the version, and GB/s per link per direction: P100 (1.0) 20, V100 (2.x) 25, A100 (3.x) 25,
# H100/H200 (4.0) 25, B200 (5.0) 50. A100: 12 links = 300 GB/s per direction; H100: 18 = 450.
NVLINK_VERSIONS = {1: ("1.0", 20.0), 2: ("2.0", 25.0), 3: ("2.2", 25.0), 4: ("3.0", 25.0), 5: ("3.1", 25.0),
                   6: ("4.0", 25.0), 7: ("5.0", 50.0)}

# Measured busbw / the hop's theoretical bandwidth, from published nccl-tests all-reduce runs:
# 8xH100 NV18 ring ~370 of 450 GB/s (0.82), 8xA100 NV12 ~230 of 300 (0.77): 0.8 for NVLink.
# PCIe peer-to-peer reaches about the same share of the link. Without P2P (PHB and NODE
# pairs by NCCL's default), NCCL's SHM transport stages every byte in host memory: half.
# Across sockets (SYS) the socket interconnect is shared as well: 0.4.
EFFICIENCY = {"nvlink": 0.8, "p2p": 0.8, "shm": 0.5, "sys": 0.4, "net": 0.9}
LEVEL_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")


def pcie_gbps(gen: Any, width: Any) -> Optional[float]:
    """Theoretical GB/s per direction of a PCIe link: Gen4 x16 = 31.5; None for anything not read."""
    if not isinstance(gen, int) or gen not in _PCIE_GTS or not isinstance(width, int) or width <= 0:
        return None
    gts, code = _PCIE_GTS[gen]
    return round(gts * code * width / 8, 2)


def nvlink_label(code: Any) -> str:
    """`NVLink 4.0`; a pasted `topo -m` shows no version (`NV2` counts links only): then said so, never `None`."""
    if code in NVLINK_VERSIONS:
        return f"NVLink {NVLINK_VERSIONS[code][0]}"
    return "NVLink (version not shown)" if code is None else f"NVLink (NVML version code {code})"


def nvlink_gbps(code: Any, links: int) -> Optional[float]:
    per = NVLINK_VERSIONS[code][1] if code in NVLINK_VERSIONS else None
    return round(per * links, 2) if per and links > 0 else None


def level_rank(level: str) -> int:
    """NV# < PIX < PXB < PHB < NODE < SYS: lower is closer."""
    key = "NV" if level.startswith("NV") else level
    return LEVEL_ORDER.index(key) if key in LEVEL_ORDER else len(LEVEL_ORDER)


@dataclass(frozen=True)
class Hop:
    """One pair of GPUs as the ring uses it."""

    a: int
    b: int
    level: str  # NV18, PIX, PXB, PHB, NODE, SYS
    nvlinks: int = 0
    nvlink_version: Optional[int] = None  # NVML's nvmlNvlinkVersion_t code
    pcie_gbps: Optional[float] = None  # the slower of the two GPUs' PCIe links
    p2p: bool = True  # NVML's P2P read status is OK


def hop_gbps(hop: Hop) -> tuple[Optional[float], str]:
    """The busbw this hop allows and the kind of path that sets it."""
    if hop.nvlinks > 0:
        peak = nvlink_gbps(hop.nvlink_version, hop.nvlinks)
        return (round(peak * EFFICIENCY["nvlink"], 1) if peak else None), f"{nvlink_label(hop.nvlink_version)} x{hop.nvlinks}"
    if hop.pcie_gbps is None:
        return None, f"{hop.level} (PCIe link unknown)"
    if hop.level in ("PIX", "PXB") and hop.p2p:
        return round(hop.pcie_gbps * EFFICIENCY["p2p"], 1), f"PCIe peer-to-peer ({hop.level})"
    if hop.level == "SYS":
        return round(hop.pcie_gbps * EFFICIENCY["sys"], 1), "host memory across sockets (SYS)"
    return round(hop.pcie_gbps * EFFICIENCY["shm"], 1), f"host memory ({hop.level}{', no P2P' if not hop.p2p else ''})"


def hop_wire_gbps(hop: Hop) -> Optional[float]:
    """The hop's raw rate, before any efficiency: what a byte crossing it cannot beat."""
    if hop.nvlinks > 0:
        return nvlink_gbps(hop.nvlink_version, hop.nvlinks)
    return hop.pcie_gbps


@dataclass(frozen=True)
class Expectation:
    busbw_gbps: Optional[float]
    bottleneck: str
    hop: Optional[tuple[int, int]] = None  # the GPUs (NVML indices) of the slowest hop, within a node
    wire_gbps: Optional[float] = None  # the bottleneck's raw rate: busbw above it is in-network reduction


def ring_expectation(hops: list[Hop]) -> Expectation:
    """The slowest hop of the ring bounds the all-reduce."""
    if not hops:
        return Expectation(None, "one GPU: no link between GPUs is used")
    rated = [(hop_gbps(h), h) for h in hops]
    known = [(g, why, h) for (g, why), h in rated if g is not None]
    if len(known) < len(rated):
        unknown = next(why for (g, why), _ in rated if g is None)
        return Expectation(None, unknown)  # the reader says "not modelled: ..." once (TOP007, the bench)
    gbps, why, hop = min(known, key=lambda item: item[0])
    return Expectation(gbps, why, (hop.a, hop.b), hop_wire_gbps(hop))


def network_expectation(nic_mbps: list[int]) -> Expectation:
    """A node's share of an all-reduce across nodes: its NICs together, at network efficiency."""
    total = sum(nic_mbps)
    if total <= 0:
        return Expectation(None, "no NIC speed known")
    return Expectation(round(total / 8000 * EFFICIENCY["net"], 1),
                       f"network ({len(nic_mbps)} NIC{'s' if len(nic_mbps) != 1 else ''}, {total / 1000:g} Gb/s)",
                       wire_gbps=total / 8000)
