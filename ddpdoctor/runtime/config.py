"""The run's settings, parsed once by the CLI and read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor.core.faults import Fault
from ddpdoctor.runtime.user_model import ModelSpec

DEFAULT_TIMEOUT_S = 30.0
# The targets a scaling efficiency is held to: ~95% at 2 ranks is good, ~80% at 8 acceptable
# (common practice; docs/scaling.md). Between the points the target falls linearly in log2(n).
DEFAULT_EFFICIENCY_TARGETS: tuple[tuple[int, float], ...] = ((2, 95.0), (8, 80.0))


@dataclass(frozen=True)
class ScalingConfig:
    """`ddpdoctor scaling`: which sizes, how long each, what to advise."""

    sizes: tuple[int, ...] = ()  # (): 1, 2, 4, ... and all ranks
    seconds_per_size: float = 2.0
    batch: int = 32  # per rank, the same at every size (weak scaling)
    knobs: bool = True  # also time DDP settings at the largest size
    lr: Optional[float] = None  # the learning rate tuned for one rank, for the scaling advice
    targets: tuple[tuple[int, float], ...] = DEFAULT_EFFICIENCY_TARGETS


@dataclass(frozen=True)
class BenchConfig:
    """`allreduce-bench` (and the `allreduce` probe): what to sweep and how to judge it."""

    op: str = "all_reduce"
    min_bytes: Optional[int] = None  # None: busbw.default_range for the device
    max_bytes: Optional[int] = None
    factor: Optional[int] = None
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    check: bool = True  # count wrong elements of every result
    localise: str = "auto"  # auto | always | never: ring-pair search for a slow link
    min_busbw_gbps: Optional[float] = None  # the gate: below it, the run is critical
    csv_path: Optional[str] = None
    plot_path: Optional[str] = None
    # Ask NCCL (rank 0) to log the algorithm it chose per call: opt-in, because the log line it
    # then writes on every call costs rank 0 time that was never measured on a GPU here.
    nccl_algorithms: bool = False


@dataclass(frozen=True)
class CheckConfig:
    probes: tuple[str, ...]
    nproc: Optional[int] = None
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    # Per-stage deadline. NCCL's 10 minutes is what makes hangs silent; a pre-flight
    # check whose stages take a second each can afford to give up after 30 s.
    timeout_s: float = DEFAULT_TIMEOUT_S
    json_path: Optional[str] = None
    prom_path: Optional[str] = None  # --prom: the verdict and measurements for node_exporter, rewritten each run
    trace_path: Optional[str] = None  # --trace: the ranks' timeline, Chrome trace-event JSON (core/timeline.py)
    html_path: Optional[str] = None  # --html: the report as one self-contained page (render/html_report.py)
    # --force: replace existing output files (--json, --csv, --plot). Without it the CLI
    # refuses them before any rank starts, and a file that appears during the run is not
    # replaced: the report goes to a free sibling name (report.1.json).
    force: bool = False
    inject: tuple[Fault, ...] = ()
    # Measured DDP steps; None: 5 in the shared workload, and `stragglers` measures for
    # `straggler_s` seconds instead (its verdict needs many steps, the others a few).
    steps: Optional[int] = None
    straggler_s: float = 5.0
    warmup: int = 2
    port: Optional[int] = None
    live: bool = True
    # homogeneity: a rank this much slower than its peers is flagged; None: 10% on GPU, 20% on CPU
    slow_threshold_pct: Optional[float] = None
    command: str = "check"  # or "allreduce-bench", "scaling": the same ranks, another report
    bench: BenchConfig = field(default_factory=BenchConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    model: ModelSpec = field(default_factory=ModelSpec)  # the user's model (--model/--batch), or the built-in

    @property
    def settings(self) -> dict[str, Any]:
        """What the diagnoses need of the config, recorded in the report."""
        out: dict[str, Any] = {}
        if self.command == "scaling":
            out["efficiency_targets"] = [list(t) for t in self.scaling.targets]
            if self.scaling.lr is not None:
                out["lr"] = self.scaling.lr
        if self.slow_threshold_pct is not None:
            out["slow_threshold_pct"] = self.slow_threshold_pct
        if self.bench.min_busbw_gbps is not None:
            out["min_busbw_gbps"] = self.bench.min_busbw_gbps
        return out

    @property
    def workload_steps(self) -> int:
        return self.steps if self.steps is not None else 5

    @property
    def heartbeat_s(self) -> float:
        return 0.5

    @property
    def silent_after_s(self) -> float:
        """A rank whose heartbeat is this old is frozen (stopped, or stuck holding the GIL)."""
        # Well before a stage deadline, so a frozen rank is named before its peers'
        # deadlines fire and make them look like the failure.
        return max(5.0, min(self.timeout_s / 2, 15.0))

    @property
    def run_deadline_s(self) -> float:
        """Every stage of a run back to back (rendezvous, init, report and 4 per probe):
        how long a reporter may wait for the others, and the others for its verdict."""
        return self.timeout_s * (3 + 4 * len(self.probes))

    @property
    def startup_allowance_s(self) -> float:
        """Importing torch on a loaded node can take many seconds before any heartbeat."""
        return self.timeout_s + 60.0
