"""From per-step series to straggler scores, causes and findings: pure, tested on recordings.

Why these rules:
- DDP is synchronous, so every rank's *step* takes as long as the slowest one's. What
  differs is the rank's own *work* (its step minus its wait for the gradient all-reduce)
  and its *arrival* at the all-reduce. The straggler arrives last and waits least.
- A rank is scored against the median of its peers, window by window (a low quantile of
  each of WINDOWS windows of steps, so a single slow step or a burst of host noise cannot
  make a verdict), and must be slow in most windows (PERSIST_SHARE), not in one.
- Work is divided by the samples the rank processed, so a rank that got more data is an
  imbalance, not slow hardware.
- The cause is the part of its work that is longer than its peers': data loading,
  compute (confirmed by compute-only steps with no collective, then explained from the
  sampled host and GPU state), or neither (host overhead between the measured phases).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ddpdoctor.core import codes
from ddpdoctor.core.medians import median, median_without
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, Severity, rank_ranges

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.stragglers.contention import (DIRECT, FIX, NEIGHBOUR_SEEN_PCT, Denied, denied, held_apart,
                                                   neighbour_excess, neighbour_on_own_cores, own_threads_excess,
                                                   peer_wait_pct, who)
from ddpdoctor.probes.stragglers.facts import SampledFacts, StragglersFacts, Summary

NAME = "stragglers"
# Defaults, in percent slower than the median of the other ranks. On this project's 2-core
# VM, four healthy CPU ranks' scores stay below ~9% (benchmarks/stragglers_detection.py);
# GPUs are exclusive and steadier. A 10% gap costs a synchronous job 10% of its time,
# which is worth a warning.
DEFAULT_THRESHOLD_PCT = {"gpu": 8.0, "cpu": 10.0}
WINDOWS = 8
PERSIST_SHARE = 0.6  # of the windows a straggler must be slow in
# Intermittent: not persistent, but at least 2 windows this many times the threshold slow. Healthy
# ranks on the VM reach 2x the threshold in one window, rarely two, never two at 3x (60 runs).
INTERMITTENT_TIMES = 3.0
# Noise (a descheduled rank, an interrupt, a page fault) only ever adds time to a step, so a
# window's low quantile is what the rank can do and a rank slow even there is really slow.
# On the 2-core VM with 4 ranks, window medians of healthy ranks spread by up to 30%, their
# 10th percentiles by under 10% (benchmarks/stragglers_detection.py).
LOW_QUANTILE = 0.1
MIN_STEPS = 15
UNEVEN_SAMPLES = 1.05  # more than 5% more samples per step than the median rank
MEMORY_UNEVEN_SHARE = 0.25
MEMORY_UNEVEN_BYTES = 256 * 2**20
COMM_BOUND_SHARE = 0.5
UTIL_GAP_POINTS = 20.0
# Of a rank's extra work (against its peers) that its extra wait for a CPU must cover for the CPU
# denied to be the cause even when its best steps are slow too.
EXPLAINS_SHARE = 0.5
# Of a rank's extra work, how much later than its peers it must arrive at the all-reduce to be slow.
ARRIVES_SHARE = 0.5
# Of its score, how much slower a rank's compute-only steps must be for them to show it slow where
# its arrival times cannot (`_arrives_last`).
ALONE_SHARE = 0.5
# A neighbour seen on a CPU rank's own cores explains its slower compute when the CPU time it took there
# (beyond what it took on its peers' cores) is at least this share of the rank's extra work (`_neighbour`).
NEIGHBOUR_SHARE = 0.25
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown",
                    "sw_power_cap", "board_limit", "reliability")

ByRank = Mapping[int, StragglersFacts]


def _median(values: Sequence[float]) -> float:
    return median(values)


def _low(values: Sequence[float]) -> float:
    """The LOW_QUANTILE of a window's steps: what the rank does when nothing else gets in its way."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(LOW_QUANTILE * len(ordered)))]


@dataclass
class RankScore:
    rank: int
    host: str
    step_ms: float
    work_ms: float
    data_ms: float
    compute_ms: float  # forward + backward compute
    optimizer_ms: float
    comm_wait_ms: float
    samples: float
    # % slower than the median of its peers, median over windows, by work (its step minus its wait
    # at the all-reduce: from leaving one all-reduce to arriving at the next) per sample
    score_pct: float
    flagged_windows: int
    windows: int
    late_ms: Optional[float]  # median arrival at the all-reduce after the median of its peers
    vs_own_best_pct: float  # its median window vs its own best window
    solo_ms: Optional[float]
    window_pct: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"step_ms": round(self.step_ms, 2), "compute_ms": round(self.compute_ms, 2),
                "comm_wait_ms": round(self.comm_wait_ms, 2), "data_ms": round(self.data_ms, 2),
                "score_pct": round(self.score_pct, 1), "late_ms": None if self.late_ms is None else round(self.late_ms, 2)}


@dataclass
class Scores:
    ranks: dict[int, RankScore]
    steps: int
    window: int
    threshold_pct: float
    clocks_known: bool
    kind: str  # "gpu" | "cpu"
    # Per rank, per step (the first `steps` of each): data, compute, optimizer and work, in ms.
    phases: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    # What the rules derive from these scores more than once (`_excess`, `_peer_waits`): computed
    # once a judging. The callback judges inside the training loop, where each costs milliseconds.
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def peers(self, rank: int) -> list[int]:
        """The ranks it is compared with: those with as many samples a step, when there are any.

        A step has fixed costs (optimizer, Python), so work per sample is only comparable
        between equal batches; a rank with another batch is STR003's, not a straggler."""
        others = [p for p in self.ranks if p != rank]
        same = [p for p in others if self.ranks[p].samples == self.ranks[rank].samples]
        return same or others


def _floats(values: Sequence[float]) -> list[float]:
    """JSON may hold a whole number where a float was written."""
    return list(map(float, values))


def _usable(f: StragglersFacts) -> bool:
    return bool(f.steps.step_ms)


def by_rank(facts: Mapping[Any, Any]) -> dict[int, StragglersFacts]:
    """Typed facts keyed by int rank: a report read back from JSON has plain objects keyed by strings."""
    return facts_by_rank(StragglersFacts, facts)


def threshold_for(facts: ByRank, run: RunView) -> tuple[float, str]:
    kind = "gpu" if any(f.device.startswith("cuda") for f in facts.values()) else "cpu"
    setting = run.settings.get("slow_threshold_pct")
    return (float(setting) if setting is not None else DEFAULT_THRESHOLD_PCT[kind]), kind


def score(facts: ByRank, run: RunView) -> Optional[Scores]:
    """None when fewer than two ranks or too few steps to compare."""
    facts = by_rank(facts)
    ranks = sorted(r for r, f in facts.items() if _usable(f))
    if len(ranks) < 2:
        return None
    n = min(len(facts[r].steps.step_ms) for r in ranks)
    if n < MIN_STEPS:
        return None
    threshold, kind = threshold_for(facts, run)
    windows = min(WINDOWS, n // 3)
    size = n // windows
    col = {r: {k: _floats(v)[:n] for k, v in facts[r].steps.columns().items()} for r in ranks}
    samples = {r: (_floats(facts[r].samples)[:n] or [1.0] * n) for r in ranks}
    work = {r: [col[r]["step_ms"][i] - col[r]["comm_wait_ms"][i] for i in range(n)] for r in ranks}
    per_sample = {r: [work[r][i] / max(samples[r][i], 1.0) for i in range(n)] for r in ranks}
    win = {r: [_low(per_sample[r][w * size:(w + 1) * size]) for w in range(windows)] for r in ranks}
    arrivals = {r: _floats(facts[r].arrival_s)[:n] for r in ranks}
    clocks_known = all(len(arrivals[r]) == n and facts[r].clock.error_ms is not None for r in ranks)
    typical_samples = {r: _median(samples[r]) for r in ranks}
    # Each window's values over all ranks, sorted once: where a rank's peers are all the others (the usual case,
    # every rank with the same batch), their median is read off it (median_without) instead of a sort per rank,
    # the same floats: at 256 ranks the sorts were most of a judging (benchmarks/end_of_run_cost.py).
    everyone = [sorted(win[p][w] for p in ranks) for w in range(windows)]
    out: dict[int, RankScore] = {}
    for r in ranks:
        others = [p for p in ranks if p != r]
        peers = [p for p in others if typical_samples[p] == typical_samples[r]] or others
        if len(peers) == len(others):
            pct = [100.0 * (win[r][w] / median_without(everyone[w], win[r][w]) - 1.0) for w in range(windows)]
        else:
            pct = [100.0 * (win[r][w] / _median([win[p][w] for p in peers]) - 1.0) for w in range(windows)]
        late = None
        if clocks_known:
            late = _median([1e3 * (arrivals[r][i] - _median([arrivals[p][i] for p in others])) for i in range(n)])
        solo = _floats(facts[r].solo_ms)
        out[r] = RankScore(
            rank=r, host=str(facts[r].host), step_ms=_median(col[r]["step_ms"]), work_ms=_median(work[r]),
            data_ms=_median(col[r]["data_ms"]),
            compute_ms=_median([a + b for a, b in zip(col[r]["forward_ms"], col[r]["backward_ms"])]),
            optimizer_ms=_median(col[r]["optimizer_ms"]), comm_wait_ms=_median(col[r]["comm_wait_ms"]),
            samples=typical_samples[r], score_pct=_median(pct), flagged_windows=sum(p >= threshold for p in pct),
            windows=windows, late_ms=late, vs_own_best_pct=100.0 * (_median(win[r]) / min(win[r]) - 1.0),
            solo_ms=_low(solo) if solo else None, window_pct=[round(p, 1) for p in pct])
    phases = {r: {"data": col[r]["data_ms"], "optimizer": col[r]["optimizer_ms"], "work": work[r],
                  "compute": [a + b for a, b in zip(col[r]["forward_ms"], col[r]["backward_ms"])]} for r in ranks}
    return Scores(out, n, size, threshold, clocks_known, kind, phases)


def _persistent(s: RankScore, threshold: float) -> bool:
    return s.score_pct >= threshold and s.flagged_windows >= max(2, round(PERSIST_SHARE * s.windows))


def _excess(scores: Scores, rank: int) -> dict[str, float]:
    """Per step, this rank's phase minus the median of its peers' same step, then the median."""
    key = ("excess", rank)
    if key in scores.derived:
        return dict(scores.derived[key])
    peers = scores.peers(rank)
    ph = scores.phases
    out = {key: _median([ph[rank][key][i] - _median([ph[p][key][i] for p in peers]) for i in range(scores.steps)])
           for key in ("data", "compute", "optimizer", "work")}
    out["other"] = out["work"] - out["data"] - out["compute"] - out["optimizer"]
    scores.derived[key] = dict(out)
    return out


def _cost_ms(scores: Scores, slow: Sequence[int]) -> float:
    """How much shorter the median step would be without these ranks' extra work.

    A step lasts as long as the longest work among the ranks (then the transfer): the
    median of that over steps, minus the same without them. Per-step differences would
    be mostly noise here: with several noisy peers, one of them is often the longest."""
    rest = [r for r in scores.ranks if r not in slow]
    if not rest or not slow:
        return 0.0
    work = scores.phases
    every = _median([max(work[r]["work"][i] for r in scores.ranks) for i in range(scores.steps)])
    without = _median([max(work[r]["work"][i] for r in rest) for i in range(scores.steps)])
    return max(0.0, every - without)


def _cause(facts: ByRank, scores: Scores, rank: int) -> tuple[str, str, str, dict[str, Any]]:
    """(cause, explanation, fix, evidence) from where the rank's extra time goes."""
    ex = _excess(scores, rank)
    me = scores.ranks[rank]
    peers = scores.peers(rank)
    evidence: dict[str, Any] = {"extra_ms_per_step": {k: round(v, 2) for k, v in ex.items()}}
    total = max(ex["work"], 1e-9)
    if ex["data"] >= 0.5 * total:
        peer_data = _median([scores.ranks[p].data_ms for p in peers])
        return ("data loading",
                f"its data loading takes {me.data_ms:.1f} ms a step against {peer_data:.1f} ms on its peers",
                ("Profile that rank's input pipeline: more DataLoader workers (num_workers), pin_memory=True, "
                 "persistent_workers=True, a larger prefetch_factor; check its node's storage and network file "
                 "system (`iostat -x 1`) and CPU availability for the workers."), evidence)
    solo_pct = _alone_slower_pct(scores, rank)
    if solo_pct is not None:
        evidence["compute_only_ms"] = {p: round(v, 2) for p, s in scores.ranks.items() if (v := s.solo_ms)}
        evidence["compute_only_slower_pct"] = round(solo_pct, 1)
    if ex["compute"] + ex["optimizer"] >= 0.5 * total:
        alone = (f"; alone, with no collective, its forward+backward is {solo_pct:.0f}% slower too"
                 if solo_pct is not None and solo_pct > 0 else "")
        theirs = _median([scores.ranks[p].compute_ms for p in peers])
        took = f"its forward and backward take {me.compute_ms:.1f} ms against {theirs:.1f} ms on its peers"
        neighbour = _neighbour(facts, scores, rank)
        if neighbour:
            return ("CPU contention", f"{took}, and {neighbour}", FIX["CPU contention"],
                    evidence | _host_evidence(facts, rank))
        why, fix = _compute_reason(facts, scores, rank)
        return ("compute", f"{took}{alone}",
                fix, {"reason": why} | evidence | _host_evidence(facts, rank))
    return ("host overhead",
            (f"its extra time is outside data loading and compute ({ex['other']:.1f} ms a step between the measured "
             "phases): Python overhead, a busy or descheduled CPU, or page faults"),
            ("Look for other processes on that rank's cores (`top -H`, `ps -eo pid,psr,pcpu,comm`), its CPU affinity "
             "(`taskset -p PID`) and memory pressure (`vmstat 1`)."), evidence | _host_evidence(facts, rank))


def _neighbour(facts: ByRank, scores: Scores, rank: int) -> Optional[str]:
    """Another process seen on the cores of a CPU rank and not on its peers' (NEIGHBOUR_SEEN_PCT of a
    CPU beyond theirs), as a sentence: then its slower compute is that neighbour's doing, not its own
    model or hardware. A process on its core takes its time and its caches and memory bandwidth, so
    even its CPU time per step grows and the rules on the CPU denied (lost time) may not reach it.
    Recorded on the callback, 2 ranks pinned one to a core, an unpinned process touching 2 GiB
    (`--inject mempressure`) that the scheduler kept on rank 1's core for a while: rank 1's work 3x
    rank 0's, its peer waiting for it half of each step, its training thread on a CPU 20 points more
    and its run delay only 8 points more; the process seen on its core at 12% of a CPU, never on rank
    0's (0.5 ms a step of its 1.5 ms of extra work); the verdict before was `compute` with "nothing
    sampled on its host explains it"
    (tests/fixtures/stragglers_outside/mempressure_callback_neighbour.json). Not on GPU ranks, whose
    compute is the device's."""
    me, dev = facts[rank].contention, facts[rank].device
    theirs = [c for p in scores.peers(rank) if (c := facts[p].contention) is not None]
    if dev.startswith("cuda") or me is None or not theirs:
        return None
    excess_pct = neighbour_excess(me, theirs)
    # A neighbour's time must also be a real part of its extra work (a quarter): a rank with twice the
    # work beside a process seen at 6% of its core is slow by its work.
    if excess_pct < NEIGHBOUR_SEEN_PCT or not _covers_extra_work(facts, scores, rank, excess_pct, NEIGHBOUR_SHARE):
        return None
    return who(me) + ", and on none of its peers' (a neighbour on its core takes its time, caches and memory bandwidth)"


def _alone_slower_pct(scores: Scores, rank: int) -> Optional[float]:
    """How much slower its compute-only steps (forward and backward, no collective: the probe's
    solo steps) are than its peers', in %; None where they were not measured."""
    me = scores.ranks[rank]
    solos = [s.solo_ms for p, s in scores.ranks.items() if p in scores.peers(rank) and s.solo_ms]
    if not me.solo_ms or not solos:
        return None
    return 100.0 * (me.solo_ms / _median(solos) - 1.0)


def _median_of(summary: Optional[Summary]) -> Optional[float]:
    """A sampled quantity's median; None when it was not sampled (a GPU's on a CPU rank)."""
    return summary.median if summary is not None else None


def _host_evidence(facts: ByRank, rank: int) -> dict[str, Any]:
    s = facts[rank].sampled
    out = {"host_cpu_pct_median": _median_of(s.host_cpu_pct),
           "process_cpu_pct_median": _median_of(s.process_cpu_pct),
           "load_avg_1m": s.load_avg_1m, "cpus_usable": s.cpus_usable,
           "cpu_affinity": s.cpu_affinity,
           "memory_available_pct_min": _min_available(s),
           "clock_event_reasons": s.clock_event_reasons or None,
           "sm_clock_mhz_median": _median_of(s.sm_clock_mhz)}
    return {k: v for k, v in out.items() if v is not None}


def _min_available(s: SampledFacts) -> Optional[float]:
    return s.memory_available_pct.min if s.memory_available_pct is not None else None


def _compute_reason(facts: ByRank, scores: Scores, rank: int) -> tuple[str, str]:
    """Why its compute is slower, from what was sampled on it and on its peers."""
    f = facts[rank]
    s = f.sampled
    peers = scores.peers(rank)
    # Only reasons its peers do not report: at full load every GPU may sit at its power cap.
    theirs = {x for p in peers for x in facts[p].sampled.clock_event_reasons}
    reasons = [x for x in s.clock_event_reasons if x in SLOWDOWN_REASONS and x not in theirs]
    if reasons:
        return (f"Its GPU reported {', '.join(reasons)} while training: the clocks were held down.",
                "On that GPU: `nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`; check cooling and power capping "
                "(`nvidia-smi -pl`), then drain the node if it persists.")
    names = {str(facts[p].device_name) for p in peers}
    if f.device_name and str(f.device_name) not in names:
        return (f"It runs on a {f.device_name}, its peers on {', '.join(sorted(names))}.",
                "Run the job on identical devices (a Slurm constraint, or exclude the odd node).")
    clock = _median_of(s.sm_clock_mhz)
    peer_clocks = [_median_of(facts[p].sampled.sm_clock_mhz) for p in peers]
    peer_clock = _median([c for c in peer_clocks if c])
    if clock and peer_clock == peer_clock and clock < 0.9 * peer_clock:
        return (f"Its SM clock ran at {clock:.0f} MHz against {peer_clock:.0f} MHz on its peers.",
                "Reset application clocks (`nvidia-smi -rac`) and look for power or thermal limits on that GPU.")
    host_cpu = _median_of(s.host_cpu_pct)
    load, cpus = s.load_avg_1m, s.host_cpus
    on_other_hosts = [p for p in peers if facts[p].host != f.host]
    if on_other_hosts and host_cpu is not None and host_cpu >= 90 and load and cpus and load >= cpus:
        return (f"Its host is CPU-saturated ({host_cpu:.0f}% busy, load {load:g} on {cpus} CPUs).",
                "Find what else runs on that node (`top`), or give each rank dedicated cores.")
    usable, threads = s.cpus_usable, f.torch_threads
    if usable and threads and not f.device.startswith("cuda") and usable < threads:
        return (f"It may run on {usable} CPUs but torch uses {threads} threads.",
                "Set OMP_NUM_THREADS to the cores each rank really has.")
    avail = _min_available(s)
    if avail is not None and avail < 10:
        return (f"Its host had only {avail:.0f}% of memory available: swapping or page-cache thrashing.",
                "Lower host memory use (DataLoader workers, pinned buffers) or use nodes with more RAM.")
    return ("Nothing sampled on its host or device explains it: another process on its cores or device, "
            "frequency scaling, or slower hardware.",
            ("On that node: `nvidia-smi` for other processes and throttle reasons, `top` for CPU hogs, and its "
             "CPU affinity (`taskset -p PID`)."))


def diagnose_stragglers(facts: ByRank, run: RunView) -> list[Finding]:
    findings: list[Finding] = []
    facts = by_rank(facts)
    missing = [r for r in range(run.world_size) if r not in facts]
    scores = score(facts, run)
    if scores is None:
        usable = [r for r in sorted(facts) if _usable(facts[r])]
        if usable:
            steps = min(len(facts[r].steps.step_ms) for r in usable)
            findings.append(codes.finding(
                "STR007", NAME,
                (f"Stragglers not judged: {len(usable)} rank{'s' if len(usable) != 1 else ''} with "
                 f"{steps} measured steps (need 2 ranks and {MIN_STEPS} steps)"),
                ranks=tuple(usable), nodes=run.nodes_of(usable),
                evidence={"steps": steps, "ranks": len(usable),
                          "missing_ranks": missing}))
        return findings
    findings += _imbalance(facts, scores, run)
    # A rank with another batch size is STR003's: its work per sample carries the step's fixed
    # costs over another number of samples, so it is not compared as hardware.
    uneven_batch = {r for f in findings if f.code == "STR003" for r in f.ranks}
    slow = [r for r, s in sorted(scores.ranks.items())
            if _persistent(s, scores.threshold_pct) and r not in uneven_batch and _excess(scores, r)["work"] > 0
            and _arrives_last(scores, r) and not _own_threads_explain(facts, scores, r)
            and _extra_work_is_work(facts, scores, r)]
    # A rank slow in its good steps too, in its data or compute, is slow by itself (it also waits longer
    # for a CPU, having more to do); the CPU denied explains the others, extra time outside both, and
    # any rank whose cgroup throttled it or whose process was stopped (counted directly, DIRECT).
    starved = {r: v for r, v in _denied_cpu(facts, scores, uneven_batch).items()
               if r not in slow or v[0].cause in DIRECT or _denied_explains(facts, scores, r, v[0])}
    if starved:
        # Its peers share the job with it: waiting for it (and waking from that wait) slows them
        # too, in their own timings. Another rank is named beside it only if they wait for that one too.
        waited = _peer_waits(facts, scores)
        slow = [r for r in slow if r in starved or _waited_for(waited, scores, r)]
    slow = sorted(set(slow) | set(starved))
    for r in slow:
        findings.append(_starved(scores, run, starved[r]) if r in starved else _straggler(facts, scores, run, r))
    intermittent = [r for r, s in sorted(scores.ranks.items()) if r not in slow and r not in uneven_batch
                    and sum(p >= INTERMITTENT_TIMES * scores.threshold_pct for p in s.window_pct) >= 2]
    if intermittent:
        findings.append(_intermittent(scores, run, intermittent))
    findings += _comm_bound(scores, run, slow)
    if not any(f.severity >= Severity.WARN for f in findings):
        findings.insert(0, _all_clear(scores, run))
    return findings


def _own_threads_explain(facts: ByRank, scores: Scores, rank: int) -> bool:
    """Its own other threads took more of its cores than its peers' did (stragglers/contention.py
    `own_threads_excess`), enough to cover half its extra work: the same work its peers' threads do
    while they wait, landing in its own steps instead. Recorded on 2 healthy ranks pinned one to a
    core: rank 0's transport thread took 48% of its core against 16%, its work was 2.75 ms a step
    above rank 1's, and the job's step was as long as when neither rank was behind
    (tests/fixtures/stragglers_outside/healthy_pinned_own_threads.json)."""
    me = facts[rank].contention
    theirs = [c for p in scores.peers(rank) if (c := facts[p].contention) is not None]
    if me is None or not theirs:
        return False
    excess_pct = own_threads_excess(me, theirs)
    return excess_pct > 0 and _covers_extra_work(facts, scores, rank, excess_pct)


def _extra_work_is_work(facts: ByRank, scores: Scores, rank: int) -> bool:
    """On CPU ranks, extra time in the step (not in data loading) is the rank's own only if it is
    CPU time: its training thread got more CPU per step than its peers' by half that extra time at
    least (EXPLAINS_SHARE). A rank given the same CPU time as its peers but taking longer did not
    do more work: it waited for a CPU, its memory or its own threads, which the rules on the CPU
    denied judge (they name a rank held off its cores; the scheduler's draw between ranks that
    time-share cores they do not, as HOM015 says). Recorded on 2 healthy unpinned ranks on 2 cores
    (callback, 2 ms steps): rank 1's in-step work was 0.25 ms above rank 0's, 24% of it, while
    each training thread got 56% of the wall time, 0.04 ms a step apart; a rank really computing
    20% more spins that much more CPU (tests/fixtures/stragglers_outside/healthy_unpinned_cpu_equal.json).
    Not judged on GPU ranks (their work is the GPU's) nor where a CPU reading is missing."""
    me, dev = facts[rank].contention, facts[rank].device
    theirs = [c.cpu_pct for p in scores.peers(rank) if (c := facts[p].contention) is not None and c.cpu_pct is not None]
    if dev.startswith("cuda") or me is None or me.cpu_pct is None or not theirs:
        return True
    ex = _excess(scores, rank)
    in_step = ex["work"] - ex["data"]
    if in_step <= 0.5 * ex["work"]:
        return True  # mostly data loading: a loader may wait for a disk, the rule is not for it
    step = statistics.fmean(_floats(facts[rank].steps.step_ms)[:scores.steps])
    extra_cpu_ms = (me.cpu_pct - _median(theirs)) / 100.0 * step
    return extra_cpu_ms >= EXPLAINS_SHARE * in_step


def _covers_extra_work(facts: ByRank, scores: Scores, rank: int, pct_of_wall: float,
                       share: float = EXPLAINS_SHARE) -> bool:
    """This share of the rank's wall time, per step, is at least `share` of its extra work."""
    steps = _floats(facts[rank].steps.step_ms)[:scores.steps]
    return pct_of_wall / 100.0 * statistics.fmean(steps) >= share * _excess(scores, rank)["work"]


def _arrives_last(scores: Scores, rank: int) -> bool:
    """A rank slow in its own work arrives last at the all-reduce, so it waits no longer than its
    peers there. One that waits longer is waiting for someone else: a victim, whose own work may
    look slower beside a rank denied the CPU (measured on the 2-core VM: a healthy rank 0 idling in
    the all-reduce 80% of each step while rank 1 shared its core with a busy process computed 0.45
    ms a step against 0.30 ms, and waited 2.5 ms against rank 1's 1.9). Not judged where the waits
    were not measured (all zero).

    Where the arrival times are known (clock-corrected, the probe), it must also arrive later than
    its peers by half its extra work at least (ARRIVES_SHARE): extra work that does not delay its
    arrival is time counted as work after the previous all-reduce (waking from it), not time the
    job waits for. Measured: a rank really 1.2x slower arrives 0.94 ms late on 1.11 ms of extra work
    (tests/fixtures/stragglers/slow_compute_x1.2_rank2.json); the one healthy 2-rank run of 20 that
    scored a rank 12% slower had it arrive 0.05 ms late on 0.13 ms
    (tests/fixtures/stragglers_outside/healthy_pinned_not_late.json)."""
    waits = [s.comm_wait_ms for s in scores.ranks.values()]
    me = scores.ranks[rank]
    if any(w > 0 for w in waits) and me.comm_wait_ms > _median([scores.ranks[p].comm_wait_ms
                                                              for p in scores.peers(rank)]):
        return False
    if me.late_ms is None or me.late_ms >= ARRIVES_SHARE * _excess(scores, rank)["work"]:
        return True
    # Its steps with no collective at all are slower too: the extra time is not the waking from an
    # all-reduce, whatever the arrival times say. Needed where ranks time-share cores: 4 ranks on 2
    # cores, rank 1 computing 2x (95% slower in 8 of 8 windows, 9x slower alone) and rank 2 stalled
    # in its loader, rank 1's arrivals spread over +-10 ms a step around its peers' and their median
    # came out 0.9 ms early, and it was called intermittent
    # (tests/fixtures/stragglers/two_slow_ranks_4_on_2_cores.json). Its best steps alone must be
    # slower by half its score at least.
    alone = _alone_slower_pct(scores, rank)
    return alone is not None and alone >= max(scores.threshold_pct, ALONE_SHARE * me.score_pct)


def _peer_waits(facts: ByRank, scores: Scores) -> dict[int, float]:
    """Per rank, how long its peers waited for it in the all-reduce, as % of the step time."""
    if "peer_waits" in scores.derived:
        return dict(scores.derived["peer_waits"])
    n = scores.steps
    waits = {r: _floats(facts[r].steps.comm_wait_ms)[:n] for r in scores.ranks}
    steps = [_median([float(facts[r].steps.step_ms[i]) for r in scores.ranks]) for i in range(n)]
    out = {r: peer_wait_pct(waits, steps, r, scores.peers(r)) for r in scores.ranks}
    scores.derived["peer_waits"] = dict(out)
    return out


def _denied_cpu(facts: ByRank, scores: Scores, skip: set[int]) -> dict[int, tuple[Denied, float, float]]:
    """Ranks denied the CPU (stragglers/contention.py) that their peers wait for: (why, the peers'
    wait for it and the median of that over its peers, in % of the step time)."""
    contention = {r: facts[r].contention for r in scores.ranks}
    if sum(c is not None for c in contention.values()) < 2:
        return {}
    out = {}
    for r in sorted(scores.ranks):
        if r in skip:
            continue
        why = denied(contention, r, scores.peers(r))
        if why is None:
            continue
        waited = _peer_waits(facts, scores)  # only where a rank was denied: healthy checks skip its cost
        held = held_apart(contention, r, scores.peers(r))
        if _waited_for(waited, scores, r) or held:
            why.held_by_neighbour = held and neighbour_on_own_cores(contention, r, scores.peers(r))
            out[r] = (why, waited[r], _median([waited[p] for p in scores.peers(r)]))
    return out


def _waited_for(waited: Mapping[int, float], scores: Scores, rank: int) -> bool:
    """Its peers waited for it the threshold longer (in % of the step) than for the median of them."""
    return waited[rank] - _median([waited[p] for p in scores.peers(rank)]) >= scores.threshold_pct


def _denied_explains(facts: ByRank, scores: Scores, rank: int, why: Denied) -> bool:
    """A rank slow in its good steps too is denied the CPU, not slow by itself, when the time it waited
    for a CPU beyond its peers covers most of its extra work (a neighbour running the whole time
    slows every step, the best too); a rank that computes more spends its extra time on a CPU."""
    if _cause(facts, scores, rank)[0] == "host overhead":
        return True
    return _covers_extra_work(facts, scores, rank, why.lost_pct - why.peers_lost_pct)


def _starved(scores: Scores, run: RunView, found: tuple[Denied, float, float]) -> Finding:
    """STR001 for a rank its peers wait for because it did not get the CPU: the cause named."""
    why, waited, usual = found
    rank = why.rank
    s = scores.ranks[rank]
    step = _median([p.step_ms for p in scores.ranks.values()])
    # What it costs the job: the time its peers waited for it, or, for a rank stopped or throttled
    # from outside (DIRECT: the kernel counted it), the wall time it lost beyond its peers where that
    # is more. In a synchronous job a stopped rank holds every rank; the callback reads the wait from
    # DDP's sampled iterations (callback/reducer_wait.py), where a stop burst mostly lands on
    # unsampled ones: a rank stopped 16-33% of each window was seen waited for 4-14% after its first
    # checks, under the callback's 10% bar, and went unnamed in 3 of 10 runs of the e2e test's loop.
    # The same holds for a rank held apart on its own cores by a process seen there (contention.neighbour_on_own_cores).
    share = max(waited, why.lost_pct - why.peers_lost_pct) if why.cause in DIRECT or why.held_by_neighbour else waited
    return codes.finding(
        "STR001", NAME,
        f"Rank {rank} on {s.host} is a straggler ({why.cause}): {why.sentence}",
        severity=Severity.CRITICAL if waited >= 50 else Severity.WARN, ranks=(rank,), nodes=run.nodes_of([rank]),
        evidence={"cause": why.cause, "where": why.sentence,
                  "measured": (f"over {scores.steps} steps its peers waited for it in the gradient all-reduce "
                               f"{waited:.1f}% of the step time (the median rank is waited for {usual:.1f}%); "
                               f"it lost {why.lost_pct:g}% of the wall time off a CPU, its peers "
                               f"{why.peers_lost_pct:g}%"),
                  "peers_wait_pct_of_step": round(waited, 1),
                  "cost_ms_per_step": round(share * step / 100.0, 2), "median_step_ms": round(step, 2),
                  "per_rank": _table(scores), **why.evidence},
        fix=why.fix)


def _table(scores: Scores) -> dict[int, str]:
    return {r: (f"step {s.step_ms:.1f} ms, compute {s.compute_ms:.1f}, comm wait {s.comm_wait_ms:.1f}, "
                f"data {s.data_ms:.1f}, {s.score_pct:+.1f}% vs peers, {s.vs_own_best_pct:+.1f}% vs its best window"
                + ("" if s.late_ms is None else f", arrives {s.late_ms:+.1f} ms"))
            for r, s in sorted(scores.ranks.items())}


def _straggler(facts: ByRank, scores: Scores, run: RunView, rank: int) -> Finding:
    s = scores.ranks[rank]
    peers = scores.peers(rank)
    cause, explanation, fix, evidence = _cause(facts, scores, rank)
    cost = _cost_ms(scores, [rank])
    step = _median([scores.ranks[p].step_ms for p in scores.ranks])
    peer_wait = _median([scores.ranks[p].comm_wait_ms for p in peers])
    arrival = f"waits {s.comm_wait_ms:.1f} ms a step for the gradient all-reduce while its peers wait {peer_wait:.1f}"
    if s.late_ms is not None:
        when = f"{s.late_ms:.1f} ms after" if s.late_ms >= 0 else f"{-s.late_ms:.1f} ms before"
        arrival += f", and arrives {when} the median of the others (clock-corrected)"
    # Critical when it costs half of every step: the job would run twice as fast without it.
    severity = Severity.CRITICAL if step > 0 and cost / step >= 0.5 else Severity.WARN
    return codes.finding(
        "STR001", NAME,
        (f"Rank {rank} on {s.host} is a straggler: {s.score_pct:.0f}% slower than its peers ({cause}); "
         f"every step would take {100 * cost / step:.0f}% less time without it" if step > 0 else
         f"Rank {rank} on {s.host} is a straggler ({cause})"),
        severity=severity, ranks=(rank,), nodes=run.nodes_of([rank]),
        evidence={
            "cause": cause,
            "measured": f"over {scores.steps} steps it {arrival}",
            "where": explanation,
            "slower_than_peers_pct_by_window": s.window_pct,
            "slow_windows": f"{s.flagged_windows} of {s.windows} (threshold {scores.threshold_pct:g}%)",
            "cost_ms_per_step": round(cost, 2), "median_step_ms": round(step, 2),
            "per_rank": _table(scores), **evidence,
        },
        fix=fix)


def _intermittent(scores: Scores, run: RunView, ranks: list[int]) -> Finding:
    return codes.finding(
        "STR008", NAME,
        (f"Rank {rank_ranges(ranks)} slower in some windows only: noise or an intermittent slowdown, not a "
         "straggler"),
        ranks=tuple(ranks), nodes=run.nodes_of(ranks),
        evidence={"slower_than_peers_pct_by_window": {r: scores.ranks[r].window_pct for r in ranks},
                  "rule": (f"a straggler is {scores.threshold_pct:g}% slower in at least {PERSIST_SHARE:.0%} "
                           f"of the windows; these were {INTERMITTENT_TIMES * scores.threshold_pct:g}% slower in "
                           "two or more")})


def _imbalance(facts: ByRank, scores: Scores, run: RunView) -> list[Finding]:
    out: list[Finding] = []
    samples = {r: s.samples for r, s in scores.ranks.items()}
    typical = _median(list(samples.values()))
    heavy = sorted(r for r, v in samples.items() if typical > 0 and v > UNEVEN_SAMPLES * typical)
    light = sorted(r for r, v in samples.items() if typical > 0 and v * UNEVEN_SAMPLES < typical)
    if heavy or light:
        odd = heavy or light
        cost = _cost_ms(scores, heavy) if heavy else 0.0
        step = _median([s.step_ms for s in scores.ranks.values()])
        waits = f"; the others wait {cost:.1f} ms a step for it" if heavy and cost >= 0.05 * step else ""
        slower = [r for r in odd if scores.ranks[r].score_pct >= scores.threshold_pct]
        per_sample = (f"Per sample, rank {rank_ranges(slower)} is also slower than its peers: check it for a slow "
                      "device once the data is balanced." if slower else
                      "Per sample it works at least as fast as its peers: this is the data split, not the hardware.")
        out.append(codes.finding(
            "STR003", NAME,
            (f"Uneven work: rank {rank_ranges(odd)} processes {samples[odd[0]]:g} samples a step, the median "
             f"rank {typical:g}{waits}"),
            ranks=tuple(odd), nodes=run.nodes_of(odd),
            evidence={"samples_per_step": {r: int(v) if float(v).is_integer() else v for r, v in samples.items()},
                      "work_per_sample_vs_peers_pct": {r: round(scores.ranks[r].score_pct, 1) for r in odd},
                      "per_rank": _table(scores)},
            why=(f"{per_sample} DDP waits for the rank with the most work at every step, and ranks with uneven "
                 "batch counts hang at the end of an epoch (the others wait in an all-reduce it never calls).")))
    peaks = {r: int(facts[r].peak_mem_bytes) for r in scores.ranks}
    if all(peaks.values()):
        for r, peak in sorted(peaks.items()):
            others = _median([v for p, v in peaks.items() if p != r])
            if peak - others > max(MEMORY_UNEVEN_SHARE * others, MEMORY_UNEVEN_BYTES):
                out.append(codes.finding(
                    "STR004", NAME,
                    (f"Rank {r} peaks at {peak / 2**30:.2f} GiB of memory, its peers at {others / 2**30:.2f} GiB"),
                    ranks=(r,), nodes=run.nodes_of([r]), evidence={"peak_mem_bytes": peaks}))
    utils = {r: _median_of(facts[r].sampled.gpu_util_pct) for r in scores.ranks}
    known = {r: u for r, u in utils.items() if u is not None}
    if len(known) >= 2 and max(known.values()) - min(known.values()) > UTIL_GAP_POINTS:
        low = min(known, key=lambda r: known[r])
        out.append(codes.finding(
            "STR006", NAME,
            f"GPU utilisation is uneven: {min(known.values()):.0f}% on rank {low} up to {max(known.values()):.0f}%",
            ranks=tuple(sorted(known)), nodes=run.nodes_of(known), evidence={"gpu_util_pct_median": known}))
    return out


def _comm_bound(scores: Scores, run: RunView, slow: Sequence[int]) -> list[Finding]:
    if slow:
        return []
    shares = {r: s.comm_wait_ms / s.step_ms for r, s in scores.ranks.items() if s.step_ms > 0}
    if shares and min(shares.values()) >= COMM_BOUND_SHARE:
        ranks = sorted(shares)
        return [codes.finding(
            "STR005", NAME,
            (f"Every rank spends at least {100 * min(shares.values()):.0f}% of its step waiting for the gradient "
             "all-reduce, and none is late: the network or the collective is the bottleneck"),
            ranks=tuple(ranks), nodes=run.nodes_of(ranks),
            evidence={"comm_wait_share_pct": {r: round(100 * v, 1) for r, v in shares.items()},
                      "per_rank": _table(scores)})]
    return []


def _all_clear(scores: Scores, run: RunView) -> Finding:
    ranks = sorted(scores.ranks)
    spread = max(s.score_pct for s in scores.ranks.values()) - min(s.score_pct for s in scores.ranks.values())
    return codes.finding(
        "STR002", NAME,
        (f"No straggler: {len(ranks)} ranks within {spread:.1f}% of each other over {scores.steps} steps "
         f"(threshold {scores.threshold_pct:g}%)"),
        ranks=tuple(ranks), nodes=run.nodes_of(ranks),
        evidence={"per_rank": _table(scores), "clock_corrected_arrivals": scores.clocks_known})
