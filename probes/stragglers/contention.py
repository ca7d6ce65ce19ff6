"""A rank denied the CPU: who its peers wait for, and why it did not run. Pure; shared by the
`stragglers` probe, the default check's speed comparison (homogeneity) and the training callback.

Why a verdict of its own: a rank that shares its core with another process, sits in a throttled
cgroup or is stopped from outside computes as fast as ever whenever it runs, so its best-case
timings (a best round, a low quantile of its steps) match its peers'. What it loses is wall time
off the CPU, which the kernel counts (measure/contention.py), and what that costs the job is
the time its peers wait for it in the collectives. Both must point at the same rank:
- its share of the wall time denied a CPU (run delay, a spent quota, stopped) exceeds its
  peers' median by LOST_GAP_PTS (ranks that time-share cores evenly lose alike: no verdict);
- its peers wait for it (measured by the caller: the comm wait, or the throughput it got).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ddpdoctor.core.medians import median
from ddpdoctor.measure.contention import ContentionFacts, cpu_count, lost_cpu, summary

# Percentage points of the wall time more than the median of its peers lost. Healthy ranks on the
# 2-core VM, 2 and 4 of them, differ by under 8 points (benchmarks/stragglers_detection.py).
LOST_GAP_PTS = 15.0
MIN_LOST_PCT = 15.0
# Where the processes that took the time are seen: other processes used this share of the rank's own
# cores (no peer runs on them) beyond what they used of its peers' cores, and then a smaller gap in
# lost time suffices. Measured with the callback's tiny steps (1 to 3 ms, 80 steps judged: a quarter
# of a second), a process busy half of every 100 ms on rank 1's core took 25 to 29% of it and slowed
# the job 2.2x, yet rank 1 lost only 8 to 20 points more than rank 0, while healthy pinned ranks, who
# wait for their own communication threads on their one core, differ by up to 13 points.
NEIGHBOUR_PCT = 10.0
NEIGHBOUR_GAP_PTS = 7.5
# A rank slower in its own compute with another process seen on its cores at this share of a CPU beyond
# its peers' is slowed by that neighbour (stragglers/scores.py `_neighbour`). Healthy ranks pinned one to a
# core on the 2-core VM: at most 2.8% over 1,500 readings of the callback's windows.
NEIGHBOUR_SEEN_PCT = 5.0
MIN_THROTTLED_PCT = 5.0
# A spent quota is counted by the kernel itself (cpu.stat's throttled time), and a rank with no quota, or
# one it never reaches, is throttled 0% whatever else runs: no noise to stand out from. So a rank
# throttled this many points more than its peers is held apart by its quota, even where its run delay
# and theirs differ by less than LOST_GAP_PTS. Measured on the callback's loop, rank 1 under a 0.6-CPU
# quota (its process wanted about 0.75): throttled 8 to 19% of the time, its peer 0%, the job 1.6x slower,
# yet its run delay only 13 points above its peer's, which left it unnamed in 3 of 10 runs
# (tests/fixtures/stragglers_outside/quota60_callback_unnamed.json).
QUOTA_GAP_PTS = 7.5
# Causes the kernel counts directly (a cgroup's throttled time, the process stopped): they explain a
# rank's slowness even where its good steps are slow too; run delay alone may come of having more to do.
DIRECT = ("CPU quota", "stopped from outside")

FIX = {
    "CPU contention": ("Give each rank cores nothing else runs on: pin the ranks (`srun --cpu-bind=cores`, `taskset`, "
                       "`numactl`) away from other work, lower DataLoader num_workers to the cores the node has "
                       "spare, and stop or move the other process (`top`, `ps -eo pid,psr,pcpu,comm`)."),
    "CPU quota": ("Check the cgroup CPU quota of the rank's container or job (cgroup v2 `cpu.max`, v1 "
                  "`cpu.cfs_quota_us`/`cpu.cfs_period_us`; `--cpus` of docker, a pod's CPU limit, Slurm's "
                  "--cpus-per-task): it must cover the rank's threads and DataLoader workers."),
    "stopped from outside": ("Find what stops the rank: a scheduler's suspend or preemption, a debugger or profiler "
                             "attaching, a cgroup freezer (`grep State /proc/PID/status`, `dmesg`), and memory "
                             "pressure that makes it page (`vmstat 1`: si/so, majflt)."),
}


@dataclass
class Denied:
    rank: int
    cause: str  # a key of FIX
    lost_pct: float
    peers_lost_pct: float
    sentence: str  # "rank 1 waited for a CPU 48% of the time ...: another process (pid N, name) runs on its core"
    fix: str
    evidence: dict[str, Any] = field(default_factory=dict)
    # Held apart on its own cores by a process seen there (`neighbour_on_own_cores`): its lost time holds every rank.
    held_by_neighbour: bool = False


def who(f: ContentionFacts) -> str:
    if not f.corunners:
        steal = f" (steal {f.steal_pct:g}% of its CPUs: the hypervisor's other guests)" if f.steal_pct else ""
        return f"something not visible from here runs on its CPUs{steal}"
    first = f.corunners[0]
    where = "core" if f.cpus and "," not in f.cpus and "-" not in f.cpus else "CPUs"
    others = (f", and {len(f.corunners) - 1} more" if len(f.corunners) > 1 else "")
    return (f"another process (pid {first.pid}, {first.name}) runs on its {where} ({first.cpu_pct:.0f}% of a CPU)"
            f"{others}")


def classify(rank: int, f: ContentionFacts, peers_lost: float) -> Optional[Denied]:
    """The cause of the CPU time `f` lost, as a sentence; None when it lost little."""
    lost = lost_cpu(f)
    if lost is None or lost < MIN_LOST_PCT:
        return None
    throttled = f.throttled_pct or 0.0
    if throttled >= max(MIN_THROTTLED_PCT, 0.25 * lost):  # a spent quota is the cause even with neighbours too
        cause = "CPU quota"
        quota = f" of {f.cpu_quota:.2g} CPUs" if f.cpu_quota else ""
        detail = f"its cgroup's CPU quota{quota} was spent and it was throttled {throttled:.0f}% of the time"
    elif (f.stopped_pct or 0.0) >= 0.5 * max(lost - peers_lost, MIN_THROTTLED_PCT):
        # Of what it lost beyond its peers (their run delay is its too: its own threads, the
        # machine): a rank stopped 14% of the time with 15% run delay, its peer's 13%, is stopped.
        cause = "stopped from outside"
        detail = f"its process was stopped {f.stopped_pct:.0f}% of the time (SIGSTOP, preemption, a frozen cgroup)"
    else:
        cause = "CPU contention"
        detail = who(f)
    sentence = f"rank {rank} waited for a CPU {lost:.0f}% of the time (its peers {peers_lost:.0f}%): {detail}"
    if cause == "stopped from outside":
        sentence = f"rank {rank} lost {lost:.0f}% of the time off a CPU (its peers {peers_lost:.0f}%): {detail}"
    return Denied(rank=rank, cause=cause, lost_pct=round(lost, 1), peers_lost_pct=round(peers_lost, 1),
                  sentence=sentence, fix=FIX[cause], evidence={"contention": summary(f)})


def denied(contention: Mapping[int, Optional[ContentionFacts]], rank: int,
           peers: Sequence[int]) -> Optional[Denied]:
    """This rank lost LOST_GAP_PTS more of its time off a CPU than the median of its peers (less
    what its own threads may have taken, `own_threads_excess`)."""
    me = contention.get(rank)
    theirs = [c for p in peers if (c := contention.get(p)) is not None]
    known = [v for c in theirs if (v := lost_cpu(c)) is not None]
    lost = lost_cpu(me) if me is not None else None
    if me is None or lost is None or not known:
        return None
    peers_lost = statistics.median(known)
    found = classify(rank, me, peers_lost)
    if found is None:
        return None
    gap = lost - peers_lost
    if found.cause == "CPU contention":
        if _same_cores(me, theirs):
            return None
        gap -= own_threads_discount(me, theirs)
    if gap < _gap_needed(me, theirs) and not (found.cause == "CPU quota" and throttled_gap(me, theirs) >= QUOTA_GAP_PTS):
        return None
    found.evidence["lost_cpu_pct_by_rank"] = {
        r: (None if c is None else lost_cpu(c)) for r, c in sorted(contention.items())}
    return found


def neighbour_on_own_cores(contention: Mapping[int, Optional[ContentionFacts]], rank: int,
                           peers: Sequence[int]) -> bool:
    """Another process seen using NEIGHBOUR_PCT of the rank's own cores beyond its peers'. For a rank held
    apart (`held_apart`), the time it lost beyond its peers is then a lower bound of what it costs every
    rank, as for a stopped or throttled rank (DIRECT), because its communication threads are held with it
    and every collective waits for them. In three runs of Lightning's fit so pinned, a busy process on rank
    1's core, the peers' measured wait for rank 1 came to 6, 8 and 10% of an
    18 ms step (the callback's bar for a verdict is 10%) while rank 1 lost 11 to 13 points more than rank 0
    and the step had gone from 7 to 18 ms."""
    me = contention.get(rank)
    theirs = [c for p in peers if (c := contention.get(p)) is not None]
    return me is not None and bool(theirs) and _neighbour_seen(me, theirs)


def throttled_gap(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> float:
    """Points of the wall time its cgroup was throttled beyond the median of its peers' (QUOTA_GAP_PTS)."""
    return (me.throttled_pct or 0.0) - statistics.median([c.throttled_pct or 0.0 for c in theirs])


def neighbour_excess(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> float:
    """On cores no peer shares, the share of them other processes used beyond what they used of its
    peers' cores (% of a CPU's time, per CPU of the rank): time a neighbour took on its cores, which
    no peer's work pays for. 0 where the ranks time-share cores (a neighbour takes from all alike)."""
    if not theirs or not _own_cores(me, theirs):
        return 0.0
    return max(0.0, neighbour_pct(me) - statistics.median([neighbour_pct(c) for c in theirs]))


def own_threads_pct(f: ContentionFacts) -> Optional[float]:
    """CPU time of the process's other threads (all of them less the training thread's), % of wall."""
    if f.process_cpu_pct is None or f.cpu_pct is None:
        return None
    return max(0.0, f.process_cpu_pct - f.cpu_pct)


def own_threads_excess(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> float:
    """On cores no peer shares, the CPU its own other threads took beyond what its peers' took:
    time they may have held its training thread off its core, which is no neighbour's doing.

    Measured on 2 ranks pinned one to a core, nothing else running, in 5 of 20 runs: one rank's
    communication thread (gloo's transport loop) took 48% of its core against 16% on its peer,
    its training thread lost 30% of its time against 6%, and its peer waited for it, yet the job's
    step was no longer than in the runs where both ranks lost alike (5.8 to 7 ms against 5.4 to
    7.3): which rank arrives last in a 2-rank gloo job on one core each settles one way or the
    other, and costs nothing. Unknown readings count as no excess."""
    mine = own_threads_pct(me)
    known = [v for c in theirs if (v := own_threads_pct(c)) is not None]
    if mine is None or not known or not _own_cores(me, theirs):
        return 0.0
    return max(0.0, mine - statistics.median(known))


def own_threads_discount(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> float:
    """What of its lost time its own threads may have taken (`own_threads_excess`), where nothing else is
    seen on its cores: with another process seen using NEIGHBOUR_PCT of them beyond its peers', that
    process is the observed cause, and busier communication threads are what a rank held off its core
    shows (every collective it is in waits on them). Recorded through Lightning's fit, each rank's main
    thread pinned to its own core after the process group had started its threads (left free: a script that
    pins itself after init_process_group), a busy process on rank 1's core
    (tests/fixtures/stragglers_outside/hog100_lightning_collective_held.json):
    the job's step went from about 7 to 19 ms, both ranks waiting 12 to 14 ms of it in the all-reduce; rank 1
    lost 28% of the wall time against 7%, its other threads took 23% of its core against 6% on rank 0, and the
    busy process 64% of rank 1's core. The discount left 4 of the 21 points, and rank 1 unnamed."""
    return 0.0 if _neighbour_seen(me, theirs) else own_threads_excess(me, theirs)


def _same_cores(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> bool:
    """The rank may run on exactly the CPUs its peers may run on: they time-share the same cores.

    Then another process on those cores takes its time from every rank alike, and which rank
    the scheduler happened to keep waiting longer over a few seconds is chance, not a fault of
    that rank (measured: unpinned healthy ranks beside other sessions' processes on the 2-core
    VM differed by 17-23 points). That is the host's load (HOM015), not a straggler. A
    neighbour on the rank's own core (ranks pinned apart), a spent quota or a stopped process
    belong to the rank and are still named."""
    return bool(me.cpus) and bool(theirs) and all(c.cpus == me.cpus for c in theirs)


def neighbour_pct(f: ContentionFacts) -> float:
    """Of the rank's CPUs, the share other processes used (the co-runners it saw, summed)."""
    return sum(c.cpu_pct for c in f.corunners) / max(cpu_count(f.cpus), 1)


def _own_cores(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> bool:
    """No peer may run on exactly its CPUs: a process on them takes from it alone."""
    return bool(me.cpus) and bool(theirs) and all(c.cpus and c.cpus != me.cpus for c in theirs)


def _neighbour_seen(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> bool:
    """Another process seen using NEIGHBOUR_PCT of its own cores beyond its peers' (`neighbour_excess`)."""
    return neighbour_excess(me, theirs) >= NEIGHBOUR_PCT


def _gap_needed(me: ContentionFacts, theirs: Sequence[ContentionFacts]) -> float:
    """LOST_GAP_PTS, or NEIGHBOUR_GAP_PTS where a neighbour is seen on its own cores (NEIGHBOUR_PCT)."""
    if _neighbour_seen(me, theirs):
        return NEIGHBOUR_GAP_PTS
    return LOST_GAP_PTS


def held_apart(contention: Mapping[int, Optional[ContentionFacts]], rank: int, peers: Sequence[int]) -> bool:
    """Its whole process was held off the CPU LOST_GAP_PTS more of the time than its peers': stopped,
    throttled, or runnable behind another process on cores no peer shares. Such a rank holds every
    collective (its communication threads are held too), so its peers waited for it even where its
    own wait in the collective (it was held in it) hides whose wait it was: measured on 2 ranks
    pinned apart with a busy process on rank 1's core, the job's step went from 1.5 to 3 ms, almost
    all of it in both ranks' all-reduce wait, and the peers' wait for rank 1 exceeded rank 1's wait for
    them by only 7 to 8% of the step while rank 1 lost 34% of its time off a CPU and rank 0 5%
    (benchmarks/stragglers_detection.py --outside, tests/fixtures/stragglers_outside).
    On the same cores as its peers a neighbour takes from every rank alike (`_same_cores`), and
    there only the stopped and throttled time counts."""
    me = contention.get(rank)
    theirs = [c for p in peers if (c := contention.get(p)) is not None]
    if me is None or not theirs:
        return False
    own_cores = _own_cores(me, theirs)

    def held(c: ContentionFacts, own_excess: float = 0.0) -> float:
        direct = (c.stopped_pct or 0.0) + (c.throttled_pct or 0.0)
        return max(direct, (lost_cpu(c) or 0.0) - own_excess) if own_cores else direct

    gap = held(me, own_threads_discount(me, theirs)) - statistics.median([held(c) for c in theirs])
    # Throttled time is the whole cgroup held, counted by the kernel: QUOTA_GAP_PTS suffices.
    return gap >= _gap_needed(me, theirs) or throttled_gap(me, theirs) >= QUOTA_GAP_PTS


def peer_wait_pct(waits: Mapping[int, Sequence[float]], steps: Sequence[float], rank: int,
                  peers: Sequence[int]) -> float:
    """How long its peers waited for this rank in the collectives, as % of the step time: per
    step, the median of the peers' waits minus its own wait (the last to arrive waits least),
    summed over the steps (contention comes in bursts: a median step would hide it)."""
    total = sum(steps)
    if not peers or total <= 0:
        return 0.0
    n = min([len(waits[rank])] + [len(waits[p]) for p in peers])
    extra = sum(max(0.0, median([waits[p][i] for p in peers]) - waits[rank][i]) for i in range(n))
    return 100.0 * extra / total
