"""gpu_health reads NVML through a fake pynvml modelled on an idle H100 80GB HBM3 (no GPU needed)."""

from __future__ import annotations

import copy
import types
from typing import Any, Optional

import pytest

from ddpdoctor.measure import gpu_health
from ddpdoctor.measure import nvml


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: str() is NVML's error string."""


CONSTANTS: dict[str, int] = {
    "NVML_FEATURE_DISABLED": 0, "NVML_FEATURE_ENABLED": 1, "NVML_TEMPERATURE_GPU": 0,
    "NVML_VOLATILE_ECC": 0, "NVML_AGGREGATE_ECC": 1,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_CLOCK_GRAPHICS": 0, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2,
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
}
REASON_SUFFIXES = {"GpuIdle": 0x1, "ApplicationsClocksSetting": 0x2, "SwPowerCap": 0x4, "HwSlowdown": 0x8,
                   "SyncBoost": 0x10, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
                   "HwPowerBrakeSlowdown": 0x80, "DisplayClockSetting": 0x100}
EVENT_CONSTANTS = {f"nvmlClocksEventReason{k}": v for k, v in REASON_SUFFIXES.items()}
THROTTLE_CONSTANTS = {f"nvmlClocksThrottleReason{k}": v for k, v in REASON_SUFFIXES.items()}

SM, MEM = 1, 2
H100: dict[str, Any] = {
    "uuid": "GPU-5f3c2a61-8d4e-4b9a-a1c7-0e2f9d6b3a14", "bus_id": b"00000000:1a:00.0",
    "name": "NVIDIA H100 80GB HBM3", "memory_total": 81559 * 2**20, "cc": (9, 0), "ecc_mode": [1, 1],
    # keyed by (error type, counter type); the corrected ones are there to catch a wrong error type
    "ecc": {(1, 0): 0, (1, 1): 0, (0, 0): 17, (0, 1): 42},
    "retired_pending": 0, "retired": {0: [], 1: []}, "remapped": (0, 0, 0, 0),
    "power_limit": 700000, "power_default": 700000, "power_enforced": 700000, "power_usage": 71234,
    "clock": {SM: 345, MEM: 2619}, "app_clock": {SM: 1755, MEM: 2619},
    "default_app_clock": {SM: 1755, MEM: 2619}, "max_clock": {SM: 1980, MEM: 2619},
    "reasons": 0x1, "persistence": 1, "temperature": 31,
    "pcie_gen": 1, "pcie_max_gen": 5, "pcie_width": 16, "pcie_max_width": 16,  # idle: the link drops to gen 1
}

H100_FACTS: dict[str, Any] = {
    "nvml_index": 0, "uuid": H100["uuid"], "pci_bus_id": "00000000:1A:00.0", "name": "NVIDIA H100 80GB HBM3",
    "memory_total_bytes": 85520809984, "compute_capability": "9.0",
    "ecc_mode": {"current": True, "pending": True},
    "ecc_uncorrected": {"volatile": 0, "aggregate": 0},
    "retired_pages": {"pending": False, "single_bit": 0, "double_bit": 0},
    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failed": False},
    "power": {"limit_w": 700.0, "default_w": 700.0, "enforced_w": 700.0, "draw_w": 71.234},
    "clocks": {"sm_mhz": 345, "mem_mhz": 2619, "app_sm_mhz": 1755, "app_mem_mhz": 2619,
               "default_app_sm_mhz": 1755, "default_app_mem_mhz": 2619, "max_sm_mhz": 1980, "max_mem_mhz": 2619},
    "clock_event_reasons": {"mask": 1, "active": ["gpu_idle"]},
    "persistence_mode": True, "temperature_c": 31,
    "pcie": {"gen": 1, "max_gen": 5, "width": 16, "max_width": 16},
}


def gpu(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(H100), **changes}


def fake_pynvml(gpus: list[dict[str, Any]], *, fail: Optional[dict[str, str]] = None,
                missing: tuple[str, ...] = (), init_error: Optional[str] = None,
                constants: Optional[dict[str, int]] = None) -> types.SimpleNamespace:
    """A pynvml stand-in; handles are indexes; `fail` maps a function to the NVML error it raises."""
    calls: list[str] = []

    def nvmlInit() -> None:
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def by_uuid(uuid: str) -> int:
        for index, g in enumerate(gpus):
            if g["uuid"] == uuid:
                return index
        raise FakeNVMLError("Not Found")

    functions = {
        "nvmlInit": nvmlInit,
        "nvmlSystemGetDriverVersion": lambda: "550.54.15",
        "nvmlSystemGetCudaDriverVersion_v2": lambda: 12040,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i if i < len(gpus) else _raise("Invalid Argument"),
        "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlDeviceGetUUID": lambda h: gpus[h]["uuid"],
        "nvmlDeviceGetPciInfo_v3": lambda h: types.SimpleNamespace(busId=gpus[h]["bus_id"]),
        "nvmlDeviceGetName": lambda h: gpus[h]["name"],
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=gpus[h]["memory_total"], free=1, used=2),
        "nvmlDeviceGetCudaComputeCapability": lambda h: gpus[h]["cc"],
        "nvmlDeviceGetEccMode": lambda h: gpus[h]["ecc_mode"],
        "nvmlDeviceGetTotalEccErrors": lambda h, error, counter: gpus[h]["ecc"][(error, counter)],
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: gpus[h]["retired_pending"],
        "nvmlDeviceGetRetiredPages": lambda h, cause: gpus[h]["retired"][cause],
        "nvmlDeviceGetRemappedRows": lambda h: gpus[h]["remapped"],
        "nvmlDeviceGetPowerManagementLimit": lambda h: gpus[h]["power_limit"],
        "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: gpus[h]["power_default"],
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: gpus[h]["power_enforced"],
        "nvmlDeviceGetPowerUsage": lambda h: gpus[h]["power_usage"],
        "nvmlDeviceGetClockInfo": lambda h, t: gpus[h]["clock"][t],
        "nvmlDeviceGetApplicationsClock": lambda h, t: gpus[h]["app_clock"][t],
        "nvmlDeviceGetDefaultApplicationsClock": lambda h, t: gpus[h]["default_app_clock"][t],
        "nvmlDeviceGetMaxClockInfo": lambda h, t: gpus[h]["max_clock"][t],
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: gpus[h]["reasons"],
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: gpus[h]["reasons"],
        "nvmlDeviceGetPersistenceMode": lambda h: gpus[h]["persistence"],
        "nvmlDeviceGetTemperature": lambda h, sensor: gpus[h]["temperature"] if sensor == 0 else 99,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: gpus[h]["pcie_gen"],
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: gpus[h]["pcie_max_gen"],
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: gpus[h]["pcie_width"],
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: gpus[h]["pcie_max_width"],
    }

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            if fail and name in fail:
                raise FakeNVMLError(fail[name])
            return fn(*args)
        return call

    attributes = {name: wrap(name, fn) for name, fn in functions.items() if name not in missing}
    chosen = {**CONSTANTS, **EVENT_CONSTANTS, **THROTTLE_CONSTANTS} if constants is None else constants
    return types.SimpleNamespace(**chosen, **attributes, calls=calls, NVMLError=FakeNVMLError)


def _raise(message: str) -> Any:
    raise FakeNVMLError(message)


@pytest.fixture(autouse=True)
def fresh_nvml_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test initialises its own fake; monkeypatch puts the state from before back afterwards."""
    monkeypatch.setattr(nvml, "_state", {"initialised": False, "error": None})


def install(monkeypatch: pytest.MonkeyPatch, fake: types.SimpleNamespace) -> types.SimpleNamespace:
    monkeypatch.setattr(nvml, "_module", lambda: fake)
    return fake


def test_healthy_h100_is_read_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()]))
    assert gpu_health.read_all_gpus() == [H100_FACTS]
    assert gpu_health.read_gpu(H100["uuid"]) == H100_FACTS
    assert gpu_health.read_system() == {"available": True, "reason": None, "driver_version": "550.54.15",
                                        "cuda_driver_version": "12.4", "gpu_count": 1}


def test_every_reading_comes_from_its_own_call_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    worn = gpu(uuid="GPU-worn", ecc_mode=[0, 1], ecc={(1, 0): 1, (1, 1): 3, (0, 0): 17, (0, 1): 42},
               retired_pending=1, retired={0: [0x1000, 0x2000], 1: [0x3000]}, remapped=(5, 1, 1, 0),
               power_limit=500000, power_default=700000, power_enforced=450000, power_usage=123456,
               clock={SM: 1410, MEM: 2619}, app_clock={SM: 1500, MEM: 2600}, default_app_clock={SM: 1755, MEM: 2601},
               max_clock={SM: 1980, MEM: 2602}, persistence=0, pcie_gen=4, pcie_width=8)
    install(monkeypatch, fake_pynvml([gpu(), worn]))
    facts = gpu_health.read_gpu("GPU-worn")
    assert facts["nvml_index"] == 1
    assert facts["uuid"] == "GPU-worn"
    assert facts["ecc_mode"] == {"current": False, "pending": True}
    assert facts["ecc_uncorrected"] == {"volatile": 1, "aggregate": 3}
    assert facts["retired_pages"] == {"pending": True, "single_bit": 2, "double_bit": 1}
    assert facts["remapped_rows"] == {"correctable": 5, "uncorrectable": 1, "pending": True, "failed": False}
    assert facts["power"] == {"limit_w": 500.0, "default_w": 700.0, "enforced_w": 450.0, "draw_w": 123.456}
    assert facts["clocks"] == {"sm_mhz": 1410, "mem_mhz": 2619, "app_sm_mhz": 1500, "app_mem_mhz": 2600,
                               "default_app_sm_mhz": 1755, "default_app_mem_mhz": 2601,
                               "max_sm_mhz": 1980, "max_mem_mhz": 2602}
    assert facts["persistence_mode"] is False
    assert facts["pcie"] == {"gen": 4, "max_gen": 5, "width": 8, "max_width": 16}
    assert [g["uuid"] for g in gpu_health.read_all_gpus()] == [H100["uuid"], "GPU-worn"]
    assert [g["nvml_index"] for g in gpu_health.read_all_gpus()] == [0, 1]


@pytest.mark.parametrize("encoded, text", [(12040, "12.4"), (13000, "13.0"), (11080, "11.8"), (12090, "12.9")])
def test_cuda_driver_version_is_major_dot_minor(monkeypatch: pytest.MonkeyPatch, encoded: int, text: str) -> None:
    fake = install(monkeypatch, fake_pynvml([gpu()]))
    fake.nvmlSystemGetCudaDriverVersion_v2 = lambda: encoded
    assert gpu_health.read_system()["cuda_driver_version"] == text


def test_throttle_mask_is_decoded_into_stable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu(reasons=0x8 | 0x40)]))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"] == {
        "mask": 0x48, "active": ["hw_slowdown", "hw_thermal_slowdown"]}


def test_bits_without_a_name_are_kept_as_unknown_hex(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu(reasons=0x4 | 0x200 | 0x800)]))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"] == {
        "mask": 0xA04, "active": ["sw_power_cap", "board_limit", "unknown_0x800"]}


def test_bit_values_come_from_the_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    constants = {**CONSTANTS, **EVENT_CONSTANTS, "nvmlClocksEventReasonSwThermalSlowdown": 0x1000}
    install(monkeypatch, fake_pynvml([gpu(reasons=0x1000 | 0x20)], constants=constants))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"]["active"] == [
        "sw_thermal_slowdown", "unknown_0x20"]


def test_documented_bit_values_when_the_bindings_lack_the_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu(reasons=0x2 | 0x10 | 0x80 | 0x100)], constants=CONSTANTS))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"]["active"] == [
        "applications_clocks_setting", "sync_boost", "hw_power_brake_slowdown", "display_clock_setting"]


def test_unsupported_call_is_unknown_and_the_rest_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, fake_pynvml([gpu()], fail={"nvmlDeviceGetEccMode": "Not Supported",
                                                           "nvmlDeviceGetApplicationsClock": "Not Supported"}))
    facts = gpu_health.read_gpu(H100["uuid"])
    assert facts["ecc_mode"] == {"unknown": "nvmlDeviceGetEccMode: Not Supported"}
    app_unknown = {"unknown": "nvmlDeviceGetApplicationsClock: Not Supported"}
    assert facts["clocks"] == {**H100_FACTS["clocks"], "app_sm_mhz": app_unknown, "app_mem_mhz": app_unknown}
    untouched = {k: v for k, v in H100_FACTS.items() if k not in ("ecc_mode", "clocks")}
    assert {k: v for k, v in facts.items() if k not in ("ecc_mode", "clocks")} == untouched
    assert "nvmlDeviceGetPowerUsage" in fake.calls


def test_a_failing_power_reading_hides_no_other_power_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()], fail={"nvmlDeviceGetPowerUsage": "Not Supported"}))
    assert gpu_health.read_gpu(H100["uuid"])["power"] == {
        "limit_w": 700.0, "default_w": 700.0, "enforced_w": 700.0,
        "draw_w": {"unknown": "nvmlDeviceGetPowerUsage: Not Supported"}}


def test_function_missing_from_the_bindings_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()], missing=("nvmlDeviceGetRemappedRows",)))
    facts = gpu_health.read_gpu(H100["uuid"])
    assert facts["remapped_rows"] == {"unknown": "nvmlDeviceGetRemappedRows is not in this nvidia-ml-py version"}
    assert facts["pcie"] == H100_FACTS["pcie"]


def test_older_bindings_fall_back_to_throttle_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    constants = {**CONSTANTS, **THROTTLE_CONSTANTS}
    fake = install(monkeypatch, fake_pynvml([gpu(reasons=0x4)], constants=constants,
                                            missing=("nvmlDeviceGetCurrentClocksEventReasons",)))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"] == {"mask": 4, "active": ["sw_power_cap"]}
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


def test_event_reasons_preferred_when_the_bindings_have_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, fake_pynvml([gpu(reasons=0x4)]))
    gpu_health.read_gpu(H100["uuid"])
    assert "nvmlDeviceGetCurrentClocksEventReasons" in fake.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in fake.calls


def test_driver_without_the_event_function_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu(reasons=0x20)],
                                     fail={"nvmlDeviceGetCurrentClocksEventReasons": "Function Not Found"}))
    assert gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"] == {"mask": 0x20,
                                                                       "active": ["sw_thermal_slowdown"]}


def test_clock_reasons_unknown_names_both_functions_when_both_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()], fail={"nvmlDeviceGetCurrentClocksEventReasons": "Not Supported",
                                                    "nvmlDeviceGetCurrentClocksThrottleReasons": "Not Supported"}))
    reason = gpu_health.read_gpu(H100["uuid"])["clock_event_reasons"]["unknown"]
    assert "nvmlDeviceGetCurrentClocksEventReasons: Not Supported" in reason
    assert "nvmlDeviceGetCurrentClocksThrottleReasons: Not Supported" in reason


def test_nvml_init_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()], init_error="Driver Not Loaded"))
    reason = "NVML unavailable: Driver Not Loaded"
    assert gpu_health.read_all_gpus() == []
    assert gpu_health.read_gpu(H100["uuid"]) == {"uuid": H100["uuid"], "unknown": reason}
    assert gpu_health.read_system() == {"available": False, "reason": reason,
                                        "driver_version": {"unknown": reason},
                                        "cuda_driver_version": {"unknown": reason}, "gpu_count": {"unknown": reason}}


def test_bindings_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module() -> Any:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml, "_module", no_module)
    assert gpu_health.read_all_gpus() == []
    system = gpu_health.read_system()
    assert system["available"] is False
    assert "nvidia-ml-py" in system["reason"]


def test_uuid_nvml_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu()]))
    assert gpu_health.read_gpu("GPU-00000000-0000-0000-0000-000000000000") == {
        "uuid": "GPU-00000000-0000-0000-0000-000000000000", "unknown": "nvmlDeviceGetHandleByUUID: Not Found"}


def test_a_handle_that_cannot_be_had_by_index_is_listed_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml([gpu(), gpu(uuid="GPU-second")],
                                     fail={"nvmlDeviceGetHandleByIndex": "GPU is lost"}))
    assert gpu_health.read_all_gpus() == [
        {"nvml_index": 0, "unknown": "nvmlDeviceGetHandleByIndex: GPU is lost"},
        {"nvml_index": 1, "unknown": "nvmlDeviceGetHandleByIndex: GPU is lost"}]
