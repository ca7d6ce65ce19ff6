"""Whether a rank got the CPU it asked for: run delay, involuntary switches, steal, CPU quota
throttling, the CPU it got against the wall time, and who else ran on its CPUs.

Why: a rank that shares its core with another process, sits in a throttled cgroup or is
stopped from outside computes as fast as ever *when it runs*; the best-case timings the
probes compare (a best round, a low quantile) discard exactly the time it loses. The kernel
counts that time: /proc/thread-self/schedstat's run delay is the time the thread was runnable
but not running (a neighbour had the core, or its cgroup's quota was spent); CPU time against
wall time shows the rest (a stopped process runs nothing and is not runnable either).

Reading only: `Window` takes the counters at its start and end on the thread that does the
rank's work; what they mean is judged in `lost_cpu` and by the probes.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor.core.facts import Facts, nested_list
from ddpdoctor.measure.host_layout import parse_cpulist

# Processes named as running on the rank's CPUs: the busiest few that used at least this share.
TOP = 3
MIN_CORUNNER_PCT = 5.0
# A window that lost this share of its time to others is worth naming who they were.
MIN_LOST_PCT = 15.0


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of the calling thread and its CPUs at one moment."""

    wall_s: float
    cpu_s: Optional[float]  # this thread's time on a CPU
    run_delay_s: Optional[float]  # this thread's time runnable but waiting for a CPU
    process_run_delay_s: Optional[float]  # every thread's of the process, summed (its comm threads too)
    process_cpu_s: Optional[float]  # every thread's time on a CPU, summed
    nonvoluntary: Optional[int]  # involuntary context switches of this thread
    steal_s: Optional[float]  # steal time of the CPUs it may run on, summed
    ticks_s: Optional[float]  # every /proc/stat tick of those CPUs, summed (the steal's denominator)
    throttled_s: Optional[float]  # its cpu cgroup's throttled time (a quota spent)
    throttled_periods: Optional[int]


@dataclass
class Corunner(Facts):
    pid: int = 0
    name: str = ""
    cpu_pct: float = 0.0  # of one CPU, over the window, the share that fell on the rank's CPUs


@dataclass
class ContentionFacts(Facts):
    """What one rank lost to others over a window; None: not readable here."""

    wall_s: float = 0.0
    cpu_pct: Optional[float] = None  # CPU time got / wall time, of the working thread
    run_delay_pct: Optional[float] = None  # runnable but not running / wall time
    process_run_delay_pct: Optional[float] = None  # the same, every thread of the process summed
    # CPU time of every thread of the process / wall time: beside `cpu_pct`, what its own other
    # threads (communication, loaders in threads, samplers) took, on its cores too.
    process_cpu_pct: Optional[float] = None
    # Of the wall time, how much of its own work (compute: time it never waits on purpose) it spent
    # off a CPU: run delay, a spent quota, or stopped from outside (which no other counter sees).
    off_cpu_pct: Optional[float] = None
    stopped_pct: Optional[float] = None  # the whole process stopped (SIGSTOP, a frozen cgroup): `StopClock`
    nonvoluntary_per_s: Optional[float] = None
    steal_pct: Optional[float] = None  # of its CPUs' time, taken by the hypervisor
    throttled_pct: Optional[float] = None  # of the wall time, its cgroup was throttled
    cpu_quota: Optional[float] = None  # CPUs' worth its cgroup may use; None: no quota or unknown
    cpus: Optional[str] = None  # its affinity, as `taskset -c` writes it
    corunners: list[Corunner] = field(default_factory=list, metadata=nested_list(Corunner))

    def lost_pct(self) -> Optional[float]:
        """Share of the wall time the rank wanted a CPU and did not have one: see `lost_cpu`."""
        return lost_cpu(self)


def lost_cpu(f: ContentionFacts) -> Optional[float]:
    """The share of the wall time a CPU was denied to it: run delay plus the time stopped (a
    stopped thread is not runnable, so the two never overlap; a spent quota is run delay too).

    Not its off-CPU work (`off_cpu_pct`, evidence only): a user's step may block on purpose
    (a file, a queue, a sleep), and that is no CPU denied."""
    if f.run_delay_pct is None and f.stopped_pct is None:
        return f.throttled_pct
    return max((f.run_delay_pct or 0.0) + (f.stopped_pct or 0.0), f.throttled_pct or 0.0)


def _thread_file(name: str) -> str:
    return f"/proc/thread-self/{name}" if os.path.exists("/proc/thread-self") else f"/proc/self/{name}"


def _schedstat() -> tuple[Optional[float], Optional[float]]:
    try:
        with open(_thread_file("schedstat")) as f:
            on_cpu, delay, _ = f.read().split()[:3]
        return int(on_cpu) / 1e9, int(delay) / 1e9
    except (OSError, ValueError):
        return None, None


def _process_schedstat() -> tuple[Optional[float], Optional[float]]:
    """(run delay, time on a CPU) of every thread of the process, summed, in seconds."""
    delay, on_cpu, seen = 0, 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None, None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
                on_cpu += int(fields[0])
                delay += int(fields[1])
                seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return (delay / 1e9, on_cpu / 1e9) if seen else (None, None)


def _nonvoluntary() -> Optional[int]:
    try:
        with open(_thread_file("status")) as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def affinity() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cpu_count(cpus: Optional[str]) -> int:
    """How many CPUs a `taskset -c` list names ("0-3,8": 5); 0 for none or unreadable."""
    try:
        return len(parse_cpulist(cpus or ""))
    except ValueError:
        return 0


def cpu_list(cpus: frozenset[int]) -> str:
    """`0-3,6` as taskset writes it."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def _steal(cpus: frozenset[int]) -> tuple[Optional[float], Optional[float]]:
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None, None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    steal = total = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:9]]
            total += sum(values)
            steal += values[7] if len(values) > 7 else 0
    return steal / tick, total / tick


def cpu_cgroup_dir(pid: str = "self") -> Optional[str]:
    """The directory of this process's cpu cgroup (v1 `cpu` controller, else v2's unified one)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "cpu" in controllers.split(",") and os.path.isdir(f"/sys/fs/cgroup/cpu{path}"):
            return os.path.normpath(f"/sys/fs/cgroup/cpu{path}")
    for hid, controllers, path in lines:
        if hid == "0" and not controllers and os.path.exists(f"/sys/fs/cgroup{path}/cpu.stat"):
            return os.path.normpath(f"/sys/fs/cgroup{path}")
    return None


def _throttled(directory: Optional[str]) -> tuple[Optional[float], Optional[int]]:
    if directory is None:
        return None, None
    try:
        with open(os.path.join(directory, "cpu.stat")) as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return None, None
    if "throttled_time" in stat:  # v1: nanoseconds
        seconds = int(stat["throttled_time"]) / 1e9
    elif "throttled_usec" in stat:  # v2
        seconds = int(stat["throttled_usec"]) / 1e6
    else:
        return None, None
    return seconds, int(stat.get("nr_throttled", 0))


def cpu_quota(directory: Optional[str]) -> Optional[float]:
    """CPUs' worth the cgroup may use per period; None: unlimited or unreadable."""
    if directory is None:
        return None
    try:
        if os.path.exists(os.path.join(directory, "cpu.max")):
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us < 0 else quota_us / period_us


def read_counters(cpus: Optional[frozenset[int]] = None, cgroup: Optional[str] = None) -> Counters:
    cpus = cpus if cpus is not None else affinity()
    on_cpu, delay = _schedstat()
    process_delay, process_cpu = _process_schedstat()
    steal, ticks = _steal(cpus)
    throttled, periods = _throttled(cgroup)
    return Counters(wall_s=time.monotonic(), cpu_s=on_cpu, run_delay_s=delay,
                    process_run_delay_s=process_delay, process_cpu_s=process_cpu, nonvoluntary=_nonvoluntary(),
                    steal_s=steal, ticks_s=ticks, throttled_s=throttled, throttled_periods=periods)


def _pct(part: Optional[float], before: Optional[float], whole: float) -> Optional[float]:
    if part is None or before is None or whole <= 0:
        return None
    return round(100.0 * max(0.0, part - before) / whole, 1)


class StopClock:
    """How long the whole process was stopped: a thread that sleeps TICK_S at a time and adds up
    how much later than asked it woke, less the time it waited for a CPU (its run delay).

    A stopped process is neither running nor runnable, so no kernel counter of its own shows the
    time, and a rank stopped while it waits in a collective looks like one that waits."""

    TICK_S = 0.02

    def __init__(self) -> None:
        import sys

        self.stopped_s = 0.0
        self.min_gap_s = 2.0 * sys.getswitchinterval()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-stopclock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Fifty wakes a second inside a training job: the thread's own schedstat stays open and is
        # read once a tick with pread (2.5 µs, against 56 µs to open and read it anew, on the VM).
        try:
            fd: Optional[int] = os.open(_thread_file("schedstat"), os.O_RDONLY)
        except OSError:
            fd = None
        try:
            self._tick(fd)
        finally:
            if fd is not None:
                os.close(fd)

    def _tick(self, fd: Optional[int]) -> None:
        delay0 = _run_delay(fd)
        while not self._halt.is_set():
            before = time.monotonic()
            time.sleep(self.TICK_S)
            late = time.monotonic() - before - self.TICK_S
            delay1 = _run_delay(fd)
            waited = (delay1 - delay0) if delay0 is not None and delay1 is not None else 0.0
            delay0 = delay1
            # Waking late also means waiting for the GIL (up to the switch interval, 5 ms, while
            # the training thread runs Python): only a longer gap is a stop, counted whole.
            if late - waited > self.min_gap_s:
                self.stopped_s += late - waited

    def close(self) -> None:
        self._halt.set()


def _run_delay(fd: Optional[int]) -> Optional[float]:
    """The run delay (s) in a schedstat file kept open; None where unreadable."""
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class CorunnerSample:
    """Every visible process's CPU time on our CPUs at the start; `top` names who used them since.

    A walk of every process, so it is taken twice a window at most, never per step. Read from
    /proc directly (one `stat` read and one affinity call a process): 2.6 ms for 72 processes on
    the 2-core VM against 8 ms through psutil, whose objects read `stat` once per attribute; it runs
    inside a training job's checks (docs/callback.md, "What it costs"). psutil where /proc is not."""

    def __init__(self, cpus: frozenset[int], exclude: frozenset[int]) -> None:
        self.cpus = cpus
        self.exclude = exclude
        self.t = time.monotonic()
        self.seconds = self._read()

    def _read(self) -> dict[tuple[int, float], tuple[str, float, float]]:
        if not os.path.isdir("/proc/self/task"):
            return self._read_psutil()
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.exclude:
                continue
            pid = int(entry.name)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
                allowed = os.sched_getaffinity(pid)
            except OSError:  # gone meanwhile, or not ours to read
                continue
            share = len(allowed & self.cpus) / len(allowed) if allowed else 0.0
            open_at, close_at = stat.find(b"("), stat.rfind(b")")
            fields = stat[close_at + 2:].split()
            if share > 0 and open_at >= 0 and len(fields) > 19:
                # utime, stime (fields 14, 15) and starttime (22): a pid reused by a new process is another key
                out[(pid, float(fields[19]))] = (stat[open_at + 1:close_at].decode("utf-8", "replace"), share,
                                                 (int(fields[11]) + int(fields[12])) / tick)
        return out

    def _read_psutil(self) -> dict[tuple[int, float], tuple[str, float, float]]:
        try:
            import psutil
        except ImportError:
            return {}
        out = {}
        for proc in psutil.process_iter(["pid", "name", "cpu_times", "create_time", "cpu_affinity"]):
            info = proc.info
            times = info.get("cpu_times")
            if times is None or info["pid"] in self.exclude:
                continue
            allowed = set(info.get("cpu_affinity") or self.cpus)
            share = len(allowed & self.cpus) / len(allowed) if allowed else 0.0
            if share > 0:
                out[(info["pid"], float(info.get("create_time") or 0))] = (
                    str(info.get("name") or "?"), share, times.user + times.system)
        return out

    def top(self, n: int = TOP) -> list[Corunner]:
        interval = max(time.monotonic() - self.t, 1e-3)
        now = self._read()
        used = []
        for key, (name, share, seconds) in now.items():
            before = self.seconds.get(key)
            pct = 100.0 * share * (seconds - (before[2] if before else 0.0)) / interval
            if pct >= MIN_CORUNNER_PCT:
                used.append(Corunner(pid=key[0], name=name, cpu_pct=round(pct, 1)))
        return sorted(used, key=lambda c: -c.cpu_pct)[:n]


class Window:
    """Counters from `__init__` (or the last `take`) to `take`, on the calling thread.

    `corunners`: "always" names the processes that ran on our CPUs meanwhile (two psutil walks a
    window); "when_lost" only in a window after one that lost MIN_LOST_PCT of its time (a user's
    job pays for the walk only when there is something to explain); "never"."""

    def __init__(self, corunners: str = "always", exclude: frozenset[int] = frozenset(), stops: bool = True) -> None:
        self._stops = StopClock() if stops else None
        self._stopped_s = 0.0
        self.cpus = affinity()
        self.cgroup = cpu_cgroup_dir()
        self.exclude = exclude | {os.getpid()}
        self.corunners = corunners
        self._start = read_counters(self.cpus, self.cgroup)
        self._sample = CorunnerSample(self.cpus, self.exclude) if corunners == "always" else None

    def take(self, wait_s: Optional[float] = None) -> ContentionFacts:
        """`wait_s`: how long this thread waited on purpose in the window (in collectives, for a
        loader): the rest of the wall time is work, and the part of it without CPU time is
        `off_cpu_pct`; None: not known, not computed."""
        end = read_counters(self.cpus, self.cgroup)
        start, self._start = self._start, end
        wall = max(end.wall_s - start.wall_s, 1e-6)
        steal = None
        if end.steal_s is not None and start.steal_s is not None and end.ticks_s and start.ticks_s is not None:
            steal = _pct(end.steal_s, start.steal_s, end.ticks_s - start.ticks_s)
        switches = None
        if end.nonvoluntary is not None and start.nonvoluntary is not None:
            switches = round((end.nonvoluntary - start.nonvoluntary) / wall, 1)
        off = None
        if wait_s is not None and end.cpu_s is not None and start.cpu_s is not None:
            off = round(100.0 * max(0.0, wall - wait_s - (end.cpu_s - start.cpu_s)) / wall, 1)
        stopped = None
        if self._stops is not None:
            now = self._stops.stopped_s
            stopped, self._stopped_s = _pct(now, self._stopped_s, wall), now
        facts = ContentionFacts(
            wall_s=round(wall, 3), cpu_pct=_pct(end.cpu_s, start.cpu_s, wall), stopped_pct=stopped,
            run_delay_pct=_pct(end.run_delay_s, start.run_delay_s, wall), off_cpu_pct=off,
            process_run_delay_pct=_pct(end.process_run_delay_s, start.process_run_delay_s, wall),
            process_cpu_pct=_pct(end.process_cpu_s, start.process_cpu_s, wall),
            nonvoluntary_per_s=switches, steal_pct=steal,
            throttled_pct=_pct(end.throttled_s, start.throttled_s, wall),
            cpu_quota=cpu_quota(self.cgroup), cpus=cpu_list(self.cpus))
        if self._sample is not None:
            facts.corunners = self._sample.top()
        lost = lost_cpu(facts)
        wanted = self.corunners == "always" or (self.corunners == "when_lost" and (lost or 0.0) >= MIN_LOST_PCT)
        self._sample = CorunnerSample(self.cpus, self.exclude) if wanted else None
        return facts

    def close(self) -> None:
        """Stops the stop clock's thread; a window not closed leaves a daemon thread ticking."""
        if self._stops is not None:
            self._stops.close()


def process_name(pid: int, host: str) -> str:
    """The name of a process another rank saw, where its pid means something (this host); else "?"."""
    if host != os.uname().nodename:
        return "?"
    try:
        import psutil

        return str(psutil.Process(pid).name())
    except Exception:
        return "?"


def summary(f: ContentionFacts) -> dict[str, Any]:
    """The readings a finding shows, unknowns left out."""
    out = {"cpu_got_pct_of_wall": f.cpu_pct, "run_delay_pct_of_wall": f.run_delay_pct,
           "involuntary_switches_per_s": f.nonvoluntary_per_s, "stopped_pct_of_wall": f.stopped_pct, "steal_pct": f.steal_pct,
           "cgroup_throttled_pct_of_wall": f.throttled_pct, "cgroup_cpu_quota_cpus": f.cpu_quota, "cpus": f.cpus,
           "others_on_its_cpus": [c.to_json() for c in f.corunners] or None}
    return {k: v for k, v in out.items() if v is not None}
