"""Reading a node's GPU topology through NVML, and one GPU's PCIe link under load. Reading only.

What `nvidia-smi topo -m` prints is rebuilt from NVML: the common PCIe ancestor of each
pair, the NVLinks of each GPU (state, version, what is at the other end), and the
peer-to-peer status NVML reports for each pair. Every call goes through `nvml.query`, so a
driver that lacks one gives a value saying so. The PCIe link is also read at idle, but
an idle GPU lowers its link speed on purpose: only `read_link_under_load` is judged.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ddpdoctor.measure import nvml
from ddpdoctor.measure.gpu_health import _constant, _read
from ddpdoctor.measure.host_layout import cpulist, pci_numa_node

# NVML_TOPOLOGY_* (nvml.h) → the letters `nvidia-smi topo -m` prints for that level.
LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# NVML_P2P_STATUS_* → `nvidia-smi topo -p2p` letters.
P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DISABLED", 5: "NS", 6: "U"}
NVLINK_REMOTE = {0: "gpu", 1: "ibmnpu", 2: "switch"}
LOAD_SECONDS = 0.25
COPY_BYTES = 64 << 20


def _bus_id(info: Any) -> str:
    return nvml.text(info.busId).upper()


def _affinity(handle: Any, cpus: int) -> Any:
    """NVML's CPU mask for the GPU (64 CPUs per word) as a cpulist."""
    words = max(1, (cpus + 63) // 64)

    def decode(mask: Any) -> str:
        return cpulist(64 * w + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1)

    return _read("nvmlDeviceGetCpuAffinity", handle, words, convert=decode)


def _nvlinks(handle: Any) -> list[dict[str, Any]]:
    """The links that answer: a GPU without NVLink answers none ("not supported")."""
    links = []
    enabled = _constant(1, "NVML_FEATURE_ENABLED")
    for link in range(int(_constant(18, "NVML_NVLINK_MAX_LINKS"))):
        state = nvml.query("nvmlDeviceGetNvLinkState", handle, link)
        if isinstance(state, nvml.Unknown):
            continue
        remote_type = nvml.query("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        links.append({
            "link": link, "active": int(state) == enabled,
            "version": _read("nvmlDeviceGetNvLinkVersion", handle, link, convert=int),
            "remote_bus_id": _read("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, convert=_bus_id),
            "remote_type": (NVLINK_REMOTE.get(int(remote_type), f"type {int(remote_type)}")
                            if not isinstance(remote_type, nvml.Unknown) else nvml.plain(remote_type)),
        })
    return links


def _pcie(handle: Any) -> dict[str, Any]:
    return {"gen": _read("nvmlDeviceGetCurrPcieLinkGeneration", handle, convert=int),
            "max_gen": _read("nvmlDeviceGetMaxPcieLinkGeneration", handle, convert=int),
            "gpu_max_gen": _read("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle, convert=int),
            "width": _read("nvmlDeviceGetCurrPcieLinkWidth", handle, convert=int),
            "max_width": _read("nvmlDeviceGetMaxPcieLinkWidth", handle, convert=int),
            "replay_counter": _read("nvmlDeviceGetPcieReplayCounter", handle, convert=int)}


def _gpu(index: int, handle: Any, host_cpus: int) -> dict[str, Any]:
    bus = _read("nvmlDeviceGetPciInfo_v3", handle, convert=_bus_id)
    numa = _read("nvmlDeviceGetNumaNodeId", handle, convert=int)
    if not isinstance(numa, int) or numa < 0:
        numa = pci_numa_node(bus) if isinstance(bus, str) else None  # older drivers: sysfs knows
    return {"index": index, "uuid": _read("nvmlDeviceGetUUID", handle, convert=nvml.text),
            "name": _read("nvmlDeviceGetName", handle, convert=nvml.text), "pci_bus_id": bus,
            "numa_node": numa, "cpu_affinity": _affinity(handle, host_cpus), "pcie_idle": _pcie(handle),
            "nvlinks": _nvlinks(handle)}


def _pair(a: int, b: int, ha: Any, hb: Any, torch_peer: dict[tuple[int, int], bool]) -> dict[str, Any]:
    level = nvml.query("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
    pair: dict[str, Any] = {"a": a, "b": b,
                            "level": LEVELS.get(int(level), f"level {int(level)}")
                            if not isinstance(level, nvml.Unknown) else nvml.plain(level)}
    for key, index in (("p2p_read", _constant(0, "NVML_P2P_CAPS_INDEX_READ")),
                       ("p2p_write", _constant(1, "NVML_P2P_CAPS_INDEX_WRITE")),
                       ("p2p_nvlink", _constant(2, "NVML_P2P_CAPS_INDEX_NVLINK"))):
        pair[key] = _read("nvmlDeviceGetP2PStatus", ha, hb, index, convert=lambda s: P2P_STATUS.get(int(s), str(s)))
    pair["torch_peer"] = torch_peer.get((a, b))
    return pair


def _torch_peers(uuids: list[Any]) -> tuple[dict[tuple[int, int], bool], Optional[str]]:
    """torch.cuda.can_device_access_peer for each NVML pair that CUDA also sees.

    CUDA's indices differ from NVML's (fastest first, CUDA_VISIBLE_DEVICES): matched by UUID.
    The query asks the driver; it creates no context on either device.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return {}, None
        cuda_index = {}
        for i in range(torch.cuda.device_count()):
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
            if uuid is not None:
                cuda_index[f"GPU-{uuid}"] = i
        out: dict[tuple[int, int], bool] = {}
        for a, ua in enumerate(uuids):
            for b, ub in enumerate(uuids):
                if a < b and ua in cuda_index and ub in cuda_index:
                    out[(a, b)] = bool(torch.cuda.can_device_access_peer(cuda_index[ua], cuda_index[ub]))
        return out, None
    except Exception as exc:  # a broken CUDA install is itself a fact
        return {}, f"{type(exc).__name__}: {exc}"


def read_gpu_topology(host_cpus: int) -> dict[str, Any]:
    """Every GPU NVML sees on this node and every pair between them; {"unknown"} without NVML."""
    problem = nvml.init()
    if problem is not None:
        return {"unknown": problem.reason}
    count = nvml.query("nvmlDeviceGetCount", convert=int)
    if isinstance(count, nvml.Unknown):
        return {"unknown": count.reason}
    handles = [nvml.query("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
    gpus = [_gpu(i, h, host_cpus) if not isinstance(h, nvml.Unknown) else {"index": i, "unknown": h.reason}
            for i, h in enumerate(handles)]
    peers, peer_error = _torch_peers([g.get("uuid") for g in gpus])
    pairs = [_pair(a, b, handles[a], handles[b], peers) for a in range(count) for b in range(a + 1, count)
             if not isinstance(handles[a], nvml.Unknown) and not isinstance(handles[b], nvml.Unknown)]
    return {"gpus": gpus, "pairs": pairs, "torch_peer_error": peer_error}


def read_link_under_load(device: Any, uuid: Optional[str], seconds: float = LOAD_SECONDS) -> Optional[dict[str, Any]]:
    """This rank's GPU's PCIe link read while host↔device copies keep it busy, and their speed.

    The copies are the load that matters for the link (a matmul alone may leave it in a
    low-power state), and their GB/s is the measured evidence beside the negotiated
    generation and width. None on a CPU rank.
    """
    if getattr(device, "type", "cpu") != "cuda" or not uuid:
        return None
    import torch

    handle = nvml.query("nvmlDeviceGetHandleByUUID", uuid)
    if isinstance(handle, nvml.Unknown):
        return {"unknown": handle.reason}
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    replay_before = _read("nvmlDeviceGetPcieReplayCounter", handle, convert=int)
    best: dict[str, Any] = {}
    h2d: list[float] = []
    d2h: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or not h2d:
        for target, source, times in ((gpu, host, h2d), (host, gpu, d2h)):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        reading = _pcie(handle)  # read right after a copy: the link is at its loaded state
        for key in ("gen", "width", "max_gen", "gpu_max_gen", "max_width"):
            if isinstance(reading[key], int) and reading[key] > best.get(key, -1):
                best[key] = reading[key]  # a value NVML did not give is left out, not judged
    replay_after = _read("nvmlDeviceGetPcieReplayCounter", handle, convert=int)
    del host, gpu
    torch.cuda.empty_cache()  # give the 64 MiB back before the workload measures its memory
    return {"pcie": best, "copies": len(h2d),
            "h2d_gbps": round(COPY_BYTES / min(h2d) / 1e9, 2), "d2h_gbps": round(COPY_BYTES / min(d2h) / 1e9, 2),
            "replays_during_load": replay_after - replay_before
            if isinstance(replay_after, int) and isinstance(replay_before, int) else None}
