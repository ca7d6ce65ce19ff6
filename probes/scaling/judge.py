"""Judging weak scaling: speedup, efficiency, and where each size loses time. Pure functions.

Speedup at n ranks = samples/s at n / samples/s at 1, with the same per-rank batch (weak
scaling); efficiency = speedup / n. A DDP step at n ranks takes as long as its slowest
rank, so a size's samples/s is n x batch / the slowest rank's median step. The time a
size adds per step over one rank is split, from the ranks' own columns, into:
- communication not hidden by computation: backward minus backward under `no_sync()` on
  the rank that waits least (the last to arrive waits only for the all-reduce itself);
- a straggler: the slowest rank's computation minus the median of the others';
- data loading: the slowest rank's data time minus one rank's;
- slower computation on every rank (ranks sharing CPU cores, memory bandwidth, clocks).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ddpdoctor.core import codes
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, rank_ranges
from ddpdoctor.runtime.scaling_run import SizeRow

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.scaling.facts import ScalingFacts

NAME = "scaling"
# Common practice (the issue's and the DDP tutorials' rule of thumb): ~95% at 2 ranks is good,
# ~80% at 8 is acceptable. Between the points the target falls linearly in log2(n).
DEFAULT_TARGETS = ((2, 95.0), (8, 80.0))
SLOW_RANK_PCT = 10.0  # a rank this much slower than the median rank is a straggler
KNOB_GAIN_PCT = 5.0  # a DDP setting must beat the defaults by this much to be worth saying
CAUSES = {"comm": "communication that computation does not hide", "straggler": "a straggler",
          "data": "data loading", "contention": "slower computation on every rank"}


def target_pct(n: int, targets: tuple[tuple[int, float], ...] = DEFAULT_TARGETS) -> float:
    points = sorted(targets)
    if n <= points[0][0]:
        return points[0][1]
    for (n0, p0), (n1, p1) in zip(points, points[1:]):
        if n <= n1:
            return round(p0 + (p1 - p0) * (math.log2(n) - math.log2(n0)) / (math.log2(n1) - math.log2(n0)), 1)
    return points[-1][1]


@dataclass
class SizeResult:
    n: int
    step_ms: float
    samples_per_s: float
    speedup: float = 1.0
    efficiency_pct: float = 100.0
    target_pct: Optional[float] = None
    loss_ms: dict[str, float] = field(default_factory=dict)
    slow_rank: Optional[int] = None  # by computation
    slow_data_rank: Optional[int] = None
    shared_cpus: Optional[str] = None  # "4 ranks share 2 CPUs on vm": the host, not DDP, sets the pace

    @property
    def cause(self) -> Optional[str]:
        """The largest part, if it is a third or more of the time lost; else no single cause."""
        if not self.loss_ms:
            return None
        key = max(CAUSES, key=lambda k: self.loss_ms.get(k, 0.0))
        lost = sum(self.loss_ms.values())
        return key if lost > 0 and self.loss_ms.get(key, 0.0) >= lost / 3 else None

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.n, "step_ms": round(self.step_ms, 3), "samples_per_s": round(self.samples_per_s, 1),
                "speedup": round(self.speedup, 3), "efficiency_pct": round(self.efficiency_pct, 1),
                "target_pct": self.target_pct, "loss_ms": {k: round(v, 3) for k, v in self.loss_ms.items()},
                "cause": self.cause, "slow_rank": self.slow_rank, "slow_data_rank": self.slow_data_rank,
                "shared_cpus": self.shared_cpus}


ByRank = Mapping[int, ScalingFacts]


def by_rank(facts: Mapping[Any, Any]) -> dict[int, ScalingFacts]:
    """Typed facts keyed by int rank (a report has plain objects keyed by strings); a rank whose
    facts are not an object has none."""
    return facts_by_rank(ScalingFacts, {r: f for r, f in facts.items() if isinstance(f, (Mapping, ScalingFacts))})


def _num(value: object) -> Optional[float]:
    """A finite number, or None: a median the JSON holds as null, NaN or something else."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _size_rows(facts: ByRank, n: int) -> dict[int, SizeRow]:
    rows = {}
    for rank, f in facts.items():
        row = f.sizes.get(str(n))
        if row is not None and _num(row.step_ms):
            rows[rank] = row
    return rows


def _step_ms(row: SizeRow) -> float:
    """A reported row's median step (`_size_rows` keeps only rows that have one)."""
    return _num(row.step_ms) or 0.0


def _compute(row: SizeRow, alone: bool) -> Optional[float]:
    forward, backward = (row.forward_alone_ms, row.backward_alone_ms) if alone else (row.forward_ms, row.backward_ms)
    f, b = _num(forward), _num(backward)
    return f + b if f is not None and b is not None else None


def sizes_of(facts: ByRank) -> list[int]:
    found: set[int] = set()
    for f in facts.values():
        found.update(int(k) for k in f.sizes if str(k).isdigit())
    return sorted(found)


def evaluate(facts: ByRank, targets: tuple[tuple[int, float], ...] = DEFAULT_TARGETS) -> list[SizeResult]:
    """Every size that all its ranks reported, with its speedup and where its time went."""
    facts = by_rank(facts)
    results: list[SizeResult] = []
    base: Optional[SizeResult] = None
    base_row: Optional[SizeRow] = None
    for n in sizes_of(facts):
        rows = _size_rows(facts, n)
        if len(rows) < n:
            continue  # a rank of this size did not report: nothing honest to compute
        batch = _num(next(iter(facts.values())).batch_size) or 1.0
        step = max(_step_ms(r) for r in rows.values())
        result = SizeResult(n, step, n * batch / (step / 1e3), shared_cpus=_shared_cpus(facts, rows))
        if n == 1:
            base, base_row = result, rows[min(rows)]
        elif base is not None and base_row is not None:
            result.speedup = result.samples_per_s / base.samples_per_s
            result.efficiency_pct = 100.0 * result.speedup / n
            result.target_pct = target_pct(n, targets)
            _explain(result, rows, base, base_row)
        results.append(result)
    return results


def _shared_cpus(facts: ByRank, rows: Mapping[int, SizeRow]) -> Optional[str]:
    """CPU ranks of this size that outnumber their host's usable CPUs: each waits for a core,
    in computation and in the all-reduce alike, so the efficiency measures the host."""
    by_host: dict[str, list[int]] = {}
    for rank in rows:
        f = facts[rank]
        if f.device.startswith("cpu"):
            by_host.setdefault(str(f.host), []).append(rank)
    for host, ranks in by_host.items():
        cpus = [c for r in ranks if (c := _num(facts[r].cpus_usable))]
        if cpus and len(ranks) > min(cpus):
            return f"{len(ranks)} ranks share {int(min(cpus))} CPUs on {host}"
    return None


def _explain(result: SizeResult, rows: Mapping[int, SizeRow], base: SizeResult, base_row: SizeRow) -> None:
    exposed = [b - alone for r in rows.values()
               if (b := _num(r.backward_ms)) is not None and (alone := _num(r.backward_alone_ms)) is not None]
    compute = {rank: c for rank, r in rows.items() if (c := _compute(r, alone=True)) is not None}
    data = {rank: d for rank, r in rows.items() if (d := _num(r.data_ms)) is not None}
    loss: dict[str, float] = {"comm": max(0.0, min(exposed)) if exposed else 0.0}
    if compute:
        slowest = max(compute, key=lambda r: compute[r])
        # The slowest rank against the others' median: with two ranks, a median that includes
        # the straggler would split its extra time between "straggler" and "everyone".
        others = [c for r, c in compute.items() if r != slowest] or [compute[slowest]]
        median = statistics.median(others)
        loss["straggler"] = max(0.0, compute[slowest] - median)
        if median > 0 and 100.0 * (compute[slowest] - median) / median >= SLOW_RANK_PCT:
            result.slow_rank = slowest
        alone_at_1 = _compute(base_row, alone=False)
        loss["contention"] = max(0.0, median - alone_at_1) if alone_at_1 is not None else 0.0
    if data:
        slowest_data = max(data, key=lambda r: data[r])
        loss["data"] = max(0.0, data[slowest_data] - (_num(base_row.data_ms) or 0.0))
        median_step = statistics.median(_step_ms(r) for r in rows.values())
        if median_step > 0 and 100.0 * (data[slowest_data] - statistics.median(data.values())) / median_step >= SLOW_RANK_PCT:
            result.slow_data_rank = slowest_data
    loss["other"] = max(0.0, result.step_ms - base.step_ms - sum(loss.values()))
    result.loss_ms = loss


def _table(results: list[SizeResult]) -> list[str]:
    """One line per size: readable in the terminal, and the numbers are all in the facts."""
    lines = []
    for r in results:
        line = f"{r.n} rank{'s' if r.n != 1 else ''}: {r.samples_per_s:,.0f} samples/s, step {r.step_ms:.2f} ms"
        if r.target_pct is not None:
            lost = ", ".join(f"{k} {v:.1f}" for k, v in r.loss_ms.items() if v > 0.05)
            line += (f", {r.speedup:.2f}x, {r.efficiency_pct:.0f}% (target {r.target_pct:g}%)"
                     f"{f'; ms lost a step: {lost}' if lost else ''}")
        lines.append(line)
    return lines


def _fix(result: SizeResult) -> str:
    cause = result.cause
    if cause == "straggler":
        return (f"Find out why rank {result.slow_rank} computes slower (`ddpdoctor check --probes stragglers,homogeneity` "
                "names the cause: a slower or throttled GPU, a busy CPU, fewer CPUs); every rank waits for it.")
    if cause == "data":
        return (f"Rank {result.slow_data_rank} waits for its data: more DataLoader workers (num_workers), "
                "pin_memory=True, persistent_workers=True, prefetching; check the storage that rank reads from.")
    if cause == "contention":
        return ("Every rank computes slower together than one alone: on CPU ranks, give each rank its own cores "
                "(fewer ranks per host, OMP_NUM_THREADS = cores / ranks); on GPUs, check clocks and power "
                "(`ddpdoctor check --probes homogeneity`) and the host's CPU and memory bandwidth.")
    return ("Hide or shrink the all-reduce: tune `bucket_cap_mb` (the measured DDP settings are in SCL002), set "
            "`gradient_as_bucket_view=True`, `static_graph=True` when the graph never changes, keep "
            "`find_unused_parameters=False` unless needed, accumulate gradients under `no_sync()` (a larger "
            "effective batch), or use a faster interconnect (`ddpdoctor allreduce-bench` measures it).")


def efficiency_findings(results: list[SizeResult], run: RunView) -> list[Finding]:
    table = _table(results)
    findings = _shared_findings(results, run, table)
    judged = [r for r in results if r.target_pct is not None and r.shared_cpus is None]
    if not judged:
        return findings
    return findings + _verdict(results, judged, run, table)


def _shared_findings(results: list[SizeResult], run: RunView, table: list[str]) -> list[Finding]:
    shared = [r for r in results if r.target_pct is not None and r.shared_cpus is not None]
    if not shared:
        return []
    first = shared[0]
    return [codes.finding(
        "SCL005", NAME,
        (f"Not judged at {', '.join(str(r.n) for r in shared)} ranks: {first.shared_cpus}, so the "
         f"efficiency ({first.efficiency_pct:.0f}% at {first.n}) measures the host, not DDP"),
        ranks=tuple(range(shared[-1].n)), nodes=run.nodes_of(range(shared[-1].n)),
        evidence={"sizes": table, "not_judged": [r.to_json() for r in shared]})]


def _verdict(results: list[SizeResult], judged: list[SizeResult], run: RunView, table: list[str]) -> list[Finding]:
    below = [r for r in judged if r.efficiency_pct < r.target_pct]  # type: ignore[operator]
    if not below:
        top = judged[-1]
        return [codes.finding("SCL000", NAME,
                              f"Scaling efficiency {top.efficiency_pct:.0f}% at {top.n} ranks ({top.speedup:.2f}x), "
                              f"at or above the {top.target_pct:g}% target",
                              ranks=tuple(range(top.n)), nodes=run.nodes_of(range(top.n)), evidence={"sizes": table})]
    worst = min(below, key=lambda r: r.efficiency_pct - (r.target_pct or 0.0))
    cause = worst.cause
    named = [worst.slow_rank] if cause == "straggler" and worst.slow_rank is not None else (
        [worst.slow_data_rank] if cause == "data" and worst.slow_data_rank is not None else list(range(worst.n)))
    lost = worst.step_ms - (results[0].step_ms if results and results[0].n == 1 else worst.step_ms)
    because = CAUSES.get(cause or "", "no single cause")
    if cause == "straggler" and worst.slow_rank is not None:
        because = f"rank {worst.slow_rank} is a straggler"
    elif cause == "data" and worst.slow_data_rank is not None:
        because = f"rank {worst.slow_data_rank} waits for its data"
    share = f"{worst.loss_ms.get(cause, 0.0):.1f} of {lost:.1f} ms a step" if cause else ""
    if cause != "straggler" and worst.slow_rank is not None:
        # A straggler that is not the largest part still costs its share, and has a name.
        share += f"; also rank {worst.slow_rank} computes {worst.loss_ms.get('straggler', 0.0):.1f} ms slower"
    return [codes.finding(
        "SCL001", NAME,
        (f"Scaling efficiency at {worst.n} ranks is {worst.efficiency_pct:.0f}% ({worst.speedup:.2f}x of "
         f"{worst.n}x), below the {worst.target_pct:g}% target: {because}{f' ({share})' if share else ''}"),
        ranks=tuple(named), nodes=run.nodes_of(named),
        evidence={"sizes": table, "below_target": [r.n for r in below],
                  "at_worst_size": worst.to_json()},
        fix=_fix(worst))]


def knob_findings(facts: ByRank, default_name: str) -> list[Finding]:
    """What the DDP settings tried at the largest size did, against the defaults, per batch."""
    knobs: dict[str, list[float]] = {}
    for f in facts.values():
        for name, row in f.knobs.items():
            if ms := _num(row.ms_per_batch):
                knobs.setdefault(str(name), []).append(ms)
    if default_name not in knobs or len(knobs) < 2:
        return []
    per_batch = {name: max(values) for name, values in knobs.items()}  # the slowest rank sets the pace
    base = per_batch[default_name]
    gains = {name: round(100.0 * (base - ms) / base, 1) for name, ms in per_batch.items() if name != default_name}
    best = max(gains, key=lambda k: gains[k])
    evidence = {"ms_per_batch": {k: round(v, 3) for k, v in per_batch.items()}, "faster_than_defaults_pct": gains}
    if gains[best] >= KNOB_GAIN_PCT:
        title = f"DDP setting measured: {best} makes a batch {gains[best]:g}% faster than the defaults"
        if best.startswith("no_sync"):
            title += " (it also multiplies the effective batch)"
    else:
        title = f"No DDP setting tried made a batch {KNOB_GAIN_PCT:g}% faster than the defaults"
    return [codes.finding("SCL002", NAME, title, evidence=evidence)]


def batch_findings(results: list[SizeResult], batch: Optional[float], lr: Optional[float]) -> list[Finding]:
    if not results or not batch:
        return []
    n = results[-1].n
    evidence: dict[str, Any] = {"ranks": n, "batch_per_rank": int(batch), "effective_batch": int(n * batch),
                                "linear_rule_lr_factor": n, "square_root_rule_lr_factor": round(math.sqrt(n), 3)}
    if lr:
        evidence.update(lr_at_one_rank=lr, linear_rule_lr=round(lr * n, 6), square_root_rule_lr=round(lr * math.sqrt(n), 6))
    return [codes.finding("SCL003", NAME,
                          (f"At {n} ranks the effective batch is {int(n * batch)} ({n} x {int(batch)}): a learning rate "
                           f"tuned for one rank scales x{n} (linear rule) or x{math.sqrt(n):.2f} (square-root rule)"),
                          evidence=evidence)]


def diagnose_scaling(facts: ByRank, run: RunView, default_name: str) -> list[Finding]:
    facts = by_rank(facts)
    targets = run.settings.get("efficiency_targets") or DEFAULT_TARGETS
    results = evaluate(facts, tuple((int(n), float(p)) for n, p in targets))
    batch = _num(next(iter(facts.values())).batch_size) if facts else None
    lr = _num(run.settings.get("lr"))
    missing = [r for r in range(run.world_size) if r not in facts]
    findings = efficiency_findings(results, run) + knob_findings(facts, default_name) + batch_findings(results, batch, lr)
    if missing:
        findings.append(codes.finding("SCL004", NAME, f"Rank {rank_ranges(missing)} reported no scaling measurement",
                                      ranks=tuple(missing), nodes=run.nodes_of(missing),
                                      evidence={"sizes_judged": [r.n for r in results]}))
    return findings
