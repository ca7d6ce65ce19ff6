"""How much of a host's CPU other processes took while the check ran.

A pre-flight check on a shared or oversubscribed node measures the node as it is: a
straggler or a slow matmul there may be another job's doing. The load average cannot
say whose load it is (our own ranks are busy too), so the CPU time of every process is
read at the start and at the end, and our own processes are left out: the ranks, what
they started, and the processes that started them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

# The few processes named in a finding, busiest first.
TOP = 3


@dataclass(frozen=True)
class CpuSample:
    t: float
    host_busy_s: float  # every CPU's non-idle time so far, summed (all processes, the kernel too)
    host_cpus: int
    # pid -> (name, start time, user + system CPU seconds so far); the start time tells a reused
    # pid apart (a name does not: a kernel worker renames itself with the work it does).
    seconds: dict[int, tuple[str, float, float]]


def sample() -> Optional[CpuSample]:
    """Every visible process's CPU time now; None where psutil cannot list processes."""
    try:
        import psutil

        seconds = {}
        for proc in psutil.process_iter(["pid", "name", "cpu_times", "create_time"]):
            times = proc.info.get("cpu_times")
            if times is not None:
                seconds[proc.info["pid"]] = (str(proc.info.get("name") or "?"), float(proc.info.get("create_time") or 0),
                                             times.user + times.system)
        times = psutil.cpu_times()
        busy = sum(getattr(times, f) for f in times._fields if f not in ("idle", "iowait", "guest", "guest_nice"))
        return CpuSample(time.monotonic(), busy, psutil.cpu_count() or 1, seconds)
    except Exception:
        return None


def our_processes(rank_pids: Iterable[int]) -> set[int]:
    """The ranks, every process under them (data loader workers), and every process above them
    (the launcher, torchrun's agent, the shell): none of that is another job's load."""
    import psutil

    ours: set[int] = set()
    for pid in rank_pids:
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        ours.add(pid)
        try:
            ours.update(child.pid for child in proc.children(recursive=True))
            ours.update(parent.pid for parent in proc.parents())
        except psutil.Error:
            pass
    return ours


def foreign_load(start: CpuSample, end: CpuSample, ours: set[int], cpus: int, top: int = TOP) -> dict[str, Any]:
    """CPUs' worth of time that processes not ours used between the samples, and the busiest.

    A process that started after `start` counts from zero, so a job that starts mid-check is
    seen; one that ended before `end` is not (its time is gone with it)."""
    interval = max(end.t - start.t, 1e-3)
    used: list[tuple[float, int, str]] = []
    for pid, (name, created, seconds) in end.seconds.items():
        if pid in ours:
            continue
        before = start.seconds.get(pid)
        delta = seconds - (before[2] if before and before[1] == created else 0.0)
        if delta > 0:
            used.append((delta, pid, name))
    used.sort(reverse=True)
    busy = sum(d for d, _, _ in used) / interval
    return {
        "interval_s": round(interval, 2),
        "cpus": cpus,
        "foreign_cpus_busy": round(busy, 2),
        # How busy the whole host was: saturated only if this is near all of its CPUs.
        "host_cpus": end.host_cpus,
        "host_cpus_busy": round(max(0.0, end.host_busy_s - start.host_busy_s) / interval, 2),
        "top": [{"pid": pid, "name": name, "cpu_pct": round(100 * d / interval)} for d, pid, name in used[:top]],
    }
