"""`check`'s report as a timeline (render/trace.py): each rank's stages, the stragglers probe's steps, the findings.

Why from the report, not from the live run: the report already holds every rank's stages with their wall-clock
begin and end (`ranks[].timeline`), the stragglers probe's per-step phases with each host's clock offset to
rank 0's, and the findings with the stacks of stuck ranks; `check --trace` and `diagnose REPORT --trace` then
draw the same picture of the same run, and an old report can still be drawn.

- Stages: a rank's stage that never ended (status running or timeout: the rank hung there, or was stopped
  while in it) is an open span to the report's end, with the finding that names the rank and its stack.
- The stragglers probe's steps: data, compute (forward and backward) and waiting for the all-reduce, laid
  from each step's arrival at the all-reduce (rank 0's clock; the first gradient bucket's hook, soon after
  backward begins): a straggler's peers wait where it computes.
  At most STEPS_KEPT steps a rank (the last ones): the file stays small whatever the probe measured.
- Findings: one instant event each, at the report's end, on the ranks they name.
Clocks: a host's stages are moved by the offset the stragglers probe measured for it (none measured: as
read, and said in `otherData`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ddpdoctor.render.trace import Mark, Span, Timeline

STEPS_KEPT = 200  # per rank, the probe's last steps
STACK_LINES = 24


def from_report(report: Mapping[str, Any]) -> Timeline:
    ranks = [r for r in report.get("ranks") or [] if isinstance(r, Mapping) and isinstance(r.get("rank"), int)]
    hosts = {r["rank"]: str(r.get("host") or "?") for r in ranks}
    started = float(report.get("started_at") or 0.0)
    ended = started + float(report.get("duration_s") or 0.0)
    offsets, clock_said = _offsets(report)
    findings = [f for f in report.get("findings") or [] if isinstance(f, Mapping)]
    timeline = Timeline(hosts=hosts, ended_s=ended, began_s=started or None, about={
        "command": report.get("command"), "verdict": report.get("verdict_line") or report.get("verdict"),
        "clock": clock_said})
    for rank in ranks:
        r = rank["rank"]
        shift = offsets.get(r, 0.0)
        for stage in rank.get("timeline") or []:
            span = _stage_span(r, stage, shift, findings)
            if span is not None:
                timeline.spans.append(span)
                ended = max(ended, span.start_s)
    timeline.ended_s = ended
    timeline.spans += _probe_steps(report)
    for f in findings:
        timeline.marks.append(Mark(name=f"{f.get('code')} {f.get('severity', '')}: {f.get('title', '')}"[:200],
                                   at_s=ended, ranks=tuple(x for x in f.get("ranks") or [] if x in hosts),
                                   args={"code": f.get("code"), "severity": f.get("severity"),
                                         "title": f.get("title"), "fix": f.get("fix")}))
    return timeline


def _offsets(report: Mapping[str, Any]) -> tuple[dict[int, float], str]:
    """Each rank's host clock minus rank 0's (s), from the stragglers probe's measurement."""
    facts = _probe_facts(report, "stragglers")
    offsets: dict[int, float] = {}
    for key, fact in facts.items():
        clock = fact.get("clock") if isinstance(fact, Mapping) else None
        offset = clock.get("offset_ms") if isinstance(clock, Mapping) else None
        if isinstance(offset, (int, float)):
            offsets[int(key)] = offset / 1e3
    if offsets:
        return offsets, "each host's clock moved to rank 0's by the offset the stragglers probe measured"
    nodes = {str(r.get("host")) for r in report.get("ranks") or [] if isinstance(r, Mapping)}
    return {}, ("one host: one clock" if len(nodes) <= 1
                else "hosts' clocks as read (no offset measured: run the stragglers probe to correct them)")


def _probe_facts(report: Mapping[str, Any], name: str) -> dict[str, Any]:
    for probe in report.get("probes") or []:
        if isinstance(probe, Mapping) and probe.get("name") == name and isinstance(probe.get("facts"), Mapping):
            return dict(probe["facts"])
    return {}


def _stage_span(rank: int, stage: Any, shift: float, findings: list[Mapping[str, Any]]) -> Optional[Span]:
    if not isinstance(stage, Mapping) or not isinstance(stage.get("started"), (int, float)):
        return None
    name = str(stage.get("name") or "stage")
    status = str(stage.get("status") or "")
    start = float(stage["started"]) - shift
    ended = stage.get("ended")
    args: dict[str, Any] = {"status": status}
    if stage.get("detail"):
        args["detail"] = stage["detail"]
    end = float(ended) - shift if isinstance(ended, (int, float)) and status not in ("running", "timeout") else None
    if end is None:
        args.update(_why_stuck(rank, findings))
    return Span(rank=rank, name=name, start_s=start, end_s=None if end is None else max(start, end),
                cat="probe" if name.startswith("probe:") else "stage", args=args)


def _why_stuck(rank: int, findings: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The first finding naming this rank, and its stack where the finding kept one."""
    for f in findings:
        found = f.get("evidence")
        evidence: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        stack = evidence.get(f"python_stack_rank_{rank}") or (
            evidence.get("python_stack") if rank in (f.get("ranks") or []) else None)
        if rank in (f.get("ranks") or []) or stack:
            said: dict[str, Any] = {"finding": f"{f.get('code')}: {f.get('title', '')}"}
            if stack:
                lines = stack if isinstance(stack, list) else str(stack).splitlines()
                said["stack"] = "\n".join(str(line) for line in lines[-STACK_LINES:])
            return said
    return {}


def _probe_steps(report: Mapping[str, Any]) -> list[Span]:
    """The stragglers probe's last steps per rank: data, compute and the all-reduce's wait, each step laid from
    its arrival at the all-reduce (the end of its backward compute's first bucket; rank 0's clock)."""
    spans: list[Span] = []
    for key, fact in _probe_facts(report, "stragglers").items():
        if not isinstance(fact, Mapping) or not isinstance(fact.get("steps"), Mapping):
            continue
        rank = int(key)
        steps, arrivals = fact["steps"], fact.get("arrival_s") or []
        columns = {k: steps.get(k) or [] for k in ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms",
                                                    "optimizer_ms", "step_ms")}
        n = min([len(arrivals)] + [len(v) for v in columns.values()])
        free = float("-inf")  # where the previous step ended: a step is never drawn over the one before
        for i in range(max(0, n - STEPS_KEPT), n):
            data, fwd, bwd, wait, opt = (float(columns[k][i]) / 1e3 for k in
                                         ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms"))
            # The arrival is the first gradient bucket's hook, soon after backward begins (the last layer's
            # gradients are ready first): the step is drawn from the arrival less its data and forward.
            began = max(free, float(arrivals[i]) - fwd - data)
            length = max(float(columns["step_ms"][i]) / 1e3, data + fwd + bwd + wait + opt)
            free = began + length
            computed, waited = began + data + fwd + bwd, began + data + fwd + bwd + wait
            args = {"step": i, "data_ms": columns["data_ms"][i], "forward_ms": columns["forward_ms"][i],
                    "backward_ms": columns["backward_ms"][i], "wait_ms": columns["comm_wait_ms"][i]}
            spans.append(Span(rank, f"step {i}", began, free, "step", args, track="steps"))
            spans.append(Span(rank, "data", began, began + data, "phase", track="steps"))
            spans.append(Span(rank, "compute", began + data, computed, "phase", track="steps"))
            spans.append(Span(rank, "wait for peers", computed, waited, "phase", track="steps"))
    return spans
