"""`check`'s report as a timeline (core/timeline.py): each rank's stages, the stragglers probe's steps, the findings.

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
- The allreduce probe's timed calls (allreduce-bench's sweep, and where it localised, its ring pairs and node
  pairs), each size's or pair's calls as one span of their summed time with the bandwidth they make, laid end
  to end from the probe's start on a track of their own (their lengths are measured; where each call began
  is not recorded): a slow link's pair is the long bar on both its ranks.
- Findings: one instant event each, at the report's end, on the ranks they name.
Clocks: a host's stages are moved by the offset the stragglers probe measured for it (none measured: as
read, and said in `otherData`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ddpdoctor.judge.busbw import busbw_gbps, format_size
from ddpdoctor.core.timeline import Mark, Span, Timeline

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
            span = _stage_span(r, stage, shift, findings, ended_s=ended, ok=rank.get("state") == "ok",
                               in_flight=rank.get("collective_in_flight"))
            if span is not None:
                timeline.spans.append(span)
                ended = max(ended, span.start_s)
    timeline.ended_s = ended
    timeline.spans += _probe_steps(report)
    timeline.spans += _collectives(report, {r["rank"]: r.get("timeline") or [] for r in ranks}, offsets)
    for f in findings:
        timeline.marks.append(Mark(name=f"{f.get('code')} {f.get('severity', '')}: {f.get('title', '')}"[:200],
                                   at_s=ended, ranks=tuple(x for x in f.get("ranks") or [] if x in hosts),
                                   args={"code": f.get("code"), "severity": f.get("severity"),
                                         "title": f.get("title"), "fix": f.get("fix")}))
    return timeline


def _offsets(report: Mapping[str, Any]) -> tuple[dict[int, float], str]:
    """Each rank's host clock minus rank 0's (s), from the stragglers probe's measurement."""
    facts = probe_facts(report, "stragglers")
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


def is_check_report(data: Any) -> bool:
    """A `check --json` report (also allreduce-bench's, scaling's): its ranks and their stages are there to draw."""
    return isinstance(data, Mapping) and isinstance(data.get("ranks"), list) and "started_at" in data


def probe_facts(report: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The report's facts of probe `name` (rank -> facts); empty where the probe did not run."""
    for probe in report.get("probes") or []:
        if isinstance(probe, Mapping) and probe.get("name") == name and isinstance(probe.get("facts"), Mapping):
            return dict(probe["facts"])
    return {}


def _stage_span(rank: int, stage: Any, shift: float, findings: list[Mapping[str, Any]], ended_s: float,
                ok: bool, in_flight: Any = None) -> Optional[Span]:
    """A stage as a span; one not ended is open (stuck) unless its rank ended well: the report stage is still
    running while the report is made, and a rank that finished is not stuck anywhere (closed at the end)."""
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
    if end is None and (ok or name == "report") and status != "timeout":
        end = max(start, ended_s)
    elif end is None:
        args.update(_why_stuck(rank, findings))
        if in_flight:  # the collective it was in when the run ended, where it was in one
            args["collective_in_flight"] = in_flight
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
    for key, fact in probe_facts(report, "stragglers").items():
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


def _collectives(report: Mapping[str, Any], stages: Mapping[int, list[Any]], offsets: Mapping[int, float]) -> list[Span]:
    """The allreduce probe's measured calls per rank, laid end to end from its stage's start."""
    spans: list[Span] = []
    for key, fact in probe_facts(report, "allreduce").items():
        if not isinstance(fact, Mapping):
            continue
        rank = int(key)
        start = next((float(s["started"]) - offsets.get(rank, 0.0) for s in stages.get(rank, [])
                      if isinstance(s, Mapping) and s.get("name") == "probe:allreduce"
                      and isinstance(s.get("started"), (int, float))), None)
        if start is None:
            continue
        op, n = str(fact.get("op") or "all_reduce"), int(fact.get("world_size") or 1)
        cursor = start
        for size_bytes, label, times in _timed_calls(fact):
            total = sum(times)
            if total <= 0:
                continue
            best = min(times)
            args: dict[str, Any] = {"size_bytes": size_bytes, "calls": len(times),
                                    "median_ms": round(1e3 * sorted(times)[len(times) // 2], 4)}
            if label.startswith(op):
                args["busbw_gbps_best"] = round(busbw_gbps(op, n, size_bytes, best), 3)
            else:  # a pair's or a node's: two ranks, the data once each way (algbw)
                args["algbw_gbps_best"] = round(size_bytes / best / 1e9, 3)
            spans.append(Span(rank, label, cursor, cursor + total, "collective", args, track="collectives"))
            cursor += total
    return spans


def _timed_calls(fact: Mapping[str, Any]) -> list[tuple[int, str, list[float]]]:
    """(size, label, the call times) of the sweep, then the ring pairs, then the node and node-leader pairs."""
    out: list[tuple[int, str, list[float]]] = []
    op = str(fact.get("op") or "all_reduce")
    for result in fact.get("results") or []:
        if isinstance(result, Mapping) and isinstance(result.get("times_s"), list):
            size = int(result.get("size_bytes") or 0)
            out.append((size, f"{op} {format_size(size)}", [float(t) for t in result["times_s"]]))
    found = fact.get("pairs")
    pairs: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    for pair, times in sorted((pairs.get("times_s") or {}).items()):
        size = int(pairs.get("size_bytes") or 0)
        out.append((size, f"pair {pair} {format_size(size)}", [float(t) for t in times]))
    found = fact.get("nodes")
    nodes: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    for host, times in sorted((nodes.get("intra_times_s") or {}).items()):
        out.append((int(nodes.get("size_bytes") or 0), f"inside node {host}", [float(t) for t in times]))
    node_of = nodes.get("node_of_rank") or []
    for pair, times in sorted((nodes.get("leader_times_s") or {}).items()):
        a, _, b = str(pair).partition("-")
        named = " - ".join(str(node_of[int(r)]) if r.isdigit() and int(r) < len(node_of) else r for r in (a, b))
        out.append((int(nodes.get("size_bytes") or 0), f"nodes {named}", [float(t) for t in times]))
    return out
