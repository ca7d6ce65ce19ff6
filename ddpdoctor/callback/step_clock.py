"""How long the step now running may take before it is called hung: learned from the job's own steps.

A fixed deadline must fit every job, so it is long (600 s, NCCL's own watchdog) and a hang
in a loop of 5 ms steps costs ten minutes of every GPU before anyone hears of it. The job
itself says what is normal: `StepClock` is told each finished step's duration and answers,
for the step now running, an allowance of

    max(FLOOR_S, FACTOR x typical step, SLACK x slowest recent step), never above the ceiling

- typical: the median of the last TYPICAL_WINDOW steps. A median, not a mean, so one slow
  step does not move it, and over a window, so a job that slows down (a longer sequence
  length, a curriculum) is judged against its recent self.
- FACTOR = 10: a step ten times its median that is not a hang and was never seen before is
  rare (what recurs is covered by the next term); at 10x, a job of 3 s steps is named
  within 30 s of its hang, and a job of 5 ms steps within the floor.
- SLACK = 3 x the slowest step of the last SLOWEST_WINDOW: a step that is slow every 50
  steps (logging, an all-gather of metrics, an evaluation inside the step) or a GC pause
  has been seen, and the next one may be somewhat slower. NVIDIA's fault-tolerance
  launcher (nvidia-resiliency-ext) likewise sets its timeouts at 5x the longest interval
  it observed; 3x here because its interval is over whole runs, ours over a recent window.
- FLOOR_S = 10 s: below it, a process on a busy host (a GC pause, swapping, a noisy
  neighbour, a slow write to a shared file system) stalls for a few seconds without
  being hung, and a fast loop would be called hung on a 200 ms hiccup. 10 s keeps a hang
  named in about 10 s in the common case: published systems name 90% of hangs within
  15 s (Mycroft); NCCL's default is 600 s.
- The first step gets the ceiling: compilation, lazy initialisation and the first
  collectives' connections have no length we could know. Until WARMUP_STEPS + MIN_KNOWN
  steps are done, the others get max(WARMUP_FLOOR_S, SLACK x the slowest step so far):
  torch.compile recompiles, cuDNN autotunes, a compiled optimizer compiles at its second
  step. The warm-up steps are not in the record the steady allowance is learned from.
- A step the user marks slow (evaluation, checkpoint) gets the ceiling the first time
  (nothing is known of its length), then max(SLOW_FLOOR_S, SLACK x the slowest marked step
  of the last SLOW_WINDOW) and never less than an ordinary step's allowance. Marked steps
  stay out of the ordinary record, so a marked 40 s checkpoint does not make the ordinary
  allowance 120 s: marking keeps ordinary hangs found fast.
- The ceiling is the user's `step_deadline_s` (600 s by default): no step waits longer.

Pure arithmetic on durations, no clock of its own: the caller measures, so the same
sequence gives the same allowances in a test. Updating keeps the window sorted by insertion (a
binary search and a move of at most TYPICAL_WINDOW pointers, under a microsecond); reading the
allowance is arithmetic only: this runs twice in every step of the user's loop.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any, Union

FACTOR = 10.0
SLACK = 3.0
FLOOR_S = 10.0
TYPICAL_WINDOW = 99  # odd: the median is one of the steps
SLOWEST_WINDOW = 1000
WARMUP_STEPS = 10
MIN_KNOWN = 10
WARMUP_FLOOR_S = 60.0
SLOW_FLOOR_S = 60.0
SLOW_WINDOW = 20


def valid_ceiling(value: Any) -> float:
    """`step_deadline_s` as a float, or a ValueError that says what was wrong with it."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"step_deadline_s must be a number of seconds, not {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"step_deadline_s must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"step_deadline_s must be a finite number of seconds above 0, not {value!r}")
    return seconds


class _WindowMax:
    """The largest of the last `size` values, kept in amortised O(1) per value (a monotonic deque)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.count = 0
        self._kept: deque[tuple[int, float]] = deque()  # (index, value), values decreasing

    def add(self, value: float) -> None:
        while self._kept and self._kept[-1][1] <= value:
            self._kept.pop()
        self._kept.append((self.count, value))
        self.count += 1
        if self._kept[0][0] <= self.count - 1 - self.size:
            self._kept.popleft()

    def value(self) -> float:
        return self._kept[0][1] if self._kept else 0.0


class StepClock:
    """Fed each finished step's duration; answers how long the running step may take (see the module)."""

    def __init__(self, ceiling_s: float = 600.0) -> None:
        self.ceiling_s = valid_ceiling(ceiling_s)
        self.steps_seen = 0
        self._recent: deque[float] = deque(maxlen=TYPICAL_WINDOW)
        self._sorted: list[float] = []  # the same steps, in order: the median without a sort a step
        self._typical = 0.0
        self._slowest = _WindowMax(SLOWEST_WINDOW)
        self._warmup_slowest = 0.0
        self._marked = _WindowMax(SLOW_WINDOW)
        self.ordinary_s = self.allowance_s()  # the next unmarked step's allowance, kept up to date

    def finished(self, seconds: float, slow: bool = False) -> None:
        """A step ended after `seconds`; `slow`: the user marked it as one of the known slow ones."""
        seconds = max(0.0, float(seconds))
        self.steps_seen += 1
        if slow:
            self._marked.add(seconds)
        elif self.steps_seen <= WARMUP_STEPS or len(self._recent) < MIN_KNOWN:
            self._warmup_slowest = max(self._warmup_slowest, seconds)
            if self.steps_seen > WARMUP_STEPS:
                self._learn(seconds)
        else:
            self._learn(seconds)
        self.ordinary_s = self.allowance_s()

    def _learn(self, seconds: float) -> None:
        if len(self._recent) == TYPICAL_WINDOW:  # the oldest leaves the window and the sorted copy
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)
        self._slowest.add(seconds)
        self._typical = self._sorted[len(self._sorted) // 2]

    def allowance_s(self, slow: bool = False) -> float:
        """Seconds the step now running may take (slow: the user marked it) before it is hung.

        Arithmetic only once the clock has learned (the rule's words are written by `describe`);
        the step path reads `ordinary_s`, set here at each finished step."""
        if not slow and self.steps_seen and len(self._recent) >= MIN_KNOWN:
            return min(self.ceiling_s, max(FLOOR_S, FACTOR * self._typical, SLACK * self._slowest.value()))
        return min(self.ceiling_s, self._uncapped(slow)[0])

    def _uncapped(self, slow: bool) -> tuple[float, str]:
        """The allowance before the ceiling, and the rule that gave it."""
        ordinary = self._ordinary()
        if not slow:
            return ordinary
        if not self._marked.count:
            return self.ceiling_s, "first step marked slow: the ceiling"
        marked = max(SLOW_FLOOR_S, SLACK * self._marked.value())
        if marked >= ordinary[0]:
            return marked, (f"marked slow: max(floor {SLOW_FLOOR_S:g} s, "
                            f"{SLACK:g}x slowest marked step {self._marked.value():.3g} s)")
        return ordinary

    def _ordinary(self) -> tuple[float, str]:
        if self.steps_seen == 0:
            return self.ceiling_s, "first step: the ceiling"
        if len(self._recent) < MIN_KNOWN:
            return (max(WARMUP_FLOOR_S, SLACK * self._warmup_slowest),
                    f"warm-up: max(floor {WARMUP_FLOOR_S:g} s, {SLACK:g}x slowest step so far "
                    f"{self._warmup_slowest:.3g} s)")
        return (max(FLOOR_S, FACTOR * self._typical, SLACK * self._slowest.value()),
                f"max(floor {FLOOR_S:g} s, {FACTOR:g}x typical step {_short(self._typical)}, "
                f"{SLACK:g}x slowest recent step {_short(self._slowest.value())})")

    def describe(self, slow: bool = False) -> dict[str, Union[float, int, str, bool]]:
        """The numbers behind `allowance_s(slow)`, for a hang finding's evidence."""
        uncapped, rule = self._uncapped(slow)
        allowance = min(self.ceiling_s, uncapped)
        if uncapped > self.ceiling_s:
            rule = f"the ceiling step_deadline_s {self.ceiling_s:g} s (learned: {rule})"
        return {"allowance_s": round(allowance, 3), "rule": rule, "marked_slow": slow,
                "typical_step_s": round(self._typical, 6), "slowest_recent_step_s": round(self._slowest.value(), 6),
                "factor": FACTOR, "slack": SLACK, "floor_s": FLOOR_S, "ceiling_s": self.ceiling_s,
                "steps_seen": self.steps_seen, "steps_learned_from": len(self._recent)}


def _short(seconds: float) -> str:
    """A duration as people read one: 5 ms, 2.1 s."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
