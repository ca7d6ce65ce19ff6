"""The topology probe's readers: sysfs (a built tree, and this machine's) and NVML (a fake pynvml).

No GPU here: the NVML reader runs against a stand-in that answers like the real bindings do,
including their quirks (NVML_P2P_CAPS_INDEX_READ is a tuple in nvidia-ml-py 13, a link
past the GPU's last raises "not supported"). docs/probes/topology.md says what ran on a GPU.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpdoctor.measure import host_layout
from ddpdoctor.measure import nvml
from ddpdoctor.measure import topology as topology_reading


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


@pytest.fixture()
def sysfs(tmp_path: Path) -> Path:
    """Two NUMA nodes with CPUs and one memory-only node; an RDMA NIC, an Ethernet NIC, loopback."""
    _write(tmp_path / "devices/system/node/node0/cpulist", "0-3")
    _write(tmp_path / "devices/system/node/node1/cpulist", "4-7")
    _write(tmp_path / "devices/system/node/node2/cpulist", "")  # CXL memory: no CPUs
    nic_dir = tmp_path / "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
    _write(nic_dir / "numa_node", "1")
    _write(tmp_path / "devices/pci0000:00/0000:00:03.0/virtio2/placeholder", "")
    net = tmp_path / "class/net"
    for name, target, speed, state in (("ib0", nic_dir / "net/ib0", "200000", "up"),
                                       ("eth0", tmp_path / "devices/pci0000:00/0000:00:03.0/virtio2/net/eth0", "-1", "up"),
                                       ("lo", tmp_path / "devices/virtual/net/lo", "", "unknown"),
                                       ("docker0", tmp_path / "devices/virtual/net/docker0", "", "down")):
        _write(target / "speed", speed)
        _write(target / "operstate", state)
        if "virtual" not in str(target):
            (target / "device").symlink_to(target.parent.parent)
        net.mkdir(parents=True, exist_ok=True)
        (net / name).symlink_to(target)
    (tmp_path / "bus/pci/devices").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:3b:00.0").symlink_to(nic_dir)
    ib = tmp_path / "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/infiniband/mlx5_0"
    ib.mkdir(parents=True)
    (ib / "device").symlink_to(nic_dir)
    (tmp_path / "class/infiniband").mkdir(parents=True)
    (tmp_path / "class/infiniband/mlx5_0").symlink_to(ib)
    # An InfiniBand HCA without IPoIB: no network interface, only its port's rate and state.
    hca_dir = tmp_path / "devices/pci0000:3a/0000:3a:00.0/0000:3c:00.0"
    _write(hca_dir / "numa_node", "1")
    (tmp_path / "bus/pci/devices/0000:3c:00.0").symlink_to(hca_dir)
    hca = hca_dir / "infiniband/mlx5_1"
    _write(hca / "ports/1/rate", "400 Gb/sec (4X NDR)")
    _write(hca / "ports/1/state", "4: ACTIVE")
    (hca / "device").symlink_to(hca_dir)
    (tmp_path / "class/infiniband/mlx5_1").symlink_to(hca)
    _write(tmp_path / "devices/system/cpu/possible", "0-255")
    return tmp_path


def test_numa_nodes_with_cpus_are_read_from_sysfs(sysfs: Path) -> None:
    assert host_layout.numa_nodes(str(sysfs)) == {"0": "0-3", "1": "4-7"}
    assert "unknown" in host_layout.numa_nodes(str(sysfs / "missing"))


def test_nics_carry_speed_pci_place_numa_node_and_rdma_device(sysfs: Path) -> None:
    by_name = {n["name"]: n for n in host_layout.nics(str(sysfs))}
    assert by_name["ib0"] == {"name": "ib0", "up": True, "speed_mbps": 200000, "virtual": False,
                              "pci_bus_id": "0000:3b:00.0", "numa_node": 1, "rdma": ["mlx5_0"]}
    assert by_name["eth0"]["speed_mbps"] is None and by_name["eth0"]["pci_bus_id"] == "0000:00:03.0"
    assert by_name["eth0"]["rdma"] == [] and by_name["lo"]["virtual"] and by_name["docker0"]["up"] is False
    assert host_layout.pci_numa_node("00000000:3B:00.0", str(sysfs)) == 1  # NVML's 8-digit domain form
    assert by_name["mlx5_1"] == {"name": "mlx5_1", "up": True, "speed_mbps": 400000, "virtual": False,
                                 "pci_bus_id": "0000:3c:00.0", "numa_node": 1, "rdma": ["mlx5_1"]}
    assert host_layout.cpu_slots(str(sysfs)) == 256  # possible CPUs, not only the online ones


def test_this_process_placement_is_its_real_affinity() -> None:
    nodes = host_layout.numa_nodes()
    placement = host_layout.process_placement(nodes)
    assert host_layout.parse_cpulist(placement["cpus"]) == os.sched_getaffinity(0)
    assert placement["numa_nodes"] and all(str(n) in nodes for n in placement["numa_nodes"])


@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1))
def test_cpulists_round_trip(cpus: set[int]) -> None:
    assert host_layout.parse_cpulist(host_layout.cpulist(cpus)) == cpus


class NotSupported(Exception):
    pass


def fake_pynvml() -> types.SimpleNamespace:
    """Two A100s joined by 4 direct NVLinks (links 0-3), on NUMA 1, 128 host CPUs."""
    buses = [b"00000000:07:00.0", b"00000000:0F:00.0"]

    def link_state(h: int, link: int) -> int:
        if link >= 12:
            raise NotSupported("Invalid Argument")
        return 1 if link < 4 else 0

    def remote(h: int, link: int) -> Any:
        return types.SimpleNamespace(busId=buses[1 - h])

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetName=lambda h: "NVIDIA A100-SXM4-80GB",
        nvmlDeviceGetPciInfo_v3=lambda h: types.SimpleNamespace(busId=buses[h]),
        nvmlDeviceGetNumaNodeId=lambda h: 1,
        nvmlDeviceGetCpuAffinity=lambda h, words: [0, 0xFFFF0000 if words == 2 else 0][:words],
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1, nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4,
        nvmlDeviceGetGpuMaxPcieLinkGeneration=lambda h: 4, nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16, nvmlDeviceGetPcieReplayCounter=lambda h: 0,
        nvmlDeviceGetNvLinkState=link_state, nvmlDeviceGetNvLinkVersion=lambda h, link: 5,  # NVLink 3.1's code
        nvmlDeviceGetNvLinkRemotePciInfo=remote, nvmlDeviceGetNvLinkRemoteDeviceType=lambda h, link: 0,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 20,
        nvmlDeviceGetP2PStatus=lambda a, b, index: {0: 0, 1: 0, 2: 4}[index],
        NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=36, NVML_P2P_CAPS_INDEX_READ=(0,),  # as nvidia-ml-py 13 has them
        NVML_P2P_CAPS_INDEX_WRITE=1, NVML_P2P_CAPS_INDEX_NVLINK=2,
    )


@pytest.fixture()
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_module", fake_pynvml)
    monkeypatch.setattr(nvml, "_state", {"initialised": False, "error": None})


def test_gpu_topology_is_rebuilt_from_nvml(fake_nvml: None) -> None:
    topo = topology_reading.read_gpu_topology(host_cpus=128)
    first = topo["gpus"][0]
    assert first["cpu_affinity"] == "80-95" and first["numa_node"] == 1  # bits 16-31 of the second 64-bit word
    assert [link["link"] for link in first["nvlinks"]] == list(range(12))  # stops where NVML says no such link
    assert sum(link["active"] for link in first["nvlinks"]) == 4
    assert first["nvlinks"][0] == {"link": 0, "active": True, "version": 5, "remote_bus_id": "00000000:0F:00.0",
                                   "remote_type": "gpu"}
    assert first["pcie_idle"] == {"gen": 1, "max_gen": 4, "gpu_max_gen": 4, "width": 16, "max_width": 16,
                                  "replay_counter": 0}
    assert topo["pairs"] == [{"a": 0, "b": 1, "level": "PXB", "p2p_read": "OK", "p2p_write": "OK",
                              "p2p_nvlink": "DISABLED", "torch_peer": None}]


def test_without_nvml_the_topology_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise ImportError("no pynvml")
    monkeypatch.setattr(nvml, "_module", broken)
    monkeypatch.setattr(nvml, "_state", {"initialised": False, "error": None})
    assert topology_reading.read_gpu_topology(4) == {"unknown": "the pynvml module (package nvidia-ml-py) is not installed"}


def test_a_cpu_rank_has_no_link_to_load() -> None:
    import torch

    assert topology_reading.read_link_under_load(torch.device("cpu"), None) is None
