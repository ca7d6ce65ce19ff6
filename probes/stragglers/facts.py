"""What the stragglers probe measured on one rank, typed: its step timeline, clock and samples.

The field names are the JSON keys collect has always written, in the order it writes them, so
reports, snapshots and the recordings in tests/fixtures/stragglers read back byte for byte.
A missing or malformed key reads as the field's default (core/facts.py): the diagnosis then
judges the ranks whose series are there and leaves the others out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from ddpdoctor.core.facts import Facts, nested
from ddpdoctor.measure.contention import ContentionFacts
from ddpdoctor.runtime.step_timing import StepTimeline


@dataclass
class ClockFacts(Facts):
    """This host's clock against rank 0's (measure/clock_offset.py); None: not known."""

    offset_ms: Optional[float] = None
    error_ms: Optional[float] = None
    source: str = ""


@dataclass
class Summary(Facts):
    """One sampled quantity over the measured steps."""

    median: Optional[float] = None
    max: Optional[float] = None
    min: Optional[float] = None


@dataclass
class SampledFacts(Facts):
    """The host and GPU state sampled while the steps ran (measure/sampler.py's `facts()`).

    A quantity that was never sampled (a GPU's on a CPU rank) is None."""

    process_cpu_pct: Optional[Summary] = field(default=None, metadata=nested(Summary))
    host_cpu_pct: Optional[Summary] = field(default=None, metadata=nested(Summary))
    memory_available_pct: Optional[Summary] = field(default=None, metadata=nested(Summary))
    gpu_util_pct: Optional[Summary] = field(default=None, metadata=nested(Summary))
    sm_clock_mhz: Optional[Summary] = field(default=None, metadata=nested(Summary))
    samples: int = 0
    cpus_usable: Optional[int] = None
    cpu_affinity: Optional[str] = None  # as `taskset -c` writes it
    host_cpus: Optional[int] = None
    load_avg_1m: Optional[float] = None
    swapped_bytes_during_run: Optional[int] = None
    clock_event_reasons: list[str] = field(default_factory=list)
    gpu_unavailable: Optional[str] = None


@dataclass
class StragglersFacts(Facts):
    """One rank's stragglers measurement: per-step phases, arrivals at the all-reduce in rank 0's
    clock, compute-only steps, and what was sampled meanwhile."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"contention"})

    rank: Optional[int] = None
    host: Optional[str] = None
    device: str = ""
    backend: str = ""
    device_name: Optional[str] = None
    torch_threads: int = 0
    batch_size: int = 0
    parameters: int = 0
    comm_calls: int = 0
    steps: StepTimeline = field(default_factory=StepTimeline, metadata=nested(StepTimeline))
    samples: list[int] = field(default_factory=list)  # samples processed, per step
    arrival_s: list[float] = field(default_factory=list)  # per step, corrected to rank 0's clock
    clock: ClockFacts = field(default_factory=ClockFacts, metadata=nested(ClockFacts))
    solo_ms: list[float] = field(default_factory=list)  # forward+backward alone, no collective
    peak_mem_bytes: int = 0
    injected_ms: float = 0.0
    sampled: SampledFacts = field(default_factory=SampledFacts, metadata=nested(SampledFacts))
    # The CPU the training thread got over the measured run (measure/contention.py); None: not read
    # (a recording from before it was).
    contention: Optional[ContentionFacts] = field(default=None, metadata=nested(ContentionFacts))
