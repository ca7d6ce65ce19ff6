"""Reading where a rank runs on its host: NUMA nodes, its CPU affinity, the NICs. Reading only.

Linux exposes all of it in sysfs without privileges; a missing file (a container that
hides /sys, another OS) is a value (`{"unknown": why}`), never an error. `root` is a
parameter so the same reader runs against a copy of another machine's /sys.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional

from ddpdoctor.core.findings import rank_ranges

SYS = "/sys"
_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def parse_cpulist(text: str) -> set[int]:
    """`0-47,96-143` (the kernel's cpulist format, and ours) → the set of CPUs."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cpulist(cpus: Iterable[int]) -> str:
    return rank_ranges(cpus)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


def numa_nodes(root: str = SYS) -> dict[str, Any]:
    """NUMA node → its CPUs, e.g. {"0": "0-47,96-143", "1": "48-95,144-191"}."""
    base = os.path.join(root, "devices/system/node")
    try:
        names = sorted((n for n in os.listdir(base) if re.fullmatch(r"node\d+", n)), key=lambda n: int(n[4:]))
    except OSError as exc:
        return {"unknown": f"{base} unreadable ({exc.strerror or exc})"}
    nodes = {}
    for name in names:
        cpus = _read(os.path.join(base, name, "cpulist"))
        if cpus:  # a memory-only node (CXL, HBM) has no CPUs: not a place a rank runs
            nodes[name[4:]] = cpus
    return nodes


def cpu_slots(root: str = SYS) -> int:
    """How many CPU numbers exist (possible, not just online): the size of an affinity mask."""
    text = _read(os.path.join(root, "devices/system/cpu/possible"))
    try:
        return max(parse_cpulist(text)) + 1 if text else os.cpu_count() or 1
    except ValueError:
        return os.cpu_count() or 1


def process_placement(nodes: Any) -> dict[str, Any]:
    """The CPUs this process may run on, and which NUMA nodes they belong to."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:
        return {"unknown": f"CPU affinity unreadable ({exc})"}
    placement: dict[str, Any] = {"cpus": cpulist(allowed), "cpu_count": len(allowed),
                                 "host_cpus": os.cpu_count()}
    if isinstance(nodes, dict) and "unknown" not in nodes:
        mine = set(allowed)
        placement["numa_nodes"] = sorted(int(n) for n, cpus in nodes.items() if mine & parse_cpulist(cpus))
    return placement


def linux_bus_id(bus_id: str) -> str:
    """NVML's 00000000:18:00.0 as sysfs and lspci write it: 0000:18:00.0."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def pci_numa_node(bus_id: str, root: str = SYS) -> Optional[int]:
    """The NUMA node sysfs gives a PCI device; None where it says -1 (one node) or cannot be read."""
    text = _read(os.path.join(root, "bus/pci/devices", linux_bus_id(bus_id), "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def _pci_address_of(path: str) -> Optional[str]:
    """The last PCI address on a device's sysfs path (a NIC's own function, past any bridges)."""
    real = os.path.realpath(path)
    found = [part for part in real.split("/") if _PCI_ADDRESS.match(part)]
    return found[-1] if found else None


def nics(root: str = SYS) -> Any:
    """Every network interface with its state, speed, PCI place and RDMA devices.

    RDMA devices (InfiniBand, RoCE) are matched to the interface through their PCI
    function: `mlx5_0` and `ib0`/`ens1f0np0` share one. What NCCL picks among them is
    decided at init; which one the environment points it at is recorded beside this.
    """
    base = os.path.join(root, "class/net")
    try:
        names = sorted(os.listdir(base))
    except OSError as exc:
        return {"unknown": f"{base} unreadable ({exc.strerror or exc})"}
    rdma = _rdma_devices(root)
    out: list[dict[str, Any]] = []
    for name in names:
        path = os.path.join(base, name)
        speed = _read(os.path.join(path, "speed"))
        pci = _pci_address_of(os.path.join(path, "device")) if os.path.exists(os.path.join(path, "device")) else None
        out.append({
            "name": name,
            "up": _read(os.path.join(path, "operstate")) in ("up", "unknown") if name != "lo" else True,
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "virtual": pci is None,
            "pci_bus_id": pci,
            "numa_node": pci_numa_node(pci, root) if pci else None,
            "rdma": sorted(dev for dev, dev_pci in rdma.items() if pci and dev_pci == pci),
        })
    paired = {dev for card in out for dev in card["rdma"]}
    for dev, pci in sorted(rdma.items()):
        if dev not in paired:  # InfiniBand without IPoIB has no network interface: still NCCL's network
            out.append({"name": dev, "up": _ib_active(root, dev), "speed_mbps": _ib_rate_mbps(root, dev),
                        "virtual": False, "pci_bus_id": pci, "numa_node": pci_numa_node(pci, root) if pci else None,
                        "rdma": [dev]})
    return out


def _rdma_devices(root: str) -> dict[str, Optional[str]]:
    base = os.path.join(root, "class/infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    return {name: _pci_address_of(os.path.join(base, name, "device")) for name in names}


def _ports(root: str, dev: str) -> list[str]:
    base = os.path.join(root, "class/infiniband", dev, "ports")
    try:
        return [os.path.join(base, p) for p in sorted(os.listdir(base))]
    except OSError:
        return []


def _ib_rate_mbps(root: str, dev: str) -> Optional[int]:
    """`400 Gb/sec (4X NDR)` in ports/N/rate → 400000; the first port that says."""
    for port in _ports(root, dev):
        match = re.match(r"\s*(\d+(?:\.\d+)?)\s*Gb/sec", _read(os.path.join(port, "rate")) or "")
        if match:
            return int(float(match.group(1)) * 1000)
    return None


def _ib_active(root: str, dev: str) -> bool:
    return any("ACTIVE" in (_read(os.path.join(port, "state")) or "") for port in _ports(root, dev))
