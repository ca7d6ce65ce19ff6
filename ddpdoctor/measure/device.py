"""Reading what a rank's process can see of GPUs: the environment, torch and NVML.

Reading only: nothing here judges. Each source is recorded as it is, with a reason
where it cannot be read, so the diagnosis (and the tests, on recorded snapshots) can
compare them. Devices are identified by UUID and PCI bus id, never by index alone:
NVML ignores CUDA_VISIBLE_DEVICES and orders by PCI bus, CUDA orders fastest first.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from ddpdoctor.measure import nvml

ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
            "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_NTASKS_PER_NODE",
            "SLURM_GPUS_PER_TASK")


def read_env(environ: Mapping[str, str] = os.environ) -> dict[str, Optional[str]]:
    return {key: environ.get(key) for key in ENV_KEYS}


def _pci_bus_id(domain: int, bus: int, device: int) -> str:
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def read_torch(current_index: Optional[int]) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"version": torch.__version__, "cuda_built": torch.version.cuda,
                             "cuda_available": False, "device_count": 0, "unavailable_reason": None,
                             "current": None, "devices": []}
    if torch.version.cuda is None:
        facts["unavailable_reason"] = "torch was built without CUDA (a CPU-only wheel)"
        return facts
    facts["cuda_available"] = torch.cuda.is_available()
    if not facts["cuda_available"]:
        try:
            torch.cuda.init()
        except Exception as exc:  # e.g. "Found no NVIDIA driver on your system"
            facts["unavailable_reason"] = str(exc).strip().splitlines()[0][:300]
        return facts
    facts["device_count"] = torch.cuda.device_count()
    for index in range(facts["device_count"]):
        props = torch.cuda.get_device_properties(index)
        facts["devices"].append({
            "index": index, "name": props.name,
            "uuid": f"GPU-{props.uuid}" if getattr(props, "uuid", None) else None,
            # torch's stubs omit the pci_* properties its CUDA binding has (checked by hasattr below)
            "pci_bus_id": _pci_bus_id(props.pci_domain_id, props.pci_bus_id,  # type: ignore[attr-defined]
                                      props.pci_device_id)  # type: ignore[attr-defined]
            if hasattr(props, "pci_bus_id") else None,
        })
    if current_index is not None and current_index < len(facts["devices"]):
        facts["current"] = facts["devices"][current_index]
    return facts


def read_nvml() -> dict[str, Any]:
    problem = nvml.init()
    if problem is not None:
        return {"available": False, "reason": problem.reason, "devices": []}
    count = nvml.query("nvmlDeviceGetCount")
    facts: dict[str, Any] = {
        "available": True, "reason": None,
        "driver_version": nvml.plain(nvml.query("nvmlSystemGetDriverVersion", convert=nvml.text)),
        "cuda_driver_version": nvml.plain(nvml.query("nvmlSystemGetCudaDriverVersion_v2")),
        "device_count": nvml.plain(count), "devices": [],
    }
    if isinstance(count, nvml.Unknown):
        return facts
    for index in range(int(count)):
        handle = nvml.query("nvmlDeviceGetHandleByIndex", index)
        if isinstance(handle, nvml.Unknown):
            facts["devices"].append({"index": index, "error": handle.reason})
            continue
        processes = nvml.query("nvmlDeviceGetComputeRunningProcesses", handle,
                               convert=lambda ps: [{"pid": int(p.pid), "used_bytes": _used(p)} for p in ps])
        facts["devices"].append({
            "index": index,
            "uuid": nvml.plain(nvml.query("nvmlDeviceGetUUID", handle, convert=nvml.text)),
            "pci_bus_id": nvml.plain(nvml.query("nvmlDeviceGetPciInfo_v3", handle,
                                                convert=lambda info: _bus_id(nvml.text(info.busId)))),
            "name": nvml.plain(nvml.query("nvmlDeviceGetName", handle, convert=nvml.text)),
            "mig_mode": nvml.plain(nvml.query("nvmlDeviceGetMigMode", handle, convert=lambda m: int(m[0]))),
            "processes": nvml.plain(processes),
        })
    return facts


def _used(process: Any) -> Optional[int]:
    value = getattr(process, "usedGpuMemory", None)
    return int(value) if isinstance(value, int) and value >= 0 and value < 2**63 else None


def _bus_id(text: str) -> str:
    """NVML says 00000000:18:00.0; torch builds the same form: compare them as equals."""
    return text.upper()


def contexts_of(pid: int, nvml_facts: Mapping[str, Any]) -> Any:
    """UUIDs of the GPUs on which process `pid` holds a compute context, per NVML."""
    if not nvml_facts.get("available"):
        return {"unknown": nvml_facts.get("reason")}
    found = []
    for device in nvml_facts.get("devices", []):
        processes = device.get("processes")
        if isinstance(processes, list) and any(p.get("pid") == pid for p in processes):
            found.append(device.get("uuid"))
    return found
