"""CUDA versions as the driver and torch state them, compared.

The driver reports the newest CUDA it supports as one integer, 1000 * major + 10 * minor
(`cuDriverGetVersion`, NVML's `nvmlSystemGetCudaDriverVersion`, and torch's "found version 12080"),
while torch states the CUDA it was built for as text (`torch.version.cuda`, "12.1"). A driver whose
CUDA is older than torch's cannot run torch's CUDA runtime: that is "The NVIDIA driver on your system is
too old" and "CUDA driver version is insufficient for CUDA runtime version" (cudaErrorInsufficientDriver, 35).
Shared by the gpu-count probe (NVML against torch) and `explain` (the number in torch's message)."""

from __future__ import annotations

from typing import Optional


def driver_cuda(code: object) -> Optional[tuple[int, int]]:
    """(major, minor) of the driver's integer CUDA version (12080 -> (12, 8)); None if it is not one."""
    try:
        value = int(str(code))
    except ValueError:
        return None
    if value < 1000:
        return None
    return value // 1000, (value % 1000) // 10


def built_cuda(text: object) -> Optional[tuple[int, int]]:
    """(major, minor) of torch.version.cuda ("12.1" -> (12, 1)); None for a CPU build or odd text."""
    parts = str(text or "").split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def words(version: Optional[tuple[int, int]]) -> str:
    return f"CUDA {version[0]}.{version[1]}" if version else "CUDA ?"


def driver_too_old(driver_code: object, torch_cuda: object) -> bool:
    """The driver supports an older CUDA than torch was built for. Minor versions count too: CUDA's
    minor-version compatibility runs most of a newer minor on an older driver of the same major, but
    not all of it (PTX from a newer toolkit is refused), and torch warns there; the major is what fails
    at once."""
    have, need = driver_cuda(driver_code), built_cuda(torch_cuda)
    return have is not None and need is not None and have < need
