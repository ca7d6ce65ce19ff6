"""Rank 0's kept windows of the run, for the timeline `Doctor(trace_path=...)` writes (core/timeline.py).

Why the gathered rows: at each check every rank's last WINDOW_CAP steps reach rank 0 anyway (callback/row.py),
each step's length, its data time before it and its share of waiting for peers. Laying them on a clock costs
three numbers more a row, read at the check (never on the step path): the wall time its last step ended, and
when the previous check began and the rank left its gather (the check is drawn too). Every rank leaves a
gather together (within the collective's own latency), so the difference between a rank's leaving time and
rank 0's is its host's clock against rank 0's: ranks on one clock without a clock measurement of their own.

Bounded whatever the run's length: the first FIRST windows (the run's start: compile, warm-up) and the last
LAST ones, each at most `steps_cap` steps a rank (smaller for bigger jobs: about MAX_STEP_SPANS steps in all).
A hang adds the stuck ranks' open spans (from where their last window ended) with what the hang's verdict
said of each: cause, where in the user's code, its stack; the victims' waits beside them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ddpdoctor.callback.row import GatheredRow
from ddpdoctor.core.findings import Finding
from ddpdoctor.core.timeline import Mark, Span, Timeline

FIRST = 1
LAST = 4
MAX_STEP_SPANS = 20_000  # steps drawn in all (4 events each): a trace of a few MB at most
STACK_LINES = 24
HANG_CODES = ("DOC007",)


@dataclass(frozen=True)
class _Window:
    rows: dict[int, GatheredRow]
    hosts: dict[int, str]


class TraceKeep:
    """What the timeline needs of the run, kept by rank 0 at each check."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, world_size)
        self.steps_cap = max(4, min(128, MAX_STEP_SPANS // (self.world_size * (FIRST + LAST))))
        self.first: list[_Window] = []
        self.last: deque[_Window] = deque(maxlen=LAST)
        self.offsets: dict[int, float] = {}  # a rank's host clock minus rank 0's (s), from the gathers' exits
        self.hosts: dict[int, str] = {}
        self.hangs: list[tuple[Finding, float]] = []
        self.marks: list[Mark] = []

    def add(self, rows: Mapping[int, GatheredRow], hosts: Mapping[int, str]) -> None:
        """A gathered table (a check's, or the end's)."""
        if not rows:
            return
        self.hosts.update(hosts)
        left0 = rows[0].gather_left_s if 0 in rows else 0.0
        for rank, row in rows.items():
            if left0 > 0 and row.gather_left_s > 0:
                self.offsets[rank] = row.gather_left_s - left0
        window = _Window(dict(rows), dict(hosts))
        if len(self.first) < FIRST:
            self.first.append(window)
        else:
            self.last.append(window)

    def finding(self, finding: Finding, at_s: float) -> None:
        """A finding as it is reported (rank 0's wall clock): a mark, and a hang's open spans."""
        self.marks.append(Mark(name=f"{finding.code} {finding.severity.label}: {finding.title}"[:200], at_s=at_s,
                               ranks=tuple(r for r in finding.ranks if 0 <= r < self.world_size),
                               args={"code": finding.code, "title": finding.title, "fix": finding.fix}))
        if finding.code in HANG_CODES:
            self.hangs.append((finding, at_s))

    def timeline(self, ended_s: float, about: Optional[dict[str, Any]] = None) -> Timeline:
        hosts = dict(self.hosts) or {0: ""}
        timeline = Timeline(hosts=hosts, ended_s=ended_s, about={
            "clock": "each rank's host clock moved to rank 0's by when it left each check's gather",
            "kept": f"the first {FIRST} and the last {LAST} checks' windows, at most {self.steps_cap} steps a rank "
                    "each", **(about or {})})
        last_end: dict[int, float] = {}
        for window in self.first + list(self.last):
            for rank, row in window.rows.items():
                spans, end = self._steps(rank, row, floor=last_end.get(rank, float("-inf")))
                timeline.spans += spans + self._check(rank, row, floor=last_end.get(rank, float("-inf")))
                if end is not None:
                    last_end[rank] = max(end, last_end.get(rank, end))
        for finding, at_s in self.hangs:
            timeline.spans += _hang_spans(finding, at_s, last_end)
        timeline.marks += self.marks
        timeline.ended_s = max([ended_s] + [s.start_s for s in timeline.spans])
        return timeline

    def _check(self, rank: int, row: GatheredRow, floor: float) -> list[Span]:
        """The check before this window on this rank: from its begin (the rank's row made) to the rank's leaving
        its gather. A rank that came late waits least in it; the others wait for it there."""
        if row.check_began_s <= 0 or row.gather_left_s <= 0:
            return []
        shift = self.offsets.get(rank, 0.0)
        began, left = row.check_began_s - shift, row.gather_left_s - shift
        if began < floor or left < began:
            return []
        return [Span(rank, "ddpdoctor check", began, left, "check", {"ms": round((left - began) * 1e3, 3)})]

    def _steps(self, rank: int, row: GatheredRow, floor: float) -> tuple[list[Span], Optional[float]]:
        """The row's steps laid back from its last step's end: each step's period is its data time then the
        step, the wait for peers drawn at its end (where DDP holds backward until the all-reduce is done).
        None drawn before `floor` (the rank's previous window's end: a changed clock correction never draws
        two windows over each other)."""
        n = min(len(row.step_ms), len(row.data_ms), self.steps_cap)
        if n == 0 or row.last_end_s <= 0:
            return [], None
        spans: list[Span] = []
        cursor = row.last_end_s - self.offsets.get(rank, 0.0)
        end = cursor
        first_number = row.steps_done - len(row.step_ms) + 1
        for i in range(len(row.step_ms) - 1, len(row.step_ms) - 1 - n, -1):
            step_s, data_s = row.step_ms[i] / 1e3, row.data_ms[i] / 1e3
            wait_s = min(step_s, row.wait_ms[i] / 1e3) if i < len(row.wait_ms) else 0.0
            began = cursor - step_s
            if began - data_s < floor:
                break
            spans.append(Span(rank, f"step {first_number + i}", began - data_s, cursor, "step",
                              {"data_ms": round(row.data_ms[i], 4), "step_ms": round(row.step_ms[i], 4),
                               "wait_ms": round(wait_s * 1e3, 4)}))
            if data_s > 0:
                spans.append(Span(rank, "data", began - data_s, began, "phase"))
            spans.append(Span(rank, "compute", began, cursor - wait_s, "phase"))
            if wait_s > 0:
                spans.append(Span(rank, "wait for peers", cursor - wait_s, cursor, "phase"))
            cursor = began - data_s
        return spans, end


def _hang_spans(finding: Finding, at_s: float, last_end: Mapping[int, float]) -> list[Span]:
    """The hang's open spans: a culprit's step that never ended, a victim's wait; each from where its last kept
    window ended (the steps since the last check were not gathered), with what the verdict said of it."""
    evidence = finding.evidence
    causes = evidence.get("cause_by_rank") or {}
    states = evidence.get("state_by_rank") or {}
    frames = evidence.get("user_frame_by_rank") or {}
    steps = evidence.get("step_by_rank") or {}
    victims = evidence.get("affected_ranks") or {}
    spans = []
    for key in sorted(set(causes) | set(victims) | {str(r) for r in finding.ranks}, key=int):
        rank = int(key)
        culprit = key in causes or (rank in finding.ranks and not victims)
        stack = evidence.get(f"python_stack_rank_{rank}") or (evidence.get("python_stack") if culprit else None)
        args: dict[str, Any] = {"finding": f"{finding.code}: {finding.title}",
                                "role": "stuck (the cause)" if culprit else "waiting for the stuck rank",
                                "began": "after this rank's last step kept here (the steps since the last check "
                                         "are not gathered)"}
        for name, table in (("cause", causes), ("state", states), ("user_frame", frames), ("step", steps)):
            if key in table:
                args[name] = table[key]
        if key in victims:
            args["waiting"] = victims[key]
        if stack:
            lines = stack if isinstance(stack, list) else str(stack).splitlines()
            args["stack"] = "\n".join(str(line) for line in lines[-STACK_LINES:])
        step = steps.get(key)
        name = (f"step {step}" if step is not None else "step") if culprit else f"waiting in {states.get(key, 'a collective')}"
        spans.append(Span(rank, name, last_end.get(rank, at_s), None, "hang", args))
    return spans
