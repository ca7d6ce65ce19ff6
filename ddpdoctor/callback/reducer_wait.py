"""The wait for the gradient all-reduce, as DDP's own reducer times it: nothing added to the step.

Why not a comm hook of our own (what this module replaced): a Python hook runs once per bucket
inside DDP's backward, and its completion callback (`Future.then`) runs on the backend's thread
and must take the GIL. Measured, on one H100 (NCCL, 2.1 ms steps): the hook alone cost +24% a
step; here on CPU (gloo, one rank, 1.9 ms steps) +21%, median of 14 alternated block pairs
(docs/callback.md, "What it costs"). And on NCCL the hook timed nothing: NCCL's future completes
when the all-reduce is queued, not when it is done.

DDP's reducer already keeps, for sampled iterations, when the backward computation ended and when
the last bucket's all-reduce ended (CPU clocks on CPU, CUDA events on the GPU), and
`_get_ddp_logging_data()` gives their running averages: `avg_backward_comm_time` (first bucket
launched to last bucket done) and `avg_backward_compute_comm_overlap_time` (first bucket
launched to backward computation done), in ns. Their difference is the time from the end of
the rank's own computation to the end of its gradient all-reduce: the wait. This module turns
the running averages into the mean of each check's window, by counting the sampled iterations
with the reducer's own rule (`Reducer::should_collect_runtime_stats`: iterations 1-10, then
every `sample_rate`-th; the record of iteration i is written at the forward of i+1).

The sample rate: torch's default is one iteration in 100. On 50 ms steps that is one sample in
5 s, too few for a window. While the reducer is still in its first 10 iterations (all sampled
whatever the rate, so the count stays exact) the rate is set once from the job's own step time,
to one sample per SAMPLE_MS of training and never rarer than torch's default:
- CPU: a sample costs the reducer about 4 µs (measured: `set_runtime_stats_and_log` 4.5 µs at
  rate 1 against 0.6 at rate 100); one per 20 ms is 0.02% of the time.
- CUDA: a sample makes the reducer synchronise the previous iteration's events at the next
  forward; torch does that every 100 iterations anyway. One per 100 ms keeps it under 0.1%.
The rate stays as torch left it when the Doctor comes after the job's 10th iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

TORCH_DEFAULT_RATE = 100  # kDDPRuntimeLoggingSampleRate in torch/csrc/distributed/c10d/reducer.hpp
ALWAYS_SAMPLED = 10  # iterations 1..10 are sampled at any rate
SAMPLE_MS = {"cpu": 20.0, "cuda": 100.0}


def sampled_count(iteration: int, rate: int) -> int:
    """How many iterations the reducer has sampled up to `iteration` (its rule, a constant rate after 10)."""
    if iteration <= 0:
        return 0
    return min(iteration, ALWAYS_SAMPLED) + max(0, iteration // rate - ALWAYS_SAMPLED // rate)


def rate_for(step_ms: float, device_type: str) -> int:
    """One sample per SAMPLE_MS of training, never rarer than torch's default."""
    per = SAMPLE_MS.get(device_type, SAMPLE_MS["cpu"])
    if step_ms <= 0:
        return TORCH_DEFAULT_RATE
    return int(max(1, min(TORCH_DEFAULT_RATE, round(per / step_ms))))


@dataclass
class WindowWait:
    """The gradient all-reduce wait over one check's window: the mean over DDP's sampled iterations."""

    mean_ms: Optional[float]  # None: no iteration was sampled in the window
    samples: int


class ReducerWait:
    """Reads one DDP model's reducer timings at each check; never on the step path."""

    def __init__(self, ddp_model: Any, device_type: str) -> None:
        self._model = ddp_model
        self._device_type = device_type
        self.rate = TORCH_DEFAULT_RATE
        self._rate_settable = True
        self._count = 0
        self._comm_ns = 0.0
        self._overlap_ns = 0.0
        self._last: Optional[WindowWait] = None
        self.iteration = 0  # the last iteration the reducer recorded: 0 while DDP's forward is never called
        data = self._read()
        if data is not None and int(data.get("iteration", 0) or 0) >= ALWAYS_SAMPLED:
            self._rate_settable = False  # joined late: the rate may have been anything so far
        if data is not None:
            self._update(data)  # what was sampled before the Doctor existed is not this job's window

    def tune(self, step_ms: float) -> None:
        """Set the sample rate from the job's step time, once, while every iteration is still sampled."""
        if not self._rate_settable:
            return
        self._rate_settable = False
        data = self._read()
        if data is None or int(data.get("iteration", 0) or 0) >= ALWAYS_SAMPLED - 1:
            return
        rate = rate_for(step_ms, self._device_type)
        try:
            self._model._set_ddp_runtime_logging_sample_rate(rate)
        except Exception:  # an older or newer DDP without it: torch's rate, counted as such
            return
        self.rate = rate

    def take(self) -> WindowWait:
        """The wait over the iterations sampled since the last take (the previous window's where none was)."""
        data = self._read()
        if data is None:
            return WindowWait(None, 0)
        before = (self._count, self._comm_ns, self._overlap_ns)
        self._update(data)
        samples = self._count - before[0]
        if samples <= 0:
            return self._last or WindowWait(None, 0)
        wait_ns = (self._comm_ns - before[1]) - (self._overlap_ns - before[2])
        self._last = WindowWait(max(0.0, wait_ns / samples / 1e6), samples)
        return self._last

    def _read(self) -> Optional[dict[str, Any]]:
        try:
            return dict(self._model._get_ddp_logging_data())
        except Exception:  # not a DDP model (anymore), or a torch without the logger
            return None

    def _update(self, data: dict[str, Any]) -> None:
        self.iteration = int(data.get("iteration", 0) or 0)
        count = sampled_count(self.iteration, self.rate)
        if count <= 0 or "avg_backward_comm_time" not in data:
            return
        self._count = count
        self._comm_ns = float(data["avg_backward_comm_time"]) * count
        self._overlap_ns = float(data.get("avg_backward_compute_comm_overlap_time", 0)) * count


def reducer_wait(model: Any, measure_comm: bool, distributed: bool, device_type: str) -> Optional[ReducerWait]:
    """The reducer's timings of a DDP model (also under torch.compile), or None where there is none to read."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)
    if not (measure_comm and distributed and isinstance(inner, DistributedDataParallel)):
        return None
    wait = ReducerWait(inner, device_type)
    return wait if wait._read() is not None else None


def unmeasured_wait(model: Any, is_ddp: bool, wait: Optional[ReducerWait], measure_comm: bool,
                    distributed: bool) -> Optional[str]:
    """The wrapper whose collectives go untimed (DOC011 names it), or None where the wait is measured
    or there is no data-parallel wrapper to time."""
    from torch.nn.parallel import DistributedDataParallel

    if not (is_ddp and wait is None and distributed):
        return None
    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, DistributedDataParallel):
        return type(inner).__name__
    return ("DistributedDataParallel (measure_comm=False)" if not measure_comm
            else "DistributedDataParallel (its reducer keeps no timings here)")
