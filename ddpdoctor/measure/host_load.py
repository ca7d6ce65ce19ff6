"""How much of a host's CPU other processes took while the check ran.

A pre-flight check on a shared or oversubscribed node measures the node as it is: a
straggler or a slow matmul there may be another job's doing. The load average cannot
say whose load it is (our own ranks are busy too), so the CPU time of every process is
read at the start and at the end, and our own processes are left out: the ranks, what
they started, and the processes that started them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

# The few processes named in a finding, busiest first.
TOP = 3


@dataclass(frozen=True)
class CpuSample:
    t: float
    cpus: frozenset[int]  # the CPUs this rank may run on: only contention there slows it
    cpus_busy_s: float  # those CPUs' non-idle time so far, summed (every process, the kernel too)
    # pid -> (name, start time, share of its CPU time that fell on our CPUs, user + system CPU
    # seconds so far); the start time tells a reused pid apart (a name does not: a kernel worker
    # renames itself with the work it does).
    seconds: dict[int, tuple[str, float, float, float]]


def _busy_seconds(cpus: frozenset[int]) -> Optional[float]:
    """Non-idle seconds of these CPUs since boot, from /proc/stat's per-CPU lines."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:]]
            # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
            busy += sum(values[:8]) - values[3] - values[4]
    return busy / tick


def sample() -> Optional[CpuSample]:
    """Every visible process's CPU time now, and how busy our CPUs are; None where it cannot be read."""
    try:
        import psutil

        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            frozenset(range(os.cpu_count() or 1))
        busy = _busy_seconds(cpus)
        if busy is None:
            return None
        seconds = {}
        for proc in psutil.process_iter(["pid", "name", "cpu_times", "create_time", "cpu_affinity"]):
            times = proc.info.get("cpu_times")
            if times is None:
                continue
            allowed = set(proc.info.get("cpu_affinity") or cpus)
            share = len(allowed & cpus) / len(allowed) if allowed else 1.0
            seconds[proc.info["pid"]] = (str(proc.info.get("name") or "?"), float(proc.info.get("create_time") or 0),
                                         share, times.user + times.system)
        return CpuSample(time.monotonic(), cpus, busy, seconds)
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


def foreign_load(start: CpuSample, end: CpuSample, ours: set[int], top: int = TOP) -> dict[str, Any]:
    """CPUs' worth of time that processes not ours used on our CPUs between the samples, how
    busy our CPUs were, and the busiest others.

    A process allowed on other CPUs too counts for the share of them that are ours (a job pinned
    to other cores counts for nothing). One that started after `start` counts from zero, so a
    job that starts mid-check is seen; one that ended before `end` is not."""
    interval = max(end.t - start.t, 1e-3)
    used: list[tuple[float, int, str]] = []
    for pid, (name, created, share, seconds) in end.seconds.items():
        if pid in ours or share <= 0:
            continue
        before = start.seconds.get(pid)
        delta = (seconds - (before[3] if before and before[1] == created else 0.0)) * share
        if delta > 0:
            used.append((delta, pid, name))
    used.sort(reverse=True)
    busy = sum(d for d, _, _ in used) / interval
    return {
        "interval_s": round(interval, 2),
        "cpus": len(end.cpus),
        "foreign_cpus_busy": round(busy, 2),
        # How busy our CPUs were, whoever used them: saturated only if this is near all of them.
        "cpus_busy": round(max(0.0, end.cpus_busy_s - start.cpus_busy_s) / interval, 2),
        "top": [{"pid": pid, "name": name, "cpu_pct": round(100 * d / interval)} for d, pid, name in used[:top]],
    }
