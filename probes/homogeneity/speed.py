"""The slow rank on identical hardware, from measured matmul throughput.

A rank is compared only with its peers on the same hardware (same GPU model and memory,
or same CPU model), by its best round: noise (another process, a busy hypervisor, a
moment of throttling) only ever slows a measurement down, so a device's best round is
what it can do, and a rank that is slow in every round is really slow.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Mapping, Optional

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, rank_ranges

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.homogeneity.facts import HomogeneityFacts, MatmulFacts
from ddpdoctor.probes.homogeneity.health import cpu_set, cpus_for
from ddpdoctor.probes.stragglers.contention import DIRECT, Denied, denied

NAME = "homogeneity"
# Defaults: GPUs are exclusive and measured with CUDA events; CPU ranks share cores with
# everything else on the host (and, in VMs, with other tenants), which is noisier.
DEFAULT_SLOW_PCT = {"gpu": 10.0, "cpu": 20.0}
# CPU ranks of one host that may run on the same cores (not pinned apart): the scheduler, not
# the rank, decides which core each gets, and on a VM two vCPUs can differ by a third for a
# whole run (measured here: 45 vs 79 GFLOP/s for two idle-host processes). Only a larger gap is
# the rank's; pinned ranks (srun --cpus-per-task, taskset) keep the 20%.
SHARED_CORES_SLOW_PCT = 40.0

ByRank = Mapping[int, HomogeneityFacts]
# Who is a peer of whom: ("gpu", name, memory, dtype, size) or ("cpu", model, dtype, size, threads).
Hardware = tuple[str, object, object, object, object]


def _matmul(f: HomogeneityFacts) -> Optional[MatmulFacts]:
    """The rank's measurement, if it has a figure (a matmul that failed or timed out has none)."""
    mm = f.matmul
    return mm if mm is not None and mm.flops_per_s else None


def _hardware(f: HomogeneityFacts) -> Hardware:
    mm = _matmul(f) or MatmulFacts()
    if f.gpu is not None and f.gpu.name:
        return ("gpu", f.gpu.name, f.gpu.memory_total_bytes, mm.dtype, mm.size)
    hw = f.host_hw
    # A CPU rank's speed scales with its threads: only ranks with as many threads are peers.
    return ("cpu", hw.cpu_model, mm.dtype, mm.size, hw.torch_threads)


def _rounds(f: HomogeneityFacts) -> list[float]:
    mm = _matmul(f) or MatmulFacts()
    rounds = [float(x) for x in mm.round_flops_per_s if x]
    return rounds or [float(mm.flops_per_s or 0.0)]


def _shared_cpus(facts: ByRank) -> tuple[dict[str, dict[str, object]], set[int]]:
    """Hosts whose CPU ranks want more threads than they have cores (speeds there are noise):
    the evidence per host, and the ranks not to compare."""
    crowded: dict[str, dict[str, object]] = {}
    excluded: set[int] = set()
    by_machine: dict[str, list[int]] = defaultdict(list)
    for r, f in facts.items():
        if not f.has_gpu and f.source != "snapshot":  # a snapshot measures one device at a time
            by_machine[_machine(f)].append(r)
    for ranks in by_machine.values():
        hw = [facts[r].host_hw for r in ranks]
        threads = sum(int(h.torch_threads or 1) for h in hw)
        cores = cpus_for(hw)
        if cores and threads > cores:
            hosts = ", ".join(sorted({str(facts[r].host) for r in ranks}))
            crowded[hosts] = {"ranks": rank_ranges(ranks), "threads": threads, "cores": cores}
            excluded.update(ranks)
    return crowded, excluded


def _machine(f: HomogeneityFacts) -> str:
    """The machine whose cores a rank runs on: its kernel's boot id, else its host name. Recorded
    (tests/ranks/test_multinode_e2e.py, two simulated nodes of 2 ranks on this 2-core VM): judged by
    host name, each "node" had 2 threads on 2 cores, and rank 0, time-sharing the same 2 cores with
    3 others, was called 41% slower (38.6 against 65.9 GFLOP/s); two containers on one host are the same."""
    return f"machine {f.machine}" if f.machine else f"host {f.host}"


def _float_over_shared_cores(facts: ByRank, ranks: list[int]) -> bool:
    """Two of these ranks on one machine whose CPU affinities overlap."""
    by_machine: dict[str, list[set[int]]] = {}
    for r in ranks:
        by_machine.setdefault(_machine(facts[r]), []).append(cpu_set(facts[r].host_hw.cpu_affinity))
    return any(a & b for sets in by_machine.values() for i, a in enumerate(sets) for b in sets[i + 1:])


def _unit(kind: str) -> tuple[str, float]:
    return ("TFLOP/s", 1e12) if kind == "gpu" else ("GFLOP/s", 1e9)


def _peer_groups(facts: ByRank, excluded: set[int]) -> dict[Hardware, list[int]]:
    """Ranks that may be compared: measured, same hardware, not on time-shared cores."""
    groups: dict[Hardware, list[int]] = defaultdict(list)
    for r, f in sorted(facts.items()):
        if _matmul(f) and r not in excluded:
            groups[_hardware(f)].append(r)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def speed_spread(facts: ByRank) -> Optional[tuple[float, float, float, str]]:
    """(percent, slowest, fastest, unit) within the widest group of peers, for the all-clear line."""
    _, excluded = _shared_cpus(facts)
    widest = None
    for hardware, ranks in _peer_groups(facts, excluded).items():
        best = [max(_rounds(facts[r])) for r in ranks]
        unit, scale = _unit(hardware[0])
        spread = (100 * (1 - min(best) / max(best)), min(best) / scale, max(best) / scale, unit)
        widest = spread if widest is None or spread[0] > widest[0] else widest
    return widest


def slow_rank_findings(facts: ByRank, run: RunView,
                       threshold_pct: Optional[float] = None) -> list[Finding]:
    """`threshold_pct` None: the default for the device kind (DEFAULT_SLOW_PCT)."""
    out: list[Finding] = []
    crowded, crowded_ranks = _shared_cpus(facts)
    if crowded:
        out.append(codes.finding(
            "HOM013", NAME, f"Compute speed not compared on {', '.join(crowded)}: its CPU ranks share too few cores",
            ranks=tuple(sorted(crowded_ranks)), nodes=run.nodes_of(sorted(crowded_ranks)), evidence={"hosts": crowded}))
    for hardware, ranks in _peer_groups(facts, crowded_ranks).items():
        if threshold_pct is not None:
            pct = float(threshold_pct)
        elif hardware[0] == "cpu" and _float_over_shared_cores(facts, ranks):
            pct = SHARED_CORES_SLOW_PCT
        else:
            pct = DEFAULT_SLOW_PCT[hardware[0]]
        limit = 1.0 - pct / 100.0
        # A rank denied the CPU is told apart from scheduler noise by what the kernel counted
        # (stragglers/contention.py), not by a wider margin: the ordinary threshold holds.
        starved_pct = float(threshold_pct) if threshold_pct is not None else DEFAULT_SLOW_PCT[hardware[0]]
        best = {r: max(_rounds(facts[r])) for r in ranks}
        scores = {r: best[r] / peers for r, peers in _median_of_others(best).items()}
        # A rank slow even in its best round is slow by itself (it also waits longer for a CPU, having
        # more to do), unless the kernel counted its CPU denied directly (a throttled cgroup, stopped).
        starved = _starved(facts, ranks, 1.0 - starved_pct / 100.0)
        slow = sorted(r for r in ranks if scores[r] < limit and not (r in starved and starved[r][0].cause in DIRECT))
        if slow:
            out.append(_slow_finding(facts, run, hardware, ranks, slow, scores, pct))
        out += [_starved_finding(facts, run, hardware, ranks, why, got, starved_pct)
                for r, (why, got) in sorted(starved.items()) if r not in slow]
    return out


def _got(f: HomogeneityFacts) -> Optional[float]:
    m = f.measured
    return m.got_flops_per_s if m is not None and _matmul(f) and m.got_flops_per_s else None


def _starved(facts: ByRank, ranks: list[int], limit: float) -> dict[int, tuple[Denied, dict[int, float]]]:
    """Ranks that got less than `limit` of their peers' throughput over the rounds' wall time
    *and* lost more of that time off a CPU than their peers (stragglers/contention.py): a rank
    denied the CPU computes as fast as ever when it runs, so its best round cannot show it."""
    got = {r: g for r in ranks if (g := _got(facts[r])) is not None}
    if len(got) < 2:
        return {}
    contention = {r: (m.contention if (m := facts[r].measured) is not None else None) for r in ranks}
    out = {}
    for r, share in ((r, got[r] / peers) for r, peers in _median_of_others(got).items()):
        why = denied(contention, r, [p for p in got if p != r]) if share < limit else None
        if why is not None:
            out[r] = (why, got)
    return out


def _starved_finding(facts: ByRank, run: RunView, hardware: Hardware, ranks: list[int], why: Denied,
                     got: Mapping[int, float], threshold_pct: float) -> Finding:
    unit, scale = _unit(hardware[0])
    rank = why.rank
    typical = statistics.median(v for p, v in got.items() if p != rank)
    slower = 100 * (1 - got[rank] / typical)
    return codes.finding(
        "HOM006", NAME,
        (f"Rank {rank} gets {slower:.0f}% less compute than "
         f"{'its peer' if len(got) == 2 else f'the median of its {len(got) - 1} peers'} on identical hardware "
         f"({got[rank] / scale:.3g} vs {typical / scale:.3g} {unit} over the wall time, {why.cause}): "
         f"{why.sentence}"),
        ranks=(rank,), nodes=run.nodes_of([rank]),
        evidence={"cause": why.cause, "where": why.sentence,
                  f"throughput_got_{unit.replace('/', '_per_')}_by_rank": {r: round(v / scale, 2) for r, v in got.items()},
                  f"throughput_best_round_{unit.replace('/', '_per_')}_by_rank": {
                      r: round(max(_rounds(facts[r])) / scale, 2) for r in ranks},
                  "threshold_pct": threshold_pct, **why.evidence},
        fix=why.fix)


def _median_of_others(values: Mapping[int, float]) -> dict[int, float]:
    """For each rank, the median of every other rank's value: from one sort, not one per rank
    (that was quadratic: seconds at a thousand ranks)."""
    order = sorted(values, key=lambda r: values[r])
    ordered = [values[r] for r in order]
    m = len(ordered) - 1

    def without(i: int, j: int) -> float:  # element j of the list with position i removed
        return ordered[j] if j < i else ordered[j + 1]

    out = {}
    for i, r in enumerate(order):
        out[r] = without(i, m // 2) if m % 2 else (without(i, m // 2 - 1) + without(i, m // 2)) / 2
    return out


def _slow_finding(facts: ByRank, run: RunView, hardware: Hardware, ranks: list[int],
                  slow: list[int], scores: Mapping[int, float], threshold_pct: float) -> Finding:
    unit, scale = _unit(hardware[0])
    speed = {r: round(max(_rounds(facts[r])) / scale, 2) for r in ranks}
    peers = [r for r in ranks if r not in slow]
    typical = statistics.median(speed[r] for r in (peers or ranks))
    worst = min(slow, key=lambda r: scores[r])
    gpu = facts[worst].gpu
    where = f"{facts[worst].host}" + (f" GPU {gpu.pci_bus_id if gpu is not None else None}"
                                      if hardware[0] == "gpu" else "")
    mm = _matmul(facts[worst]) or MatmulFacts()
    threads = hardware[4] if hardware[0] == "cpu" else None
    what = f"{hardware[1]}" if threads is None else f"CPU {hardware[1]}, {threads} thread{'s' if threads != 1 else ''} per rank"
    steps = {r: facts[r].step_ms for r in ranks}
    whole = run.whole_nodes(slow)
    return codes.finding(
        "HOM006", NAME,
        ((f"{'Node' if len(whole) == 1 else 'Nodes'} {', '.join(whole)} (rank{'s' if len(slow) != 1 else ''} "
          f"{rank_ranges(slow)}) "
          f"{'computes' if len(whole) == 1 else 'compute'} up to " if whole else
          f"{'Rank' if len(slow) == 1 else 'Ranks'} {rank_ranges(slow)} "
          f"{'computes' if len(slow) == 1 else 'compute up to'} ")
         + f"{100 * (1 - scores[worst]):.0f}% slower than "
         f"{'its peer' if len(ranks) == 2 else f'the median of its {len(ranks) - 1} peers'} on identical hardware "
         f"({speed[worst]:g} vs {typical:g} {unit}, {where})"),
        ranks=tuple(slow), nodes=run.nodes_of(slow),
        evidence={
            "hardware": what,
            "measurement": (f"{mm.dtype} {mm.size}x{mm.size} matmul, best of "
                            f"{len(_rounds(facts[worst]))} rounds ({mm.reps} repetitions)"),
            f"throughput_{unit.replace('/', '_per_')}_by_rank": speed,
            "slower_than_peers_pct": {r: round(100 * (1 - scores[r]), 1) for r in slow},
            "threshold_pct": threshold_pct,
            "ddp_step_ms_by_rank": {r: v for r, v in steps.items() if v is not None},
        },
        fix=("On that GPU: `nvidia-smi -q -d PERFORMANCE,CLOCK,POWER,TEMPERATURE` for throttle reasons, `nvidia-smi` for "
             "other processes, `nvidia-smi -rac` to reset application clocks; if it stays slow, drain the node and run "
             "`dcgmi diag -r 3`." if hardware[0] == "gpu" else
             "On that node: look for other busy processes on the rank's cores (`top`, `ps -eo pid,psr,pcpu,comm`), the "
             "CPU frequency governor, and the rank's CPU affinity (`taskset -p PID`)."))
