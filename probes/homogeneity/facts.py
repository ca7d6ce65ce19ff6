"""What `homogeneity` reads on one rank (or `ddpdoctor snapshot` on one device), as typed facts.

The JSON keys are those `collect` (and `ddpdoctor.measure.node.read_device_facts`) write, in
that order; the wire format does not change (tests/unit/test_homogeneity_facts.py round-trips
every fixture). A reading that failed is `{"unknown": reason}` in place of its value (NVML on a
CPU host, a call a driver branch lacks): such fields are typed `Reading[...]` and keep the
mapping as read, so a diagnosis shows the reason where it used to. Scalars default to None,
as the `.get(key)` reads they replace did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, TypeVar, Union

from ddpdoctor.core.facts import Facts, nested, nested_list
from ddpdoctor.measure.contention import ContentionFacts

V = TypeVar("V")
# A value, or {"unknown": reason} where it could not be read, or None where it is absent.
Reading = Union[V, dict[str, str], None]


@dataclass
class SoftwareFacts(Facts):
    """The stack the rank really loaded (measure.host.read_software) and NVML's driver versions."""

    python: Optional[str] = None
    torch: Optional[str] = None
    torch_git: Optional[str] = None
    cuda_runtime: Optional[str] = None  # None for a CPU-only torch build
    nccl: Reading[str] = None
    os: Optional[str] = None
    kernel: Optional[str] = None
    driver: Reading[str] = None
    cuda_driver: Reading[str] = None


@dataclass
class HostHwFacts(Facts):
    """The host's sizing as this rank sees it (measure.host.read_host) and NVML's GPU count."""

    cpu_model: Optional[str] = None
    cpu_physical_cores: Optional[int] = None
    cpu_logical_cores: Optional[int] = None
    cpus_usable: Optional[int] = None  # this process's affinity
    cpu_affinity: Optional[str] = None  # which CPUs, as rank_ranges writes them: "0-3,8"
    ram_bytes: Optional[int] = None
    torch_threads: Optional[int] = None
    load_avg_1m: Optional[float] = None
    node_gpus: Reading[int] = None


@dataclass
class EccModeFacts(Facts):
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    current: Optional[bool] = None
    pending: Optional[bool] = None
    unknown: Optional[str] = None  # why NVML could not say (the whole composite fails at once)


@dataclass
class EccUncorrectedFacts(Facts):
    volatile: Reading[int] = None  # since the last reset
    aggregate: Reading[int] = None  # in the board's lifetime


@dataclass
class RetiredPagesFacts(Facts):
    pending: Reading[bool] = None
    single_bit: Reading[int] = None
    double_bit: Reading[int] = None


@dataclass
class RemappedRowsFacts(Facts):
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    correctable: Optional[int] = None
    uncorrectable: Optional[int] = None
    pending: Optional[bool] = None
    failed: Optional[bool] = None
    unknown: Optional[str] = None


@dataclass
class PowerFacts(Facts):
    limit_w: Reading[float] = None
    default_w: Reading[float] = None
    enforced_w: Reading[float] = None
    draw_w: Reading[float] = None


@dataclass
class ClocksFacts(Facts):
    sm_mhz: Reading[int] = None
    mem_mhz: Reading[int] = None
    app_sm_mhz: Reading[int] = None
    app_mem_mhz: Reading[int] = None
    default_app_sm_mhz: Reading[int] = None
    default_app_mem_mhz: Reading[int] = None
    max_sm_mhz: Reading[int] = None
    max_mem_mhz: Reading[int] = None


@dataclass
class ClockEventReasonsFacts(Facts):
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    mask: Optional[int] = None
    active: list[str] = field(default_factory=list)  # stable names: "sw_power_cap", "hw_slowdown", ...
    unknown: Optional[str] = None


@dataclass
class PcieFacts(Facts):
    gen: Reading[int] = None
    max_gen: Reading[int] = None
    width: Reading[int] = None
    max_width: Reading[int] = None


@dataclass
class MigModeFacts(Facts):
    """Multi-Instance GPU mode (nvmlDeviceGetMigMode, one call): `pending` applies at the next reset."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown"})

    current: Optional[bool] = None
    pending: Optional[bool] = None
    unknown: Optional[str] = None  # why NVML could not say (a GPU without MIG: "Not Supported")


@dataclass
class DiagTestFacts(Facts):
    """One test of `dcgmi diag` on this GPU: DCGM's result and its own words about it."""

    name: str = ""
    category: Optional[str] = None  # Deployment, Integration, Hardware, Stress (the table's sections)
    result: str = ""  # as DCGM prints it: Pass, Fail, Warn, Skip
    warnings: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)


@dataclass
class DiagnosticFacts(Facts):
    """What `dcgmi diag -r N` said about this GPU, read from its output (text or -j JSON): DCGM's
    own tests, which NVML cannot run, so a live check has none and writes no key."""

    level: Optional[int] = None  # -r N, where the output shows it
    dcgm_version: Optional[str] = None
    tests: list[DiagTestFacts] = field(default_factory=list, metadata=nested_list(DiagTestFacts))


@dataclass
class GpuFacts(Facts):
    """CUDA's view of the device (name to sm_count), then NVML's health readings.

    When NVML cannot find the GPU, its part is only `unknown` (the reason) after CUDA's keys.
    `performance_state` and `mig_mode` came later (measure.gpu_health.read_modes): files written
    before them lack the keys, and they are written only when read.
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"unknown", "performance_state", "mig_mode", "diagnostic"})

    name: Optional[str] = None
    uuid: Optional[str] = None
    memory_total_bytes: Reading[int] = None
    compute_capability: Reading[str] = None
    sm_count: Optional[int] = None
    nvml_index: Reading[int] = None
    pci_bus_id: Reading[str] = None
    ecc_mode: EccModeFacts = field(default_factory=EccModeFacts, metadata=nested(EccModeFacts))
    ecc_uncorrected: EccUncorrectedFacts = field(default_factory=EccUncorrectedFacts,
                                                 metadata=nested(EccUncorrectedFacts))
    retired_pages: RetiredPagesFacts = field(default_factory=RetiredPagesFacts, metadata=nested(RetiredPagesFacts))
    remapped_rows: RemappedRowsFacts = field(default_factory=RemappedRowsFacts, metadata=nested(RemappedRowsFacts))
    power: PowerFacts = field(default_factory=PowerFacts, metadata=nested(PowerFacts))
    clocks: ClocksFacts = field(default_factory=ClocksFacts, metadata=nested(ClocksFacts))
    clock_event_reasons: ClockEventReasonsFacts = field(default_factory=ClockEventReasonsFacts,
                                                        metadata=nested(ClockEventReasonsFacts))
    persistence_mode: Reading[bool] = None
    temperature_c: Reading[int] = None
    pcie: PcieFacts = field(default_factory=PcieFacts, metadata=nested(PcieFacts))
    performance_state: Reading[str] = None  # "P0" (full speed) .. "P12" (idle): says whether a low link is idling
    mig_mode: Optional[MigModeFacts] = field(default=None, metadata=nested(MigModeFacts))
    diagnostic: Optional[DiagnosticFacts] = field(default=None, metadata=nested(DiagnosticFacts))
    unknown: Optional[str] = None


@dataclass
class MatmulFacts(Facts):
    """measure.throughput.MatmulThroughput as written on the wire."""

    device: Optional[str] = None
    dtype: Optional[str] = None
    size: Optional[int] = None
    reps: Optional[int] = None
    median_ms: Optional[float] = None
    flops_per_s: Optional[float] = None
    round_flops_per_s: list[float] = field(default_factory=list)


@dataclass
class MeasuredFacts(Facts):
    """What the rank measured; a snapshot writes only `matmul` (it runs no training steps)."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"got_flops_per_s", "contention"})

    matmul: Optional[MatmulFacts] = field(default=None, metadata=nested(MatmulFacts))
    step_ms: Optional[float] = None  # median DDP step of the shared workload
    forward_ms: Optional[float] = None
    # The matmul's flops over the rounds' wall time: what the rank really got, the time it was
    # descheduled, throttled or stopped included (its best round leaves that out).
    got_flops_per_s: Optional[float] = None
    contention: Optional[ContentionFacts] = field(default=None, metadata=nested(ContentionFacts))  # over the rounds


@dataclass
class ProcessLoadFacts(Facts):
    pid: Optional[int] = None
    name: Optional[str] = None
    cpu_pct: Optional[int] = None


@dataclass
class HostLoadFacts(Facts):
    """Other processes' CPU on this host while the check ran (measure.host_load.foreign_load)."""

    interval_s: Optional[float] = None
    cpus: Optional[int] = None
    foreign_cpus_busy: Optional[float] = None
    cpus_busy: Optional[float] = None  # every process's, ours included
    top: list[ProcessLoadFacts] = field(default_factory=list, metadata=nested_list(ProcessLoadFacts))


@dataclass
class HomogeneityFacts(Facts):
    """One rank's (or one snapshotted device's) facts.

    `measured` is absent from the partial result a rank publishes before it measures, and
    `host_load` is written only by the rank that sampled the host's load (local rank 0).
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"measured", "host_load", "machine"})
    # Facts of the wrong kind are a file the user should regenerate (`ddpdoctor diagnose` says so
    # in one line), as the untyped judging refused them: never judged as if they were defaults.
    STRICT_KINDS: ClassVar[bool] = True

    device: Optional[str] = None  # "cuda:0", "cpu"
    software: SoftwareFacts = field(default_factory=SoftwareFacts, metadata=nested(SoftwareFacts))
    host_hw: HostHwFacts = field(default_factory=HostHwFacts, metadata=nested(HostHwFacts))
    gpu: Optional[GpuFacts] = field(default=None, metadata=nested(GpuFacts))  # None on a CPU rank
    env: dict[str, str] = field(default_factory=dict)  # the training-relevant variables (core.redact)
    host: Optional[str] = None
    # The kernel's boot id (measure/host.boot_id): ranks with one share a machine's cores whatever
    # host names they go by (containers, simulated nodes). None in facts recorded before it.
    machine: Optional[str] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    world_size: Optional[int] = None
    source: Optional[str] = None  # "rank" or "snapshot"
    measured: Optional[MeasuredFacts] = field(default=None, metadata=nested(MeasuredFacts))
    host_load: Optional[HostLoadFacts] = field(default=None, metadata=nested(HostLoadFacts))

    @property
    def has_gpu(self) -> bool:
        """Ran on a GPU: an empty `gpu` object counts as none, as it always has."""
        return self.gpu is not None and bool(self.gpu.to_json())

    @property
    def matmul(self) -> Optional[MatmulFacts]:
        return self.measured.matmul if self.measured is not None else None

    @property
    def step_ms(self) -> Optional[float]:
        return self.measured.step_ms if self.measured is not None else None
