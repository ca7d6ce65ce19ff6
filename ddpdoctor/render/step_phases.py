"""Each rank's step split into data, compute and waiting for peers, as the terminal's chart (render/charts.py)
and the report page's (render/html_charts.py) both draw it: one reading of the stragglers probe's columns and
of the callback's summary rows, so the two pictures of one run say the same."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ddpdoctor.core.medians import median


@dataclass(frozen=True)
class RankSteps:
    """One rank's median step (ms) and its phases' medians (ms)."""

    rank: int
    node: str
    data_ms: float
    compute_ms: float
    wait_ms: float
    step_ms: float

    def shares_pct(self) -> dict[str, float]:
        """Each phase's share of the three together, in % (the summary rows' data_pct, compute_pct, wait_pct)."""
        total = self.data_ms + self.compute_ms + self.wait_ms
        if total <= 0:
            return {}
        return {"data_pct": 100.0 * self.data_ms / total, "compute_pct": 100.0 * self.compute_ms / total,
                "wait_pct": 100.0 * self.wait_ms / total}


def _median(values: Sequence[Any]) -> Optional[float]:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return median(finite) if finite else None


def from_stragglers(facts: Mapping[str, Any]) -> list[RankSteps]:
    """The stragglers probe's facts (rank -> its steps' columns): each rank's median data, compute (forward,
    backward and optimizer of a step) and wait (the gradient all-reduce's), in ms."""
    out = []
    for key, fact in facts.items():
        steps = fact.get("steps") if isinstance(fact, Mapping) else None
        if not isinstance(steps, Mapping):
            continue
        columns = {k: list(steps.get(k) or []) for k in ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms",
                                                          "optimizer_ms", "step_ms")}
        n = min(len(v) for v in columns.values())
        compute = [columns["forward_ms"][i] + columns["backward_ms"][i] + columns["optimizer_ms"][i] for i in range(n)]
        medians = [_median(columns["data_ms"][:n]), _median(compute), _median(columns["comm_wait_ms"][:n]),
                   _median(columns["step_ms"][:n])]
        if n and all(m is not None for m in medians):
            data, work, wait, step = (float(m or 0.0) for m in medians)
            out.append(RankSteps(int(key), str(fact.get("host") or ""), data, work, wait, step))
    return sorted(out, key=lambda r: r.rank)


def from_summary(summary: Mapping[str, Any]) -> list[RankSteps]:
    """The callback's summary rows: each rank's median step cut by its data, compute and wait shares."""
    out = []
    for row in summary.get("ranks") or []:
        if not isinstance(row, Mapping) or not row.get("arrived", True):
            continue
        values = [row.get(k) for k in ("step_ms_median", "data_pct", "compute_pct", "wait_pct")]
        if not all(isinstance(v, (int, float)) for v in values):
            continue
        step, data, work, wait = (float(v or 0.0) for v in values)
        out.append(RankSteps(int(row.get("rank") or 0), str(row.get("node") or ""), step * data / 100,
                             step * work / 100, step * wait / 100, step))
    return sorted(out, key=lambda r: r.rank)
