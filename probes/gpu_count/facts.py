"""What one rank of `gpu-count` publishes: who it is, what torch, NVML and its environment say.

Field names are the JSON keys collect has always written, in its order, so reports and the
snapshots under tests/fixtures/gpu_count/ read back byte for byte. NVML readings that failed are
`{"unknown": reason}` on the wire; the fields that may hold one default to None (accept anything)
and the checks ask for the kind they need, as they did before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from ddpdoctor.core.facts import Facts, nested, nested_list

# A reading that failed: {"unknown": reason} (ddpdoctor.measure.nvml.Unknown.to_json).
Unknown = dict[str, Optional[str]]


@dataclass
class TorchDevice(Facts):
    """One GPU as torch lists it (CUDA's order, renumbered after CUDA_VISIBLE_DEVICES)."""

    index: Optional[int] = None
    name: Optional[str] = None
    uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None


@dataclass
class TorchFacts(Facts):
    """measure.device.read_torch: the build, whether CUDA works, and the GPUs it sees."""

    version: Optional[str] = None
    cuda_built: Optional[str] = None  # torch.version.cuda: None for a CPU-only wheel
    cuda_available: bool = False
    device_count: int = 0
    unavailable_reason: Optional[str] = None
    current: Optional[TorchDevice] = field(default=None, metadata=nested(TorchDevice))
    devices: list[TorchDevice] = field(default_factory=list, metadata=nested_list(TorchDevice))

    @property
    def current_uuid(self) -> Optional[str]:
        """The GPU this rank computes on, by UUID (indices differ between torch and NVML)."""
        return self.current.uuid if self.current is not None else None


@dataclass
class NvmlProcess(Facts):
    pid: Optional[int] = None
    used_bytes: Optional[int] = None


@dataclass
class NvmlDevice(Facts):
    """One GPU as NVML lists it (PCI order, whatever CUDA_VISIBLE_DEVICES says)."""

    index: Optional[int] = None
    uuid: Union[str, Unknown, None] = None
    pci_bus_id: Union[str, Unknown, None] = None
    name: Union[str, Unknown, None] = None
    mig_mode: Union[int, Unknown, None] = None
    # None where NVML could not list them (the wire keeps its {"unknown": reason}).
    processes: Optional[list[NvmlProcess]] = field(default=None, metadata=nested_list(NvmlProcess))
    error: Optional[str] = None  # the device's handle could not be read; then only index is set

    OMIT_NONE = frozenset({"uuid", "pci_bus_id", "name", "mig_mode", "processes", "error"})


@dataclass
class NvmlFacts(Facts):
    """measure.device.read_nvml: the driver and its GPUs; without a driver only why not."""

    available: bool = False
    reason: Optional[str] = None
    driver_version: Union[str, Unknown, None] = None
    cuda_driver_version: Union[int, Unknown, None] = None
    device_count: Union[int, Unknown, None] = None
    devices: list[NvmlDevice] = field(default_factory=list, metadata=nested_list(NvmlDevice))

    OMIT_NONE = frozenset({"driver_version", "cuda_driver_version", "device_count"})

    @property
    def count(self) -> Optional[int]:
        """How many GPUs the node has, or None where NVML could not say."""
        return self.device_count if isinstance(self.device_count, int) else None


@dataclass
class GpuCountFacts(Facts):
    """One rank: its place in the launch, its device, and what each source says about GPUs."""

    host: Optional[str] = None
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 0
    world_size: int = 0
    pid: int = -1
    device: str = ""  # str(torch.device) the workload ran on: "cuda:3", "cpu"
    env: dict[str, Optional[str]] = field(default_factory=dict)  # measure.device.ENV_KEYS, in that order
    torch: TorchFacts = field(default_factory=TorchFacts, metadata=nested(TorchFacts))
    nvml: NvmlFacts = field(default_factory=NvmlFacts, metadata=nested(NvmlFacts))
    # UUIDs of the GPUs this process holds a context on, per NVML; {"unknown": why} otherwise.
    contexts: Union[list[Optional[str]], Unknown, None] = None

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def cuda_count(self) -> int:
        """GPUs torch can use on this rank: 0 where CUDA does not work."""
        return int(self.torch.device_count) if self.torch.cuda_available else 0
