"""The row each rank contributes to the callback's all_gather, and its one packing.

Why a module of its own: the gather moves one flat float64 tensor per rank, so what a rank
sends and what every rank reads back must agree on a positional layout. That layout is
defined here once, from `GatheredRow`'s fields in declaration order, and `pack`/`unpack`
are the only two functions that know it:

    [scalar fields, in field order] [count] [each column, padded with zeros to `width`]

`width` is the check interval (`every`): every rank sends the same number of floats, and
`count` (the steps actually in the window, at most `width`) says how much of each column is
real. A scalar that may be unknown is `Optional` and travels as NaN; integers are exact in a
float64 up to 2**53 (the batch fingerprint is 52 bits, peak memory is bytes).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ddpdoctor.callback.online_checks import RankWindow
from ddpdoctor.measure.contention import ContentionFacts, Corunner, process_name


@dataclass
class GatheredRow:
    """One rank's window of steps and its local facts, as sent at a check."""

    rank: int
    steps_done: int  # steps this rank had finished when the row was made
    loader_len_batches: Optional[int] = None  # None: the loader has no length, or reading it failed
    stale_epoch: bool = False  # a second pass over the loader began with the sampler's epoch unchanged
    peak_mem_bytes: Optional[int] = None  # None: reading it failed
    batch_fingerprint: Optional[int] = None  # of the last step's batch; None: no batch given, or it failed
    wait_measured: bool = False  # the gradient all-reduce wait is read from DDP's reducer
    wait_samples: int = 0  # of DDP's sampled iterations in the window: the wait column is their mean
    window_steps: int = 0  # every step since the last check (the columns hold the last WINDOW_CAP)
    window_s: float = 0.0  # the wall time since the last check: the slowest rank's step sets the next check
    digest_ms: float = 0.0  # this rank's last replica comparison (callback/replicas.py): sets when the next is due
    replicas_off: bool = False  # this rank's replica comparison failed: every rank stops comparing
    buffers_step: Optional[int] = None  # the step whose forward's buffers this rank holds to compare (buffers.py)
    buffers_count: int = -1
    fingerprint_ms: float = 0.0  # one replica fingerprint's cost: sets whether every step keeps one
    loss_nonfinite_step: Optional[int] = None  # the first step whose loss was NaN or inf (callback/loss_watch.py)
    reducer_iteration: int = -1  # the last iteration DDP's reducer recorded (-1: not read); 0 after many steps:
    # DDP's forward is never called
    # The CPU the training thread got over the window (measure/contention.py), in % of the wall time.
    wall_s: Optional[float] = None
    run_delay_pct: Optional[float] = None
    cpu_pct: Optional[float] = None  # the training thread's CPU time
    process_cpu_pct: Optional[float] = None  # every thread's: the rest is its own other threads'
    off_cpu_pct: Optional[float] = None
    stopped_pct: Optional[float] = None
    throttled_pct: Optional[float] = None
    steal_pct: Optional[float] = None
    cpu_quota: Optional[float] = None
    corunner_pid: Optional[int] = None  # the busiest other process on its CPUs, when it lost time
    corunner_cpu_pct: Optional[float] = None
    # For the timeline (callback/trace_keep.py), this host's wall clock: when its last step ended, and when the
    # previous check began and this rank left its gather (0: none). Read at the check, never on the step path.
    last_end_s: float = 0.0
    gather_left_s: float = 0.0
    check_began_s: float = 0.0
    # Per step of the window, oldest first; every column has one entry per step.
    step_ms: list[float] = field(default_factory=list)  # step begin to end
    data_ms: list[float] = field(default_factory=list)  # end of the previous step to begin (the loader)
    # The gradient all-reduce wait: the window's mean over DDP's sampled iterations, shared out over
    # the steps in proportion to their length (0 when not measured); DDP's reducer keeps no per-step
    # value we could read for free.
    wait_ms: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)  # the batch's first dimension (0: not known)

    def to_window(self, host: str, cpus: Optional[str] = None) -> RankWindow:
        """What the judges read: unknowns become the sentinels `online_checks` expects
        (loader length -1, fingerprint 0: none, peak memory 0). `cpus`: the rank's CPU set, as it
        published it beside its node's name (not a number the gather could carry)."""
        return RankWindow(rank=self.rank, host=host, step=self.steps_done, step_ms=self.step_ms,
                          data_ms=self.data_ms, wait_ms=self.wait_ms, samples=self.samples,
                          fingerprint=_or(self.batch_fingerprint, 0),
                          loader_len=_or(self.loader_len_batches, -1), stale_epoch=self.stale_epoch,
                          peak_mem_bytes=_or(self.peak_mem_bytes, 0), wait_measured=self.wait_measured,
                          contention=self._contention(host, cpus))

    def _contention(self, host: str, cpus: Optional[str]) -> Optional[dict[str, object]]:
        if self.wall_s is None:
            return None
        facts = ContentionFacts(wall_s=self.wall_s, run_delay_pct=self.run_delay_pct, off_cpu_pct=self.off_cpu_pct,
                                cpu_pct=self.cpu_pct, process_cpu_pct=self.process_cpu_pct,
                                stopped_pct=self.stopped_pct, throttled_pct=self.throttled_pct,
                                steal_pct=self.steal_pct, cpu_quota=self.cpu_quota, cpus=cpus)
        if self.corunner_pid is not None:
            facts.corunners = [Corunner(pid=self.corunner_pid, name=process_name(self.corunner_pid, host),
                                        cpu_pct=self.corunner_cpu_pct or 0.0)]
        return facts.to_json()


def contention_fields(c: ContentionFacts) -> dict[str, Any]:
    """A window's contention reading as the row's scalars (the gather carries numbers only)."""
    top = c.corunners[0] if c.corunners else None
    return {"wall_s": c.wall_s, "run_delay_pct": c.run_delay_pct, "off_cpu_pct": c.off_cpu_pct,
            "cpu_pct": c.cpu_pct, "process_cpu_pct": c.process_cpu_pct,
            "stopped_pct": c.stopped_pct, "throttled_pct": c.throttled_pct, "steal_pct": c.steal_pct, "cpu_quota": c.cpu_quota,
            "corunner_pid": None if top is None else top.pid, "corunner_cpu_pct": None if top is None else top.cpu_pct}


def _or(value: Optional[int], unknown: int) -> int:
    return unknown if value is None else value


def _optional_int(value: float) -> Optional[int]:
    return None if math.isnan(value) else int(value)


def _optional_float(value: float) -> Optional[float]:
    return None if math.isnan(value) else float(value)


def _decoder(hint: object) -> Callable[[float], object]:
    """How a scalar field is read back from its float: by its declared type."""
    if hint is bool:
        return bool
    if hint is int:
        return int
    if hint is float:
        return float
    if hint == Optional[int]:
        return _optional_int
    if hint == Optional[float]:
        return _optional_float
    raise TypeError(f"GatheredRow has a scalar field of a type the gather cannot carry: {hint!r}")


def _layout() -> tuple[list[tuple[str, Callable[[float], object]]], list[str]]:
    """(scalar fields with their decoders, column fields), both in declaration order."""
    hints = typing.get_type_hints(GatheredRow)
    scalars: list[tuple[str, Callable[[float], object]]] = []
    columns: list[str] = []
    for f in dataclasses.fields(GatheredRow):
        if typing.get_origin(hints[f.name]) is list:
            columns.append(f.name)
        else:
            scalars.append((f.name, _decoder(hints[f.name])))
    return scalars, columns


SCALARS, COLUMNS = _layout()
HEADER = len(SCALARS) + 1  # the scalars, then the count of steps in the window


def packed_length(width: int) -> int:
    """Floats per rank in the gather for a window of `width` steps: what the buffer is sized by."""
    return HEADER + len(COLUMNS) * width


def pack(row: GatheredRow, width: int) -> list[float]:
    """The row as the floats one rank sends; `unpack` reads them back to an equal row."""
    count = len(row.step_ms)
    columns = [getattr(row, name) for name in COLUMNS]
    if count > width or any(len(column) != count for column in columns):
        raise ValueError(f"a gathered row needs columns of one length up to {width}: {[len(c) for c in columns]}")
    out = [math.nan if getattr(row, name) is None else float(getattr(row, name)) for name, _ in SCALARS]
    out.append(float(count))
    for column in columns:
        out.extend(float(v) for v in column)
        out.extend([0.0] * (width - count))
    return out


def unpack(values: Sequence[float]) -> GatheredRow:
    """One rank's floats, as gathered, back to its row (the width follows from the length)."""
    width, rest = divmod(len(values) - HEADER, len(COLUMNS))
    if width < 0 or rest:
        raise ValueError(f"{len(values)} floats are no gathered row")
    fields: dict[str, object] = {name: decode(values[i]) for i, (name, decode) in enumerate(SCALARS)}
    count = int(values[HEADER - 1])
    for i, name in enumerate(COLUMNS):
        start = HEADER + i * width
        fields[name] = [float(v) for v in values[start:start + count]]
    return GatheredRow(**fields)  # type: ignore[arg-type]
