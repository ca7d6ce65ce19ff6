"""Reading a GPU's health through NVML: ECC, retired pages, remapped rows, power, clocks, PCIe.

Reading only: nothing here judges. A separate diagnosis compares the facts (a power cap
below the default, a thermal slowdown, a pending row remap); the PCIe link is recorded
here, but judging it needs a reading under load, which is the topology probe's job.
Any call may fail and "not available" is a value, never an error: an idle GPU drops its
clocks and PCIe link, consumer boards have no ECC, Hopper reports remapped rows but not
retired pages, and each driver branch adds, renames or removes functions (the clock
"throttle" reasons became "event" reasons; application clocks are deprecated). So every
leaf is read on its own, through `nvml.query`, and one that fails is `{"unknown": reason}`.
A composite that comes from a single call (ECC mode, remapped rows, clock event reasons)
fails as a whole; one made of several calls (power, clocks, PCIe) fails leaf by leaf.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ddpdoctor.measure import nvml

Facts = dict[str, Any]

# Stable name, pynvml constant suffix, documented bit value (nvml.h).
_REASONS: tuple[tuple[str, str, int], ...] = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
    ("board_limit", "BoardLimit", 0x200),  # throttle-reason family only (nvml.h, R535+)
    ("reliability", "Reliability", 0x400),
)


def _constant(default: int, *names: str) -> int:
    """The first of the named pynvml constants the bindings define, else the documented value."""
    try:
        module = nvml._module()
    except ImportError:
        return default
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    return default


def _first(functions: Sequence[str], *args: Any, convert: Callable[[Any], Any] = lambda v: v) -> nvml.Value:
    """The first of several spellings (old and new driver branches) that answers."""
    reasons = []
    for function in functions:
        value = nvml.query(function, *args, convert=convert)
        if not isinstance(value, nvml.Unknown):
            return value
        reasons.append(value.reason)
    return nvml.Unknown("; ".join(reasons))


def _read(function: str, *args: Any, convert: Callable[[Any], Any] = lambda v: v) -> Any:
    return nvml.plain(nvml.query(function, *args, convert=convert))


def _enabled(state: Any) -> bool:
    return int(state) == _constant(1, "NVML_FEATURE_ENABLED")


def _watts(milliwatts: Any) -> float:
    return int(milliwatts) / 1000.0


def _version(value: Any) -> str:
    """NVML encodes CUDA 12.4 as 12040 (1000 * major + 10 * minor)."""
    return f"{int(value) // 1000}.{int(value) % 1000 // 10}"


def _reason_bits() -> list[tuple[str, int]]:
    return [(name, _constant(bit, f"nvmlClocksEventReason{suffix}", f"nvmlClocksThrottleReason{suffix}"))
            for name, suffix, bit in _REASONS]


def _reason_names(mask: int) -> list[str]:
    bits = _reason_bits()
    names = [name for name, bit in bits if mask & bit]
    rest = mask & ~sum({bit for _, bit in bits})
    names += [f"unknown_{1 << i:#x}" for i in range(rest.bit_length()) if rest >> i & 1]
    return names


def clock_event_reasons(handle: Any) -> Any:
    # The newer spelling first; the older one is deprecated in the bindings ("removed in CUDA 14.0").
    functions = ["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"]
    return nvml.plain(_first(functions, handle,
                             convert=lambda mask: {"mask": int(mask), "active": _reason_names(int(mask))}))


def _clocks(handle: Any) -> Facts:
    sm, mem = _constant(1, "NVML_CLOCK_SM"), _constant(2, "NVML_CLOCK_MEM")
    facts: Facts = {}
    for prefix, function in (("", "nvmlDeviceGetClockInfo"), ("app_", "nvmlDeviceGetApplicationsClock"),
                             ("default_app_", "nvmlDeviceGetDefaultApplicationsClock"),
                             ("max_", "nvmlDeviceGetMaxClockInfo")):
        facts[f"{prefix}sm_mhz"] = _read(function, handle, sm, convert=int)
        facts[f"{prefix}mem_mhz"] = _read(function, handle, mem, convert=int)
    return facts


def _power(handle: Any) -> Facts:
    return {"limit_w": _read("nvmlDeviceGetPowerManagementLimit", handle, convert=_watts),
            "default_w": _read("nvmlDeviceGetPowerManagementDefaultLimit", handle, convert=_watts),
            "enforced_w": _read("nvmlDeviceGetEnforcedPowerLimit", handle, convert=_watts),
            "draw_w": _read("nvmlDeviceGetPowerUsage", handle, convert=_watts)}


def _ecc_uncorrected(handle: Any) -> Facts:
    uncorrected = _constant(1, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
    return {"volatile": _read("nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                              _constant(0, "NVML_VOLATILE_ECC"), convert=int),
            "aggregate": _read("nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                               _constant(1, "NVML_AGGREGATE_ECC"), convert=int)}


def _retired_pages(handle: Any) -> Facts:
    single = _constant(0, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS")
    double = _constant(1, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")
    return {"pending": _read("nvmlDeviceGetRetiredPagesPendingStatus", handle, convert=_enabled),
            "single_bit": _read("nvmlDeviceGetRetiredPages", handle, single, convert=len),
            "double_bit": _read("nvmlDeviceGetRetiredPages", handle, double, convert=len)}


def _remapped_rows(rows: Any) -> Facts:
    correctable, uncorrectable, pending, failed = rows
    return {"correctable": int(correctable), "uncorrectable": int(uncorrectable),
            "pending": bool(pending), "failed": bool(failed)}


def _pcie(handle: Any) -> Facts:
    return {"gen": _read("nvmlDeviceGetCurrPcieLinkGeneration", handle, convert=int),
            "max_gen": _read("nvmlDeviceGetMaxPcieLinkGeneration", handle, convert=int),
            "width": _read("nvmlDeviceGetCurrPcieLinkWidth", handle, convert=int),
            "max_width": _read("nvmlDeviceGetMaxPcieLinkWidth", handle, convert=int)}


def _read_handle(handle: Any, index: Optional[int]) -> Facts:
    nvml_index = index if index is not None else _read("nvmlDeviceGetIndex", handle, convert=int)
    return {
        "nvml_index": nvml_index,
        "uuid": _read("nvmlDeviceGetUUID", handle, convert=nvml.text),
        "pci_bus_id": _read("nvmlDeviceGetPciInfo_v3", handle, convert=lambda info: nvml.text(info.busId).upper()),
        "name": _read("nvmlDeviceGetName", handle, convert=nvml.text),
        "memory_total_bytes": _read("nvmlDeviceGetMemoryInfo", handle, convert=lambda m: int(m.total)),
        "compute_capability": _read("nvmlDeviceGetCudaComputeCapability", handle,
                                    convert=lambda cc: f"{int(cc[0])}.{int(cc[1])}"),
        "ecc_mode": _read("nvmlDeviceGetEccMode", handle,
                          convert=lambda m: {"current": _enabled(m[0]), "pending": _enabled(m[1])}),
        "ecc_uncorrected": _ecc_uncorrected(handle),
        "retired_pages": _retired_pages(handle),
        "remapped_rows": _read("nvmlDeviceGetRemappedRows", handle, convert=_remapped_rows),
        "power": _power(handle),
        "clocks": _clocks(handle),
        "clock_event_reasons": clock_event_reasons(handle),
        "persistence_mode": _read("nvmlDeviceGetPersistenceMode", handle, convert=_enabled),
        "temperature_c": nvml.plain(_first(["nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"], handle,
                                           _constant(0, "NVML_TEMPERATURE_GPU"), convert=int)),
        "pcie": _pcie(handle),
    }


def _performance_state(state: Any) -> str:
    """NVML's 0..15 as nvidia-smi prints it ("P0"); 32 is NVML_PSTATE_UNKNOWN."""
    if int(state) > 15:
        raise ValueError(f"performance state unknown ({int(state)})")
    return f"P{int(state)}"


def _modes(handle: Any) -> Facts:
    return {"performance_state": _read("nvmlDeviceGetPerformanceState", handle, convert=_performance_state),
            "mig_mode": _read("nvmlDeviceGetMigMode", handle,
                              convert=lambda m: {"current": _enabled(m[0]), "pending": _enabled(m[1])})}


def read_modes(uuid: str) -> Facts:
    """The GPU's performance state (P0 under load, P8 and up idle) and MIG mode, read apart from
    `read_gpu` so what it records keeps its keys; {} when the GPU cannot be found.

    Why: a PCIe link below its maximum is normal power saving in an idle P-state and a fault in
    P0, and a GPU in MIG mode gives a rank a slice, not the GPU (`nvidia-smi -q` shows both)."""
    handle = nvml.query("nvmlDeviceGetHandleByUUID", uuid)
    return {} if isinstance(handle, nvml.Unknown) else _modes(handle)


def read_gpu(uuid: str) -> Facts:
    """Health facts of the GPU with this UUID ("GPU-…"), or {"uuid", "unknown"} when it cannot be found."""
    handle = nvml.query("nvmlDeviceGetHandleByUUID", uuid)
    if isinstance(handle, nvml.Unknown):
        return {"uuid": uuid, "unknown": handle.reason}
    return _read_handle(handle, None)


def read_all_gpus() -> list[Facts]:
    """Health facts of every GPU NVML sees, in NVML (PCI bus) order; [] when NVML cannot be used."""
    count = nvml.query("nvmlDeviceGetCount", convert=int)
    if isinstance(count, nvml.Unknown):
        return []
    gpus = []
    for index in range(count):
        handle = nvml.query("nvmlDeviceGetHandleByIndex", index)
        if isinstance(handle, nvml.Unknown):
            gpus.append({"nvml_index": index, "unknown": handle.reason})
        else:
            gpus.append(_read_handle(handle, index))
    return gpus


def read_system() -> Facts:
    """The driver and CUDA driver versions and the GPU count, or why NVML cannot be used."""
    problem = nvml.init()
    return {
        "available": problem is None,
        "reason": None if problem is None else problem.reason,
        "driver_version": _read("nvmlSystemGetDriverVersion", convert=nvml.text),
        "cuda_driver_version": _read("nvmlSystemGetCudaDriverVersion_v2", convert=_version),
        "gpu_count": _read("nvmlDeviceGetCount", convert=int),
    }
