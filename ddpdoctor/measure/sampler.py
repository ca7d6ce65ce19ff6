"""What a rank's host and GPU were doing while it trained, sampled in the background.

A straggler's cause is often outside its own code: a core shared with another process,
a host out of memory, a GPU holding its clocks down. Those are states, not events, so
they are sampled during the measured steps (a reading before or after would see an idle
GPU at idle clocks) and kept as summaries: median and worst, plus which clock-event
reasons were ever active. Reading only; the stragglers diagnosis judges.
"""

from __future__ import annotations

import os
import statistics
import threading
from typing import Any, Optional

from ddpdoctor.measure import nvml
from ddpdoctor.core.findings import rank_ranges

INTERVAL_S = 0.1


def _summary(values: list[float]) -> Optional[dict[str, float]]:
    if not values:
        return None
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2),
            "min": round(min(values), 2)}


class RankSampler:
    """Start before the measured steps, stop after; `facts()` is JSON-able."""

    def __init__(self, gpu_uuid: Optional[str] = None, interval_s: float = INTERVAL_S) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-sampler", daemon=True)
        self._series: dict[str, list[float]] = {k: [] for k in (
            "process_cpu_pct", "host_cpu_pct", "memory_available_pct", "gpu_util_pct", "sm_clock_mhz")}
        self._reasons: set[str] = set()
        self._swap_start = self._swapped()
        self._handle: Any = None
        self._gpu_problem: Optional[str] = None
        if gpu_uuid:
            handle = nvml.query("nvmlDeviceGetHandleByUUID", gpu_uuid)
            if isinstance(handle, nvml.Unknown):
                self._gpu_problem = handle.reason
            else:
                self._handle = handle

    def _swapped(self) -> Optional[int]:
        try:
            swap = self._psutil.swap_memory()
            return int(swap.sin + swap.sout)
        except Exception:
            return None

    def __enter__(self) -> "RankSampler":
        # cpu_percent's first call only sets the baseline it measures the next from.
        self._process.cpu_percent(None)
        self._psutil.cpu_percent(None)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._sample()
            except Exception:  # a reading that fails is missing, it never stops the rank
                pass

    def _sample(self) -> None:
        s = self._series
        s["process_cpu_pct"].append(self._process.cpu_percent(None))
        s["host_cpu_pct"].append(self._psutil.cpu_percent(None))
        memory = self._psutil.virtual_memory()
        s["memory_available_pct"].append(100.0 * memory.available / memory.total)
        if self._handle is None:
            return
        util = nvml.query("nvmlDeviceGetUtilizationRates", self._handle, convert=lambda u: float(u.gpu))
        if not isinstance(util, nvml.Unknown):
            s["gpu_util_pct"].append(util)
        sm = nvml.query("nvmlDeviceGetClockInfo", self._handle, 1, convert=float)  # 1: NVML_CLOCK_SM
        if not isinstance(sm, nvml.Unknown):
            s["sm_clock_mhz"].append(sm)
        from ddpdoctor.measure.gpu_health import clock_event_reasons

        reasons = clock_event_reasons(self._handle)
        if isinstance(reasons, dict) and "active" in reasons:
            self._reasons.update(reasons["active"])

    def facts(self) -> dict[str, Any]:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = []
        swapped = self._swapped()
        out: dict[str, Any] = {k: _summary(v) for k, v in self._series.items()}
        out.update(
            samples=len(self._series["host_cpu_pct"]),
            cpus_usable=len(affinity) or None,
            cpu_affinity=rank_ranges(affinity) if affinity else None,  # which CPUs, as `taskset -c` writes them
            host_cpus=self._psutil.cpu_count(logical=True),
            load_avg_1m=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            swapped_bytes_during_run=(swapped - self._swap_start) if swapped is not None and
            self._swap_start is not None else None,
            clock_event_reasons=sorted(self._reasons),
            gpu_unavailable=self._gpu_problem,
        )
        return out
