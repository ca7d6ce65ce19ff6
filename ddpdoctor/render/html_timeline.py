"""The report page's timeline (render/html_report.py): a Chrome trace-event document (core/timeline.py) drawn as a
Gantt chart, one row per thread (a rank, a rank's steps), a bar per span coloured by kind, a diamond per finding,
and the spans still open when the run ended listed in words; capped at MAX_BARS bars and MAX_ROWS rows."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ddpdoctor.render.html_parts import (BAR_CLASSES, BAR_FAILED, MAX_BARS, MAX_LIST, MAX_ROWS, SEVERITY_COLOURS,
                                         STUCK_INSIDE, Chart, as_map, e, layout, plot_text)

def timeline_of(kind: str, data: Mapping[str, Any], reports: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """A check report's own timeline (render/trace_check.py), or the one check report a diagnosis read."""
    from ddpdoctor.render.trace_check import from_report, is_check_report

    report = data if kind in ("check", "allreduce-bench") else (reports[0] if len(reports) == 1 else None)
    if report is None or not is_check_report(report):
        return None
    try:
        return from_report(report).to_json()
    except (KeyError, ValueError, TypeError):
        return None


@dataclass
class _Bar:
    row: tuple[int, int]
    name: str
    cls: str
    start_s: float
    dur_s: float
    args: Mapping[str, Any]
    depth: int = 0


def _bar_class(event: Mapping[str, Any]) -> str:
    name, cat = str(event.get("name") or ""), str(event.get("cat") or "")
    if name.endswith(" (stuck)") or cat == "hang":
        return "stuck"
    if name in ("data", "compute"):
        return name
    if name.startswith("wait"):
        return "wait"
    return cat if cat in BAR_CLASSES else "other"


def _events(timeline: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    events = timeline.get("traceEvents") if isinstance(timeline, Mapping) else None
    return [x for x in events or [] if isinstance(x, Mapping)]


def _rows(events: list[Mapping[str, Any]]) -> tuple[dict[tuple[int, int], str], list[tuple[int, int]]]:
    """Each (pid, tid)'s label, and the rows in the order the producer sorted them (node, then rank)."""
    nodes = {x.get("pid"): str((x.get("args") or {}).get("name") or "") for x in events
             if x.get("ph") == "M" and x.get("name") == "process_name"}
    names: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, int], float] = {}
    for x in events:
        key = (int(x.get("pid") or 0), int(x.get("tid") or 0))
        if x.get("ph") == "M" and x.get("name") == "thread_name":
            names[key] = str((x.get("args") or {}).get("name") or key[1])
        elif x.get("ph") == "M" and x.get("name") == "thread_sort_index":
            order[key] = float((x.get("args") or {}).get("sort_index") or 0)
        elif x.get("ph") == "X":
            names.setdefault(key, f"thread {key[1]}")
    several = len({pid for pid, _ in names}) > 1
    hosts = {pid: name[len("node "):] if name.startswith("node ") else name for pid, name in nodes.items()}
    labels = {k: (f"{v} ({hosts.get(k[0], k[0])})" if several else v) for k, v in names.items()}
    rows = sorted(labels, key=lambda k: (k[0], order.get(k, k[1]), k[1]))
    return labels, rows


def _depths(bars: list[_Bar]) -> None:
    """Each bar's nesting depth in its row: a bar inside another is drawn narrower, on top of it."""
    by_row: dict[tuple[int, int], list[_Bar]] = {}
    for bar in bars:
        by_row.setdefault(bar.row, []).append(bar)
    for row in by_row.values():
        open_ends: list[float] = []
        for bar in sorted(row, key=lambda b: (b.start_s, -b.dur_s)):
            while open_ends and open_ends[-1] <= bar.start_s + 1e-9:
                open_ends.pop()
            bar.depth = min(len(open_ends), 3)
            open_ends.append(bar.start_s + bar.dur_s)


def _failed(bar: _Bar) -> bool:
    """A span that ended in an error or at its deadline: outlined, whatever its colour."""
    return str(bar.args.get("status") or "") in ("error", "timeout", "failed")


def _hover(bar: _Bar, label: str) -> str:
    lines = [f"{bar.name}", f"{label}: {bar.start_s:.3f} s + {bar.dur_s * 1e3:.3f} ms"]
    for key in ("status", "finding", "detail", "step"):
        if bar.args.get(key) not in (None, ""):
            lines.append(f"{key}: {str(bar.args[key])[:200]}")
    stack = bar.args.get("stack")
    if stack:
        lines += ["stack (last lines):", *str(stack).splitlines()[-8:]]
    return "<br>".join(plot_text(line) for line in lines)


def timeline_chart(timeline: Mapping[str, Any], go: Any) -> Chart:
    """The trace-event document as a Gantt chart: one row per thread (a rank, a rank's steps), a bar per complete
    event coloured by kind, a diamond per finding; the latest MAX_BARS bars and every stuck one."""
    events = _events(timeline)
    labels, rows = _rows(events)
    bars = [_Bar((int(x.get("pid") or 0), int(x.get("tid") or 0)), str(x.get("name") or ""), _bar_class(x),
                 float(x.get("ts") or 0) / 1e6, max(0.0, float(x.get("dur") or 0)) / 1e6,
                 as_map(x.get("args")))
            for x in events if x.get("ph") == "X" and isinstance(x.get("ts"), (int, float))]
    marks = [x for x in events if x.get("ph") in ("i", "I") and isinstance(x.get("ts"), (int, float))]
    chart = Chart("timeline", "per-rank timeline")
    notes = []
    stuck = [b for b in bars if b.cls == "stuck"]
    if len(rows) > MAX_ROWS:
        keep = list(dict.fromkeys([b.row for b in stuck] + rows))[:MAX_ROWS]
        notes.append(f"{MAX_ROWS} of {len(rows)} rows drawn (the stuck ones first, then in rank order)")
        rows = [r for r in rows if r in keep]
    kept_rows = set(rows)
    drawn = [b for b in bars if b.row in kept_rows]
    if len(drawn) > MAX_BARS:
        rest = sorted((b for b in drawn if b.cls != "stuck"), key=lambda b: b.start_s)
        room = max(0, MAX_BARS - sum(1 for b in drawn if b.cls == "stuck"))
        keep_ids = {id(b) for b in rest[len(rest) - room:]} if room else set()
        notes.append(f"capped: the latest {room} of {len(drawn)} spans drawn, and every stuck one")
        drawn = [b for b in drawn if b.cls == "stuck" or id(b) in keep_ids]
    other = as_map(timeline.get("otherData"))
    chart.note = "; ".join(notes)
    chart.about = "; ".join(f"{key}: {other[key]}" for key in ("clock", "kept") if other.get(key))
    chart.table = _stuck_list(stuck, labels)
    chart.bars = len(drawn)
    began = other.get("started_at_epoch_s")
    when = (" from " + datetime.datetime.fromtimestamp(float(began), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if isinstance(began, (int, float)) else "")
    chart.title = f"per-rank timeline: {len(drawn)} spans on {len(rows)} rows{when}"
    if go is None:
        chart.note = "; ".join([*notes, "not drawn without plotly"])
    if go is None or not rows:
        return chart
    _depths(drawn)
    height = 130 + 30 * len(rows)
    figure = go.Figure(layout=layout(go, height, barmode="overlay", bargap=0.2))
    row_labels = {r: plot_text(labels[r]) for r in rows}
    shown_classes = set()
    for depth in range(4):
        for cls, (legend, colour) in BAR_CLASSES.items():
            group = [b for b in drawn if b.cls == cls and b.depth == depth]
            if not group:
                continue
            figure.add_trace(go.Bar(
                y=[row_labels[b.row] for b in group], x=[b.dur_s for b in group], base=[b.start_s for b in group],
                orientation="h", width=0.8 * 0.62 ** depth,
                marker={"color": STUCK_INSIDE if cls == "stuck" and depth else colour,
                        "line": {"color": BAR_FAILED, "width": [1.5 if _failed(b) else 0 for b in group]}},
                name=plot_text(legend), legendgroup=cls, showlegend=cls not in shown_classes,
                hovertext=[_hover(b, labels[b.row]) for b in group], hovertemplate="%{hovertext}<extra></extra>"))
            shown_classes.add(cls)
    _add_marks(figure, go, marks, rows, row_labels)
    figure.update_yaxes(type="category", categoryorder="array", categoryarray=[row_labels[r] for r in rows],
                        autorange="reversed")
    figure.update_xaxes(title_text="seconds since the run began (rank 0's clock)", rangemode="tozero")
    chart.figure, chart.height = figure, height
    return chart


def _add_marks(figure: Any, go: Any, marks: list[Mapping[str, Any]], rows: list[tuple[int, int]],
               row_labels: Mapping[tuple[int, int], str]) -> None:
    """Findings as diamonds on the rows they name (a job-wide one on the first row), coloured by severity."""
    by_severity: dict[str, list[tuple[str, float, str]]] = {}
    for mark in marks:
        key = (int(mark.get("pid") or 0), int(mark.get("tid") or 0))
        if mark.get("s") != "g" and key not in row_labels:
            continue  # a row left out (MAX_ROWS)
        row = rows[0] if mark.get("s") == "g" else key
        severity = str((mark.get("args") or {}).get("severity") or "info")
        by_severity.setdefault(severity, []).append((row_labels[row], float(mark["ts"]) / 1e6, str(mark.get("name"))))
    order = ["ok", "info", "warn", "critical"]  # the worst drawn last, on top where findings share a moment
    for severity, points in sorted(by_severity.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 0):
        figure.add_trace(go.Scatter(
            y=[p[0] for p in points], x=[p[1] for p in points], mode="markers", name=plot_text(f"finding ({severity})"),
            marker={"symbol": "diamond", "size": 11, "color": SEVERITY_COLOURS.get(severity, "#555"),
                    "line": {"width": 1, "color": "#fff"}},
            hovertext=[plot_text(p[2]) for p in points], hovertemplate="%{hovertext}<extra></extra>"))


def _stuck_list(stuck: list[_Bar], labels: Mapping[tuple[int, int], str]) -> str:
    """The spans still open when the run ended, in words: the picture of a hang, readable without a chart."""
    if not stuck:
        return ""
    items = "".join(f"<li><b>{e(labels.get(b.row, b.row))}</b>: {e(b.name)} from {b.start_s:.3f} s, "
                    f"{b.dur_s:.3f} s open{(' · ' + e(b.args.get('finding'))) if b.args.get('finding') else ''}</li>"
                    for b in stuck[:MAX_LIST])
    return f'<div class="stuck"><b>Still running when the run ended</b><ul>{items}</ul></div>'
