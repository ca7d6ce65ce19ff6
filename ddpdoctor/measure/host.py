"""Reading the software stack and the host a rank runs on. Reading only: nothing judges here.

Versions are read from the libraries the rank really loaded (torch's own CUDA and NCCL),
not from what pip says is installed: a job that mixes a conda NCCL with a pip torch is
exactly the case that breaks.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Mapping, Optional

from ddpdoctor.core.findings import rank_ranges
from ddpdoctor.core.redact import relevant_env


def _unknown(reason: str) -> dict[str, str]:
    return {"unknown": reason}


def read_software() -> dict[str, Any]:
    import torch

    nccl: Any = _unknown("torch was built without NCCL")
    try:
        if torch.distributed.is_nccl_available():
            version = torch.cuda.nccl.version()
            nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # a broken NCCL library is itself a fact
        text = str(exc).strip()
        nccl = _unknown(f"NCCL version unreadable: {text.splitlines()[0][:200] if text else type(exc).__name__}")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda_runtime": torch.version.cuda,  # None for a CPU-only build
        "nccl": nccl,
        "os": _os_name(),
        "kernel": platform.release(),
    }


def _os_name() -> str:
    try:
        info = platform.freedesktop_os_release()
        return info.get("PRETTY_NAME") or info.get("NAME") or platform.system()
    except (OSError, AttributeError):
        return f"{platform.system()} {platform.release()}"


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def read_host() -> dict[str, Any]:
    import psutil
    import torch

    try:
        usable = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = list(range(os.cpu_count() or 1))
    return {
        "cpu_model": _cpu_model(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "cpu_logical_cores": psutil.cpu_count(logical=True),
        "cpus_usable": len(usable),  # this process's affinity: what a cgroup or srun gave it
        "cpu_affinity": rank_ranges(usable),  # which ones: ranks pinned apart do not compete
        "ram_bytes": int(psutil.virtual_memory().total),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


# Variables ddpdoctor sets in a rank for its own use (NCCL's TUNING log for the bench), with the
# user's value from before (None: unset). The environment facts are the user's, not ours: a
# setting only rank 0 got from us would otherwise be reported as a difference between ranks.
_OURS: dict[str, Optional[str]] = {}


def set_for_ourselves(values: Mapping[str, str]) -> None:
    for name, value in values.items():
        _OURS.setdefault(name, os.environ.get(name))
        os.environ[name] = value


def users_environ() -> dict[str, str]:
    """This process's environment as the user gave it: what ddpdoctor set for itself put back."""
    environ = dict(os.environ)
    for name, before in _OURS.items():
        if before is None:
            environ.pop(name, None)
        else:
            environ[name] = before
    return environ


def read_env() -> dict[str, str]:
    return relevant_env(users_environ())


def read_torch_gpu(index: int) -> dict[str, Any]:
    """What CUDA itself reports for one device (NVML has no SM count)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "uuid": f"GPU-{props.uuid}" if getattr(props, "uuid", None) else None,
        "memory_total_bytes": int(props.total_memory),
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": int(props.multi_processor_count),
    }


def boot_id() -> Optional[str]:
    """This kernel's boot id: the one machine behind host names. Two containers (or simulated
    nodes) on one host have their own host names and this same id, and share its cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def machine_identity() -> str:
    """This kernel's boot id and this process's pid namespace: where a pid is meaningful."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return f"{boot_id() or '?'}/{namespace}"
