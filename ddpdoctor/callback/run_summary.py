"""The run's figures, per rank and for the job: what the end-of-run summary shows as evidence.

Why a ledger of sums and a histogram rather than the steps: a job runs for days, and the summary
(docs/report-schema.md, `summary`) must be the same size after ten steps and after ten million.
Rank 0 folds every gathered table into it at each check, off the step path, and the final
exchange's rows last. The steps folded are the ones the rows carry (each check's last
WINDOW_CAP steps): a sample of the run at every check, not all of it. Counts and times that every
row carries whole (steps done, the windows' wall time) are exact.

Step time here is the whole period of a step, the loader's part included: what the user waits
for. Its parts: data (before the step began), waiting for peers (the gradient all-reduce's wait,
and a framework's own collective between steps), and compute (the rest of the step).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ddpdoctor.callback.row import GatheredRow
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.judge import causal_order

# Log-spaced bins of 2%: a median or p90 read from them is within 1% of the steps' own.
_BIN_RATIO = 1.02
_BIN_FLOOR_MS = 1e-3
_LOG_RATIO = math.log(_BIN_RATIO)
_BINS = 1 + int(math.log(1e7 / _BIN_FLOOR_MS) / _LOG_RATIO)  # up to 10^7 ms a step: bins at most, per rank
SHOWN_FINDINGS = 6  # in the terminal; every finding is in the JSON


def _bin_ms(index: int) -> float:
    """The bin's middle, geometrically."""
    return _BIN_FLOOR_MS * _BIN_RATIO ** (index + 0.5)


@dataclass
class RankLedger:
    """One rank's run, folded from its rows: sums, counts and a histogram of step periods."""

    rank: int
    host: str = ""
    steps: int = 0  # steps done at its last row (exact)
    wall_s: float = 0.0  # its windows' wall time, summed (exact)
    sampled: int = 0  # steps whose timings were carried
    period_ms: float = 0.0  # data + step, summed over the sampled steps
    data_ms: float = 0.0
    wait_ms: float = 0.0
    samples: float = 0.0  # over the sampled steps whose batch size was known
    samples_ms: float = 0.0  # the periods of those steps
    hist: dict[int, int] = field(default_factory=dict)

    def add(self, row: GatheredRow, host: str) -> None:
        """The row's counts and sums (its histogram is the table's: `RunLedger.add`, in one pass for every rank)."""
        self.host = host or self.host
        self.steps = max(self.steps, row.steps_done)
        self.wall_s += max(0.0, row.window_s)
        n = len(row.step_ms)
        if not n:
            return
        # Each column is non-negative by construction (callback/doctor.py's _window_row: the data is the gap less
        # a framework's wait, the wait a share of the step plus that wait), so plain sums: no per-step Python.
        period = sum(row.step_ms) + sum(row.data_ms)
        self.sampled += n
        self.period_ms += period
        self.data_ms += sum(row.data_ms)
        self.wait_ms += sum(row.wait_ms)
        known = sum(1 for v in row.samples if v > 0)
        if known == n:
            self.samples += sum(row.samples)
            self.samples_ms += period
        elif known:
            for step, data, samples in zip(row.step_ms, row.data_ms, row.samples):
                if samples > 0:
                    self.samples += samples
                    self.samples_ms += step + data

    def quantile_ms(self, q: float) -> Optional[float]:
        if not self.sampled:
            return None
        wanted = q * self.sampled
        seen = 0
        for b in sorted(self.hist):
            seen += self.hist[b]
            if seen >= wanted:
                return _bin_ms(b)
        return _bin_ms(max(self.hist))

    def mean_ms(self) -> Optional[float]:
        return self.period_ms / self.sampled if self.sampled else None

    def work_ms(self) -> Optional[float]:
        """Its mean step less its wait for peers: what the rank itself takes (the slowest one's sets the step)."""
        return (self.period_ms - self.wait_ms) / self.sampled if self.sampled else None

    def samples_per_s(self) -> Optional[float]:
        return 1e3 * self.samples / self.samples_ms if self.samples_ms > 0 else None

    def to_json(self, missing: Optional[str] = None) -> dict[str, Any]:
        def share(part: float) -> Optional[float]:
            return round(100.0 * part / self.period_ms, 1) if self.period_ms > 0 else None

        median, p90, rate = self.quantile_ms(0.5), self.quantile_ms(0.9), self.samples_per_s()
        return {"rank": self.rank, "node": self.host, "steps": self.steps,
                "step_ms_median": None if median is None else round(median, 3),
                "step_ms_p90": None if p90 is None else round(p90, 3),
                "data_pct": share(self.data_ms), "wait_pct": share(self.wait_ms),
                "compute_pct": share(self.period_ms - self.data_ms - self.wait_ms),
                "samples_per_s": None if rate is None else round(rate, 1), "sampled_steps": self.sampled,
                "arrived": missing is None, **({"missing": missing} if missing else {})}


@dataclass
class RunLedger:
    """Every rank's ledger: the run as rank 0 saw it through the checks' tables."""

    ranks: dict[int, RankLedger] = field(default_factory=dict)

    def add(self, rows: Mapping[int, GatheredRow], hosts: Mapping[int, str]) -> None:
        """One gathered table, at a check, on rank 0: every rank's sums, and one histogram pass over the table's
        steps (a few milliseconds at 256 ranks of 128 steps, where a loop over the steps in Python took 90)."""
        import torch

        timed = []
        for r, row in rows.items():
            self.ranks.setdefault(r, RankLedger(r)).add(row, hosts.get(r, ""))
            if row.step_ms:
                timed.append(r)
        if not timed:
            return
        period = (torch.tensor([v for r in timed for v in rows[r].step_ms], dtype=torch.float64)
                  + torch.tensor([v for r in timed for v in rows[r].data_ms], dtype=torch.float64))
        bins = (torch.log(period.clamp_min(_BIN_FLOOR_MS) / _BIN_FLOOR_MS) / _LOG_RATIO).long()
        owner = torch.tensor([i for i, r in enumerate(timed) for _ in rows[r].step_ms], dtype=torch.long)
        keys, counts = torch.unique(owner * _BINS + bins.clamp(0, _BINS - 1), return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist()):
            hist = self.ranks[timed[key // _BINS]].hist
            hist[key % _BINS] = hist.get(key % _BINS, 0) + count


def lost_to_slowest(ledger: RunLedger, findings: Sequence[Finding] = ()) -> Optional[dict[str, Any]]:
    """What the slowest rank costs each step. Where a straggler was named (STR001), the judge's own cost (its
    windows' low quantiles, the cause's part only), so the summary never names another rank than the verdict;
    else the ledger's means: the slowest rank's work (step less its wait) over its peers' median work, which in a
    healthy job is the spread of its noise (`straggler: false`)."""
    steps = max((led.steps for led in ledger.ranks.values()), default=0)
    named = next((f for f in findings if f.code == "STR001" and f.severity >= Severity.WARN and len(f.ranks) == 1
                  and f.evidence.get("cost_ms_per_step") is not None), None)
    if named is not None:
        cost, step = float(named.evidence["cost_ms_per_step"]), float(named.evidence.get("median_step_ms") or 0.0)
        return {"rank": named.ranks[0], "ms_per_step": round(cost, 3),
                "share_pct": round(100.0 * cost / step, 1) if step > 0 else None,
                "seconds": round(cost * steps / 1e3, 2), "straggler": True}
    works = {r: w for r, led in ledger.ranks.items() if (w := led.work_ms()) is not None}
    if len(works) < 2:
        return None
    slowest = max(works, key=lambda r: (works[r], -r))
    others = statistics.median(w for r, w in works.items() if r != slowest)
    lost = max(0.0, works[slowest] - others)
    periods = [m for led in ledger.ranks.values() if (m := led.mean_ms()) is not None]
    period = statistics.median(periods) if periods else 0.0
    return {"rank": slowest, "ms_per_step": round(lost, 3),
            "share_pct": round(100.0 * lost / period, 1) if period > 0 else None,
            "seconds": round(lost * steps / 1e3, 2), "straggler": False}


def verdict_line(findings: Sequence[Finding], steps: int, world: int) -> str:
    """The first line of the summary: the root cause (the causal order's first finding), or a healthy run's."""
    first = next((f for f in causal_order.ordered(list(findings), keep_order=True) if f.severity >= Severity.WARN), None)
    if first is None:
        return f"healthy: {steps} steps on {world} rank{'s' if world != 1 else ''}, no warning or critical finding"
    where = f" (ranks {rank_ranges(first.ranks)})" if len(first.ranks) > 1 else (
        f" (rank {first.ranks[0]})" if first.ranks else "")
    return f"{first.code}{where}: {first.title}"


def summary(ledger: RunLedger, findings: Sequence[Finding], world: int, wall_s: float,
            missing: Mapping[int, str], waited_s: float, judged_s: float,
            stragglers: Optional[dict[str, Any]] = None, replicas: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The run summary (docs/report-schema.md, `summary`): `findings` already in causal order, worst first.
    `stragglers`: what the end's straggler verdict rested on (`judged`, and the evidence's steps a rank, windows
    and seconds of the job, against what it needs), so a short run that says nothing says why. `replicas`: whether
    the end compared the ranks' weights (`compared`, `equal`, `step`) or why not (`why`).
    Its size grows with the ranks, never with the steps."""
    steps = max((led.steps for led in ledger.ranks.values()), default=0)
    rates = [rate for led in ledger.ranks.values() if (rate := led.samples_per_s()) is not None]
    top = next((f for f in findings if f.severity >= Severity.WARN), None)
    ranks = [ledger.ranks[r].to_json(missing.get(r)) if r in ledger.ranks
             else RankLedger(r).to_json(missing.get(r, "never reported")) for r in range(world)]
    medians = [m for led in ledger.ranks.values() if (m := led.quantile_ms(0.5)) is not None]
    return {"verdict": verdict_line(findings, steps, world),
            "severity": (top.severity if top is not None else Severity.OK).label,
            "code": top.code if top is not None else None,
            "world_size": world, "steps": steps, "wall_s": round(wall_s, 2), "judged_s": round(judged_s, 2),
            "stragglers_judged": stragglers,
            "step_ms_median": round(max(medians), 3) if medians else None,
            "samples_per_s": round(sum(rates), 1) if rates and len(rates) == len(ledger.ranks) else None,
            "lost_to_slowest": lost_to_slowest(ledger, findings),
            "ranks": ranks,
            "final_check": {"arrived": world - len(missing), "missing": sorted(missing),
                            "waited_ms": round(1e3 * waited_s, 1), "replicas": replicas},
            "findings": [{"code": f.code, "severity": f.severity.label, "title": f.title, "ranks": list(f.ranks)}
                         for f in findings[:SHOWN_FINDINGS]],
            "more_findings": max(0, len(findings) - SHOWN_FINDINGS)}
