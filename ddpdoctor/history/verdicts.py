"""What a fleet's history says: nodes that drifted slower, lemon nodes, GPUs whose memory keeps failing.

Pure judging over a `History` (history/store.py's read API): no SQL, no terminal. Three verdicts,
each a Finding with the runs, dates and numbers behind it:

- DRIFT (HIS001). Each run's measured speed (compute_speed, busbw_gbs) of a node, the median over
  its GPUs or CPU ranks, is divided by the fleet's median of the same model at that time: the
  latest value of every OTHER node of that model as of that run (a multi-node run compares its
  own nodes; prolog runs, one node each, compare with the others' latest runs). So a fleet-wide
  change (a driver, a cooler week) moves the reference too and is not drift. On a node's series of
  ratios r_1..r_T (oldest first), run k is where it began when, with b = median(r_1..r_{k-1})
  over at least MIN_BEFORE runs and line = (1 - margin) * b: r_k is under the line, the median of
  the MIN_AFTER runs from k is under it, and the median of every run from k to the latest is
  under it. The first such k is named. One slow run, or a slow patch the node recovered from,
  is noise; a drift needs MIN_AFTER runs to be seen at all.
  The same is judged per GPU (where the measurements name one): each GPU's value against the
  median of the latest values of every OTHER GPU of the model (its node's others included), so
  one slow GPU of 8, which barely moves its node's median, is named with its node and id. One
  GPU's readings are noisier than a node's median, and there are 8 times the series: a GPU's line
  is also GPU_NOISE_Z of its own earlier spread (1.4826 MAD) under its baseline. When
  the node drifts on that metric too, its GPUs went together: the node is the one finding, and
  its drifted GPUs are listed in its evidence.
- LEMON (HIS002). A node's runs with a critical finding on it (k of n runs it took part in)
  against the pooled rate p of the other nodes (Laplace-smoothed, (K+1)/(N+2), so a fleet that
  never failed still gives a finite test): one-sided binomial P(X >= k | n, p) below
  alpha / (nodes judged) (Bonferroni: with 50 nodes, one in 50 healthy nodes must not be named by
  chance), with n >= MIN_RUNS, k >= MIN_CRITICAL and k/n at least twice p.
- COUNTERS (HIS003). Per GPU (node and GPU id, or rank), a health counter (uncorrected ECC,
  remapped rows, retired pages) that rose between at least MIN_RISES pairs of consecutive runs
  and ends above where it started.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional, Sequence, TypeVar

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity, exit_code_for
from ddpdoctor.history.store import History, Measurement, RunRow

PROBE = "history"
SPEED_METRICS = ("compute_speed", "busbw_gbs")
CRITICAL_COUNTERS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "remapped_rows_failure")
WARN_COUNTERS = ("remapped_rows_pending", "retired_pages")
Unit = TypeVar("Unit", bound=Hashable)  # what a series follows: a node, or a (node, gpu)


@dataclass(frozen=True)
class Rules:
    """The thresholds, in one place (docs/fleet.md quotes them)."""

    margin: float = 0.10  # drift: 10% under the node's own earlier ratio to the fleet
    min_before: int = 3  # drift: runs before the change that set the node's baseline
    min_after: int = 3  # drift: runs from the change on that stay under the line
    min_peers: int = 2  # drift: other nodes of the same model to form a fleet median
    gpu_noise_z: float = 3.0  # drift of one GPU: also this many of its own standard deviations (MAD) under
    min_runs: int = 5  # lemon: runs a node took part in
    min_critical: int = 3  # lemon: runs with a critical finding on the node
    alpha: float = 0.01  # lemon: family-wise false-alarm rate over the nodes judged
    min_rises: int = 2  # counters: increases between consecutive runs


@dataclass(frozen=True)
class Point:
    """One node's value of one metric in one run, and the fleet's median at that time."""

    run_id: str
    started_at: float
    value: float
    fleet: Optional[float]  # None: fewer than `min_peers` other nodes of the model measured by then

    @property
    def ratio(self) -> Optional[float]:
        return self.value / self.fleet if self.fleet else None


def trend_pct(points: Sequence[Point]) -> Optional[float]:
    """The median ratio of the last runs against the first ones, in percent (None: too few runs)."""
    ratios = [p.ratio for p in points if p.ratio is not None]
    if len(ratios) < 2:
        return None
    half = max(1, min(3, len(ratios) // 2))
    first, last = statistics.median(ratios[:half]), statistics.median(ratios[-half:])
    return (last / first - 1.0) * 100.0 if first > 0 else None


class _SpeedSeries:
    """What a table row reads off its speed series and findings: a node's and a GPU's alike."""

    speed: list[Point]
    findings: list[Finding]

    @property
    def latest(self) -> Optional[Point]:
        return self.speed[-1] if self.speed else None

    @property
    def trend_pct(self) -> Optional[float]:
        return trend_pct(self.speed)

    @property
    def worst(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)


@dataclass
class GpuSummary(_SpeedSeries):
    """One GPU of a node: its own compute speed against the fleet's GPUs of the model, and its verdicts."""

    gpu: str
    speed: list[Point] = field(default_factory=list)  # compute_speed, oldest first
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "latest_speed": self.latest.value if self.latest else None,
                "latest_fleet_median": self.latest.fleet if self.latest else None,
                "trend_pct": None if self.trend_pct is None else round(self.trend_pct, 1),
                "worst_severity": self.worst.label, "findings": [f.code for f in self.findings]}


@dataclass
class NodeSummary(_SpeedSeries):
    """One row of the history table."""

    node: str
    model: Optional[str]
    runs: int
    critical_runs: int
    speed: list[Point] = field(default_factory=list)  # compute_speed, oldest first
    findings: list[Finding] = field(default_factory=list)
    gpus: list[GpuSummary] = field(default_factory=list)  # by id; none on CPU ranks


@dataclass
class Verdicts:
    summaries: list[NodeSummary]
    findings: list[Finding]
    runs: int
    first: Optional[float]
    last: Optional[float]

    @property
    def exit_code(self) -> int:
        return exit_code_for(f.severity for f in self.findings)

    def to_json(self) -> dict:
        return {
            "runs": self.runs,
            "first_run": _date(self.first) if self.first is not None else None,
            "last_run": _date(self.last) if self.last is not None else None,
            "exit_code": self.exit_code,
            "worst_severity": max((f.severity for f in self.findings), default=Severity.OK).label,
            "nodes": [{"node": s.node, "model": s.model, "runs": s.runs, "critical_runs": s.critical_runs,
                       "latest_speed": s.latest.value if s.latest else None,
                       "latest_fleet_median": s.latest.fleet if s.latest else None,
                       "trend_pct": None if s.trend_pct is None else round(s.trend_pct, 1),
                       "worst_severity": s.worst.label, "findings": [f.code for f in s.findings],
                       "speed": [{"run_id": p.run_id, "date": _date(p.started_at), "value": p.value,
                                  "fleet_median": p.fleet} for p in s.speed],
                       "gpus": [g.to_json() for g in s.gpus]}
                      for s in self.summaries],
            "findings": [f.to_json() for f in self.findings],
        }


def _date(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def since(history: History, start: float) -> History:
    """The history from `start` (unix seconds) on: the runs, and the rows of those runs."""
    kept = {r.run_id for r in history.runs if r.started_at >= start}
    return History(path=history.path, schema_version=history.schema_version,
                   runs=[r for r in history.runs if r.run_id in kept],
                   nodes=[n for n in history.nodes if n.run_id in kept],
                   measurements=[m for m in history.measurements if m.run_id in kept],
                   findings=[f for f in history.findings if f.run_id in kept])


def for_node(verdicts: Verdicts, node: str) -> Verdicts:
    """One node's row and verdicts (judged against the whole fleet first: its median needs the others)."""
    return Verdicts([s for s in verdicts.summaries if s.node == node],
                    [f for f in verdicts.findings if node in f.nodes], verdicts.runs, verdicts.first, verdicts.last)


def judge(history: History, rules: Rules = Rules()) -> Verdicts:
    """Every verdict the history supports, with a summary per node (sorted worst first, then by name)."""
    runs = {r.run_id: r for r in history.runs}
    series = {metric: fleet_series(history, runs, metric, rules.min_peers) for metric in SPEED_METRICS}
    per_gpu = {metric: gpu_series(history, runs, metric, rules.min_peers) for metric in SPEED_METRICS}
    participation = _participation(history, runs)
    critical = _critical_runs(history, runs)
    findings: list[Finding] = []
    for metric in SPEED_METRICS:
        findings += drift_findings(series[metric], per_gpu[metric], metric, rules)
    findings += lemon_findings(participation, critical, runs, rules)
    findings += counter_findings(history, runs, rules)
    speed = series["compute_speed"]
    gpu_speed = {unit: points for (unit, _), points in per_gpu["compute_speed"].items()}  # (node, gpu) -> points
    summaries = []
    for node in sorted(participation):
        models = [model for n, model in speed if n == node]
        mine = [f for f in findings if node in f.nodes]
        gpus = sorted({gpu for n, gpu in gpu_speed if n == node}
                      | {str(f.evidence["gpu"]) for f in mine if f.evidence.get("gpu") is not None})
        summaries.append(NodeSummary(node=node, model=models[0] if models else None, runs=len(participation[node]),
                                     critical_runs=len(critical.get(node, ())),
                                     speed=speed.get((node, models[0]), []) if models else [], findings=mine,
                                     gpus=[GpuSummary(gpu, gpu_speed.get((node, gpu), []),
                                                      [f for f in mine if f.evidence.get("gpu") == gpu])
                                           for gpu in gpus]))
    summaries.sort(key=lambda s: (-int(s.worst), s.node))
    starts = [r.started_at for r in history.runs]
    return Verdicts(summaries, findings, len(history.runs), min(starts, default=None), max(starts, default=None))


def _order(runs: dict[str, RunRow], run_id: str) -> tuple[float, str]:
    run = runs.get(run_id)
    return (run.started_at if run else math.inf, run_id)


def fleet_series(history: History, runs: dict[str, RunRow], metric: str,
                 min_peers: int) -> dict[tuple[str, Optional[str]], list[Point]]:
    """(node, model) -> its points of `metric` (the median over its GPUs or ranks), oldest first,
    each with the median of the other nodes' latest values at that time."""
    return _against_fleet(_readings(history, runs, metric, lambda m: m.node), runs, min_peers)


def gpu_series(history: History, runs: dict[str, RunRow], metric: str,
               min_peers: int) -> dict[tuple[tuple[str, str], Optional[str]], list[Point]]:
    """((node, gpu), model) -> that GPU's points of `metric`, each with the median of every other GPU's
    latest value of the model at that time (none for readings that name no GPU: CPU ranks, busbw)."""
    return _against_fleet(_readings(history, runs, metric, lambda m: None if m.gpu is None else (m.node, m.gpu)),
                          runs, min_peers)


def _readings(history: History, runs: dict[str, RunRow], metric: str,
              unit_of: Callable[[Measurement], Optional[Unit]]) -> dict[tuple[str, Unit, Optional[str]], list[float]]:
    """(run, unit, model) -> the run's finite positive values of `metric` for that unit."""
    values: dict[tuple[str, Unit, Optional[str]], list[float]] = defaultdict(list)
    for m in history.measurements:
        if m.metric == metric and m.run_id in runs and math.isfinite(m.value) and m.value > 0:
            unit = unit_of(m)
            if unit is not None:
                values[(m.run_id, unit, m.model)].append(m.value)
    return values


def _against_fleet(values: dict[tuple[str, Unit, Optional[str]], list[float]], runs: dict[str, RunRow],
                   min_peers: int) -> dict[tuple[Unit, Optional[str]], list[Point]]:
    """(unit, model) -> its median value per run, oldest first, each with the median of the latest value of
    every other unit of the model as of that run (None: fewer than `min_peers` of them)."""
    by_run: dict[str, list[tuple[Unit, Optional[str], float]]] = defaultdict(list)
    for (run_id, unit, model), vals in values.items():
        by_run[run_id].append((unit, model, statistics.median(vals)))
    latest: dict[Optional[str], dict[Unit, float]] = defaultdict(dict)  # model -> unit -> its latest value
    out: dict[tuple[Unit, Optional[str]], list[Point]] = defaultdict(list)
    for run_id in sorted(by_run, key=lambda r: _order(runs, r)):
        for unit, model, value in by_run[run_id]:  # the run's own units first: they were measured together
            latest[model][unit] = value
        for unit, model, value in by_run[run_id]:
            peers = [v for u, v in latest[model].items() if u != unit]
            fleet = statistics.median(peers) if len(peers) >= min_peers else None
            out[(unit, model)].append(Point(run_id, runs[run_id].started_at, value, fleet))
    return dict(out)


def change_point(ratios: Sequence[float], rules: Rules, noise_z: float = 0.0) -> Optional[int]:
    """The index of the first run from which the node stays under (1 - margin) of its earlier median
    (and, with `noise_z`, under that median less noise_z times the earlier runs' spread: 1.4826 MAD)."""
    for k in range(rules.min_before, len(ratios) - rules.min_after + 1):
        base = statistics.median(ratios[:k])
        spread = 1.4826 * statistics.median(abs(r - base) for r in ratios[:k])
        line = min((1.0 - rules.margin) * base, base - noise_z * spread)
        if (ratios[k] < line and statistics.median(ratios[k:k + rules.min_after]) < line
                and statistics.median(ratios[k:]) < line):
            return k
    return None


def drift_findings(nodes: dict[tuple[str, Optional[str]], list[Point]],
                   gpus: dict[tuple[tuple[str, str], Optional[str]], list[Point]], metric: str,
                   rules: Rules) -> list[Finding]:
    """Each drifted node, and each drifted GPU of a node that did not drift as a whole (that node's
    drifted GPUs are named in its own finding instead: one finding per fault, not nine)."""
    gpu_drifts: dict[str, list[Finding]] = defaultdict(list)
    for ((node, gpu), model), points in sorted(gpus.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        drift = drift_finding(node, model, metric, points, rules, gpu=gpu)
        if drift is not None:
            gpu_drifts[node].append(drift)
    out = []
    for (node, model), points in sorted(nodes.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        drift = drift_finding(node, model, metric, points, rules,
                              gpus_drifted=[str(f.evidence["gpu"]) for f in gpu_drifts[node]])
        if drift is not None:
            out.append(drift)
        else:
            out += gpu_drifts[node]
    return out


def drift_finding(node: str, model: Optional[str], metric: str, points: Sequence[Point], rules: Rules, *,
                  gpu: Optional[str] = None, gpus_drifted: Sequence[str] = ()) -> Optional[Finding]:
    """The drift of one node (or one GPU of it: `gpu`), None when its series shows none."""
    judged = [p for p in points if p.ratio is not None]
    ratios = [p.ratio for p in judged if p.ratio is not None]
    k = change_point(ratios, rules, rules.gpu_noise_z if gpu is not None else 0.0)
    if k is None:
        return None
    before, after = statistics.median(ratios[:k]), statistics.median(ratios[k:])
    start, last = judged[k], judged[-1]
    drop = (1.0 - after / before) * 100.0
    what = "compute speed" if metric == "compute_speed" else "bus bandwidth"
    who = node if gpu is None else f"{node} GPU {gpu}"
    evidence: dict = {}
    if gpu is not None:
        evidence["gpu"] = gpu
    elif gpus_drifted:  # the node's GPUs went together: named here, not once each
        evidence["gpus_drifted"] = list(gpus_drifted)
    return codes.finding(
        "HIS001", PROBE,
        f"{who}: {what} {drop:.0f}% lower against the fleet's {model or 'same-model'} median since run "
        f"{start.run_id} ({_date(start.started_at)}), {len(ratios) - k} runs in a row",
        nodes=(node,),
        evidence={**evidence, "metric": metric, "model": model, "since_run": start.run_id,
                  "since": _date(start.started_at),
                  "ratio_to_fleet_before": round(before, 3), "ratio_to_fleet_after": round(after, 3),
                  "drop_pct": round(drop, 1), "runs_before": k, "runs_after": len(ratios) - k,
                  "latest": {"run_id": last.run_id, "date": _date(last.started_at), "value": last.value,
                             "fleet_median": last.fleet},
                  "margin_pct": rules.margin * 100})


def _participation(history: History, runs: dict[str, RunRow]) -> dict[str, set[str]]:
    """node -> the runs it took part in (its run_nodes rows; else any row of the run that names it)."""
    out: dict[str, set[str]] = defaultdict(set)
    rows: Iterable = history.nodes or history.measurements
    for row in rows:
        if row.run_id in runs:
            out[row.node].add(row.run_id)
    return dict(out)


def _critical_runs(history: History, runs: dict[str, RunRow]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for f in history.findings:
        if f.node and f.severity == Severity.CRITICAL.label and f.run_id in runs:
            out[f.node].add(f.run_id)
    return dict(out)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return min(1.0, sum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(k, n + 1)))


def lemon_findings(participation: dict[str, set[str]], critical: dict[str, set[str]], runs: dict[str, RunRow],
                   rules: Rules) -> list[Finding]:
    judged = [node for node, took in participation.items() if len(took) >= rules.min_runs]
    if len(judged) < 2:
        return []
    total_n = sum(len(participation[n]) for n in judged)
    total_k = sum(len(critical.get(n, set()) & participation[n]) for n in judged)
    out = []
    for node in sorted(judged):
        n, bad = len(participation[node]), sorted(critical.get(node, set()) & participation[node],
                                                  key=lambda r: _order(runs, r))
        k = len(bad)
        peers_n, peers_k = total_n - n, total_k - k
        p = (peers_k + 1) / (peers_n + 2)
        if k < rules.min_critical or k / n < 2 * p:
            continue
        p_value = binomial_tail(k, n, p)
        if p_value >= rules.alpha / len(judged):
            continue
        out.append(codes.finding(
            "HIS002", PROBE,
            f"{node}: a critical finding in {k} of its {n} runs, against {peers_k} of {peers_n} on the other "
            f"{len(judged) - 1} nodes ({100 * k / n:.0f}% vs {100 * peers_k / max(1, peers_n):.0f}%)",
            nodes=(node,),
            evidence={"runs": n, "critical_runs": k, "peer_runs": peers_n, "peer_critical_runs": peers_k,
                      "peer_rate_smoothed": round(p, 4), "p_value": float(f"{p_value:.3g}"),
                      "threshold": float(f"{rules.alpha / len(judged):.3g}"),
                      "critical_run_ids": bad[-10:],
                      "first_critical": _date(runs[bad[0]].started_at), "last_critical": _date(runs[bad[-1]].started_at)}))
    return out


def counter_findings(history: History, runs: dict[str, RunRow], rules: Rules) -> list[Finding]:
    counters = CRITICAL_COUNTERS + WARN_COUNTERS
    series: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)  # (node, gpu, metric) -> run -> max
    for m in history.measurements:
        if m.metric in counters and m.run_id in runs and math.isfinite(m.value):
            gpu = m.gpu if m.gpu is not None else f"rank {m.rank}"
            by_run = series[(m.node, gpu, m.metric)]
            by_run[m.run_id] = max(m.value, by_run.get(m.run_id, -math.inf))
    rising: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(dict)  # (node, gpu) -> metric -> rises
    for (node, gpu, metric), by_run in series.items():
        ordered = sorted(by_run, key=lambda r: _order(runs, r))
        rises = [{"run_id": b, "date": _date(runs[b].started_at), "from": by_run[a], "to": by_run[b]}
                 for a, b in zip(ordered, ordered[1:]) if by_run[b] > by_run[a]]
        if len(rises) >= rules.min_rises and by_run[ordered[-1]] > by_run[ordered[0]]:
            rising[(node, gpu)][metric] = rises
    out = []
    for (node, gpu), metrics in sorted(rising.items()):
        said = ", ".join(f"{m} {r[0]['from']:g} -> {r[-1]['to']:g}" for m, r in sorted(metrics.items()))
        out.append(codes.finding(
            "HIS003", PROBE, f"{node} GPU {gpu}: {said}, rising over {max(len(r) for r in metrics.values())} runs",
            severity=Severity.CRITICAL if any(m in CRITICAL_COUNTERS for m in metrics) else Severity.WARN, nodes=(node,),
            evidence={"gpu": gpu, "rises": {m: r[-10:] for m, r in sorted(metrics.items())}}))
    return out
