"""One device's facts as the homogeneity probe and `ddpdoctor snapshot` record them.

A rank reads its own device; a snapshot reads every device of the node the same way,
so a diagnosis cannot tell (and need not care) whether facts came from a live run or
from a file attached to a bug report.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpdoctor.measure import gpu_health
from ddpdoctor.measure.host import read_env, read_host, read_software, read_torch_gpu

# Re-read after the GPU has worked: an idle GPU reports idle clocks and no throttling.
LOAD_DEPENDENT = ("clocks", "clock_event_reasons", "power", "temperature_c", "pcie", "performance_state")


def read_device_facts(device: Any) -> dict[str, Any]:
    system = gpu_health.read_system()
    software = read_software()
    software["driver"] = system.get("driver_version")
    software["cuda_driver"] = system.get("cuda_driver_version")
    return {
        "device": str(device),
        "software": software,
        "host_hw": read_host() | {"node_gpus": system.get("gpu_count")},
        "gpu": _gpu(device) if getattr(device, "type", "cpu") == "cuda" else None,
        "env": read_env(),
    }


def _gpu(device: Any) -> dict[str, Any]:
    """CUDA's view (name, SMs) merged with NVML's (health, clocks); CUDA's wins on SM count."""
    cuda = read_torch_gpu(device.index if device.index is not None else 0)
    facts: dict[str, Any] = dict(cuda)
    if cuda.get("uuid"):
        nvml = gpu_health.read_gpu(cuda["uuid"])
        for key, value in nvml.items():
            if key not in facts or facts[key] is None:
                facts[key] = value
            elif key == "memory_total_bytes" and isinstance(value, int):
                facts[key] = value  # NVML's is the board's; CUDA's subtracts what the driver reserves
        if "unknown" not in nvml:
            facts.update(gpu_health.read_modes(cuda["uuid"]))
    return facts


def read_gpu_state(uuid: Optional[str]) -> dict[str, Any]:
    if not uuid:
        return {}
    fresh = gpu_health.read_gpu(uuid) | gpu_health.read_modes(uuid)
    return {key: fresh[key] for key in LOAD_DEPENDENT if key in fresh}
