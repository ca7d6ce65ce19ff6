"""One report as one self-contained HTML page: the verdict, the findings, the charts, the per-rank timeline.

Why one file with everything inline: the page is opened on air-gapped clusters and attached to tickets, where a
script or a style fetched from a CDN would be a blank page. So nothing is referenced, everything is inlined
(plotly.js once for the whole page, ~4.8 MB), and a Content-Security-Policy forbids the page any request: what
is not in the file cannot be loaded, even by a library's code path we never meant to reach.

The order is the order a reader needs: the verdict first (the report's first line and what its exit code
means), then the findings (code, severity, title, ranks and nodes, why, the fix, the evidence as a table), then
the charts, then the timeline. The charts are plotly's (`pip install ddpdoctor[html]`), each only where its data
is: busbw against message size from an `allreduce` probe section, each rank's median step split into data,
compute and waiting for peers from the `stragglers` probe or the callback's end-of-run summary, and the
timeline (a Chrome trace-event document, core/timeline.py) as one bar row per rank's track. Without plotly the
page says so in one line and keeps the findings and the charts' figures as tables.

Every string of the data is escaped (html.escape; plotly's own JSON escapes "<" too), and the data goes
through the same redaction as every JSON file ddpdoctor writes before it is drawn.
"""

from __future__ import annotations

import datetime
import html
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from ddpdoctor.core.exits import (
    EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, INJECTED_CRASH_EXIT, ORPHANED_EXIT, PEER_HUNG_EXIT,
    REQUEUE_NO_RETRY_EXIT, REQUEUE_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT, STAGE_TIMEOUT_EXIT)
from ddpdoctor.core.files import atomic_write_text
from ddpdoctor.core.redact import redact_json

KINDS = ("check", "allreduce-bench", "diagnose", "explain", "doctor")
MAX_BARS = 3000  # timeline bars drawn (the latest, and every stuck one): the page stays a few MB
MAX_ROWS = 64  # rows of the timeline and ranks of the step chart; a bigger job shows the ones that matter
MAX_LIST = 60  # items of an evidence list shown; the JSON has them all
MAX_TEXT = 4000  # characters of one evidence string
NO_PLOTLY = "Charts need plotly: pip install 'ddpdoctor[html]'"

EXIT_MEANINGS = {
    EXIT_OK: "OK: no warning or critical finding",
    EXIT_WARNING: "WARNING: the worst finding is a warning",
    EXIT_CRITICAL: "CRITICAL: the worst finding is critical",
    EXIT_UNKNOWN: "UNKNOWN: no verdict could be reached",
    INJECTED_CRASH_EXIT: "a rank crashed on purpose (--inject crash)",
    REQUEUE_NO_RETRY_EXIT: "requeue: do not retry",
    REQUEUE_UNKNOWN_EXIT: "requeue: unknown whether a retry helps",
    PEER_HUNG_EXIT: "a step hung and this rank only waited for the rank named as its cause",
    STAGE_TIMEOUT_EXIT: "a stage deadline fired",
    ORPHANED_EXIT: "a rank outlived its launcher or lost the out-of-band store",
    REQUEUE_RETRY_EXIT: "requeue: retry",
}
SEVERITY_COLOURS = {"critical": "#c62828", "warn": "#ef6c00", "info": "#1565c0", "ok": "#2e7d32"}
# Timeline bars by kind (the event's `cat`, or its name for a step's phases): (legend label, colour).
BAR_CLASSES = {
    "probe": ("probe", "#c6dbef"), "stage": ("stage", "#4c78a8"), "step": ("step", "#d9d9d9"),
    "data": ("data", "#f58518"), "compute": ("compute", "#54a24b"), "wait": ("wait for peers", "#eeca3b"),
    "collective": ("collective", "#b279a2"), "check": ("ddpdoctor's check", "#8c6d31"), "other": ("other", "#72b7b2"),
    "stuck": ("hang / stuck", "#d62728"),
}
STUCK_INSIDE = "#8c1515"  # a stuck span inside another stuck one: darker, so the two stay apart
BAR_FAILED = "#d62728"
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
        "font-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")


def e(value: Any) -> str:
    """Escaped for HTML text and attribute values: every string of the data passes here."""
    return html.escape(str(value), quote=True)


def _map(value: Any) -> Mapping[str, Any]:
    """`value` where it is a mapping, else an empty one: the data is JSON read back, of any shape."""
    return value if isinstance(value, Mapping) else {}


def _t(value: Any) -> str:
    """Escaped for a plotly label: plotly reads a few tags (<b>, <br>, <a>) and the entities &amp;, &lt;, &gt;
    and numeric ones, but not &quot; (shown as is): so only &, < and > are escaped."""
    return html.escape(str(value), quote=False)


# -- the public API -----------------------------------------------------------------------------------

def page(kind: str, data: Mapping[str, Any], timeline: Optional[Mapping[str, Any]] = None, *,
         reports: Sequence[Mapping[str, Any]] = ()) -> str:
    """The page of one output of ddpdoctor, as text.

    `kind`: "check" or "allreduce-bench" (`Report.to_json()`), "diagnose" (`Diagnosis.to_json()`), "explain"
    (the explanation's `to_json()`) or "doctor" (the callback's JSON: findings and `summary`). `timeline`: a
    Chrome trace-event document; for a check report left None, it is drawn from the report (trace_check.py).
    `reports`: `check --json` reports a diagnosis read, whose probes' facts the charts are drawn from."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    data = redact_json(dict(data))
    reports = [redact_json(dict(r)) for r in reports if isinstance(r, Mapping)]
    if timeline is None:
        timeline = _timeline_of(kind, data, reports)
    timeline = redact_json(timeline) if timeline is not None else None
    go = _plotly()
    charts = _charts(data, reports, timeline, go)
    verdict = _verdict(kind, data)
    body = [
        '<div id="js-errors"></div>',
        _header(kind, data, verdict),
        _findings_section(data),
        _charts_section(charts, go is not None),
        _timeline_section(charts, kind, data, go is not None),
        _footer(data),
    ]
    head = [f'<meta charset="utf-8"><meta http-equiv="Content-Security-Policy" content="{e(_CSP)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{e('ddpdoctor ' + kind + ': ' + verdict.line)}</title>", f"<style>{_CSS}</style>", _ERROR_CATCHER]
    if go is not None and any(c.figure is not None for c in charts):
        head.append(_plotly_library())
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n" + "\n".join(head) + "\n</head>\n<body>\n"
            + "\n".join(part for part in body if part) + "\n</body>\n</html>\n")


def write(path: str, kind: str, data: Mapping[str, Any], timeline: Optional[Mapping[str, Any]] = None, *,
          reports: Sequence[Mapping[str, Any]] = (), overwrite: bool = True) -> str:
    """The page, written atomically (a browser never opens half a page); where it went (a sibling name when
    `overwrite` is False and the path appeared meanwhile, as core/files.py does for every output)."""
    return atomic_write_text(page(kind, data, timeline, reports=reports), path, overwrite=overwrite)


def read_timeline(path: Optional[str]) -> Optional[dict[str, Any]]:
    """A trace-event file (the Doctor's `trace_path`), or None where there is none or it cannot be read: the
    page is drawn without its timeline rather than not at all."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(loaded, list):
        return {"traceEvents": loaded}
    return loaded if isinstance(loaded, dict) else None


# -- the verdict --------------------------------------------------------------------------------------

@dataclass
class Verdict:
    """What the page says first: the report's first line, its severity and what its exit code means."""

    line: str
    severity: str
    exit_code: Optional[int]
    meaning: str
    extra: list[str] = field(default_factory=list)


def _findings(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [f for f in data.get("findings") or [] if isinstance(f, Mapping)]


def _ordered(findings: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The display order of the console (judge/causal_order.py: each root cause, worst first, then what it
    explains), with each finding's `explained_by`; as given where a finding cannot be read back."""
    from ddpdoctor.core.findings import Finding
    from ddpdoctor.judge.causal_order import ordered

    try:
        typed = [Finding.from_json(dict(f)) for f in findings]
        shown = ordered(typed)
    except (KeyError, ValueError, TypeError):
        return findings
    out: list[Mapping[str, Any]] = []
    used: set[int] = set()
    for t in shown:  # link() may hand back copies: each matched to its own JSON by what identifies it
        i = next((i for i, u in enumerate(typed) if i not in used
                  and (u.code, u.title, u.ranks, u.probe) == (t.code, t.title, t.ranks, t.probe)), None)
        if i is None:
            return findings
        used.add(i)
        out.append({**findings[i], "explained_by": t.explained_by or findings[i].get("explained_by") or ""})
    return out


def _computed_line(findings: list[Mapping[str, Any]]) -> str:
    from ddpdoctor.core.findings import Finding
    from ddpdoctor.judge.causal_order import verdict_line

    try:
        return verdict_line([Finding.from_json(dict(f)) for f in findings])
    except (KeyError, ValueError, TypeError):
        bad = [f for f in findings if f.get("severity") in ("warn", "critical")]
        return f"{bad[0].get('code')}: {bad[0].get('title')}" if bad else "no warning or critical finding"


def _verdict(kind: str, data: Mapping[str, Any]) -> Verdict:
    findings = _findings(data)
    if kind == "doctor":
        summary = _map(data.get("summary"))
        line = str(summary.get("verdict") or _computed_line(findings))
        worst = summary.get("severity") or _worst(findings)
        return Verdict(line, str(worst), None, "no exit code: the callback leaves the job's own")
    line = str(data.get("verdict_line") or _computed_line(findings))
    code = data.get("exit_code")
    code = code if isinstance(code, int) else None
    verdict = Verdict(line, str(data.get("verdict") or data.get("worst_severity") or _worst(findings)), code,
                      EXIT_MEANINGS.get(code, "") if code is not None else "")
    requeue = data.get("requeue")
    if kind == "explain" and isinstance(requeue, Mapping):
        verdict.extra.append(f"requeue: {requeue.get('verdict')} ({requeue.get('reason')}); "
                             f"with --exit-code requeue the exit code is {requeue.get('exit_code')}")
    return verdict


def _worst(findings: Iterable[Mapping[str, Any]]) -> str:
    order = ["ok", "info", "warn", "critical"]
    seen = [str(f.get("severity")) for f in findings if f.get("severity") in order]
    return max(seen, key=order.index) if seen else "ok"


def _header(kind: str, data: Mapping[str, Any], verdict: Verdict) -> str:
    colour = SEVERITY_COLOURS.get(verdict.severity, SEVERITY_COLOURS.get(_severity_word(verdict.severity), "#555"))
    exit_line = (f'<p class="exit">exit code <b>{e(verdict.exit_code)}</b>: {e(verdict.meaning)}</p>'
                 if verdict.exit_code is not None else f'<p class="exit">{e(verdict.meaning)}</p>')
    extra = "".join(f'<p class="exit">{e(x)}</p>' for x in verdict.extra)
    facts = "".join(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in _run_facts(kind, data) if v not in (None, "", []))
    return (f'<header><h1>ddpdoctor {e(kind)}</h1>\n<section id="verdict" class="verdict" style="border-color:{colour}">'
            f'<h2>Verdict <span class="sev" style="background:{colour}">{e(verdict.severity)}</span></h2>'
            f'<p class="line">{e(verdict.line)}</p>{exit_line}{extra}</section>\n'
            f'<ul class="run">{facts}</ul></header>')


def _severity_word(verdict: str) -> str:
    return {"warning": "warn", "error": "critical", "unknown": "info"}.get(verdict, verdict)


def _run_facts(kind: str, data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The few lines that say which run this is."""
    command = data.get("command")
    facts: list[tuple[str, Any]] = [("command", " ".join(map(str, command)) if isinstance(command, list) else command)]
    if kind == "doctor":
        summary = _map(data.get("summary"))
        lost = summary.get("lost_to_slowest") if isinstance(summary.get("lost_to_slowest"), Mapping) else None
        facts += [("ranks", data.get("world_size")), ("steps", data.get("steps")), ("wall time (s)", summary.get("wall_s")),
                  ("median step (ms)", summary.get("step_ms_median")), ("samples/s", summary.get("samples_per_s")),
                  ("lost to the slowest rank", None if not lost else
                   f"rank {lost.get('rank')}: {lost.get('ms_per_step')} ms a step ({lost.get('share_pct')}%)")]
        return facts
    inputs = data.get("inputs")
    if isinstance(inputs, Mapping):
        inputs = ", ".join(map(str, inputs.get("logs") or [])) + (
            f" ({inputs.get('lines')} lines)" if inputs.get("lines") is not None else "")
    elif isinstance(inputs, list):
        inputs = ", ".join(map(str, inputs))
    nodes = data.get("nodes")
    node_names = [str(n.get("node")) if isinstance(n, Mapping) else str(n) for n in nodes] if isinstance(nodes, list) else []
    facts += [("inputs", inputs), ("created", data.get("created")), ("ranks", data.get("world_size")),
              ("nodes", ", ".join(node_names[:20]) + (f" (+{len(node_names) - 20})" if len(node_names) > 20 else "")),
              ("backend", data.get("backend")), ("device", data.get("device")),
              ("duration (s)", data.get("duration_s")), ("ddpdoctor", data.get("ddpdoctor_version"))]
    return facts


# -- the findings -------------------------------------------------------------------------------------

def _findings_section(data: Mapping[str, Any]) -> str:
    from ddpdoctor.core.findings import rank_ranges

    findings = _ordered(_findings(data))
    if not findings:
        return '<section id="findings"><h2>Findings</h2><p>No findings.</p></section>'
    cards = []
    for f in findings:
        severity = str(f.get("severity") or "")
        colour = SEVERITY_COLOURS.get(severity, "#555")
        ranks = [r for r in f.get("ranks") or [] if isinstance(r, int)]
        nodes = [str(n) for n in f.get("nodes") or []]
        meta = []
        if ranks:
            meta.append(f"ranks {e(rank_ranges(ranks))}" if len(ranks) > 1 else f"rank {ranks[0]}")
        if nodes:
            meta.append("nodes " + e(", ".join(nodes[:20])) + (f" (+{len(nodes) - 20})" if len(nodes) > 20 else ""))
        if f.get("probe"):
            meta.append(f"probe {e(f.get('probe'))}")
        if f.get("explained_by"):
            meta.append(f"explained by {e(f.get('explained_by'))}")
        parts = [f'<summary><span class="sev" style="background:{colour}">{e(severity)}</span> '
                 f'<code class="code">{e(f.get("code"))}</code> {e(f.get("title"))}</summary>',
                 f'<p class="meta">{" · ".join(meta)}</p>' if meta else ""]
        if f.get("why"):
            parts.append(f'<p><b>Why:</b> {e(f.get("why"))}</p>')
        if f.get("fix"):
            parts.append(f'<p class="fix"><b>Fix:</b> {e(f.get("fix"))}</p>')
        if f.get("evidence"):
            parts.append(f'<div class="evidence"><b>Evidence</b>{_value_html(f.get("evidence"))}</div>')
        shown = " open" if severity in ("warn", "critical") else ""
        nested = " explained" if f.get("explained_by") else ""
        cards.append(f'<details class="finding{nested}" data-code="{e(f.get("code"))}" '
                     f'style="border-left-color:{colour}"{shown}>{"".join(parts)}</details>')
    return f'<section id="findings"><h2>Findings ({len(findings)})</h2>\n' + "\n".join(cards) + "</section>"


def _scalar(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return e(json.dumps(value))
    if isinstance(value, float):
        return e(format(value, ".6g")) if math.isfinite(value) else "n/a"
    text = str(value)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"… ({len(text) - MAX_TEXT} more characters in the JSON)"
    return f"<pre>{e(text)}</pre>" if "\n" in text else e(text)


def _value_html(value: Any, depth: int = 0) -> str:
    """A JSON value as HTML a person reads: a mapping as a two-column table, a list of records as a table, a
    stack (a list of lines) as preformatted text; deep or long values cut, said so."""
    if depth > 6:
        return f"<code>{e(json.dumps(value, default=str)[:200])}</code>"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        rows = "".join(f"<tr><th>{e(k)}</th><td>{_value_html(v, depth + 1)}</td></tr>"
                       for k, v in list(value.items())[:MAX_LIST])
        more = f'<tr><td colspan="2">… {len(value) - MAX_LIST} more in the JSON</td></tr>' if len(value) > MAX_LIST else ""
        return f'<table class="ev">{rows}{more}</table>'
    if isinstance(value, (list, tuple)):
        items = list(value)
        more = f"<p>… {len(items) - MAX_LIST} more in the JSON</p>" if len(items) > MAX_LIST else ""
        items = items[:MAX_LIST]
        if not items:
            return "[]"
        if all(isinstance(x, str) for x in items) and (len(items) > 4 or any("\n" in x for x in items)):
            return f"<pre>{e(chr(10).join(items))}</pre>{more}"
        if all(isinstance(x, Mapping) for x in items):
            columns = list(dict.fromkeys(k for x in items for k in x))[:12]
            head = "".join(f"<th>{e(c)}</th>" for c in columns)
            rows = "".join("<tr>" + "".join(f"<td>{_value_html(x.get(c, ''), depth + 1)}</td>" for c in columns) + "</tr>"
                           for x in items)
            return f'<table class="ev grid"><tr>{head}</tr>{rows}</table>{more}'
        if all(not isinstance(x, (Mapping, list, tuple)) for x in items):
            return ", ".join(_scalar(x) for x in items) + more
        return "<ol>" + "".join(f"<li>{_value_html(x, depth + 1)}</li>" for x in items) + f"</ol>{more}"
    return _scalar(value)


# -- the charts ---------------------------------------------------------------------------------------

@dataclass
class Chart:
    """One chart: its plotly figure (None: not drawn, `note` says why) and its figures as a table."""

    key: str
    title: str
    figure: Any = None
    height: int = 420
    note: str = ""  # what was left out, and why: shown as a warning
    about: str = ""  # how to read it (the producer's clock and what it kept): shown plain
    table: str = ""
    bars: int = 0  # the timeline's bars drawn, for the page's readers and the browser test


def _plotly() -> Any:
    """plotly.graph_objects, or None: plotly is an optional extra (`pip install ddpdoctor[html]`)."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    return go


def _plotly_library() -> str:
    """plotly.js once for the whole page, inline (the pip package carries it: nothing is fetched)."""
    from plotly.offline import get_plotlyjs

    return ("<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
            f"<script>{get_plotlyjs()}</script>")


def _probe_facts(sources: Iterable[Mapping[str, Any]], name: str) -> tuple[dict[str, Any], Optional[Mapping[str, Any]]]:
    """The first source's facts of probe `name` (rank -> facts), and the source they came from."""
    for source in sources:
        for probe in source.get("probes") or []:
            if isinstance(probe, Mapping) and probe.get("name") == name and isinstance(probe.get("facts"), Mapping) \
                    and probe["facts"]:
                return dict(probe["facts"]), source
    return {}, None


def _charts(data: Mapping[str, Any], reports: Sequence[Mapping[str, Any]],
            timeline: Optional[Mapping[str, Any]], go: Any) -> list[Chart]:
    """Each chart its data allows. A chart is an extra: one that fails says so and the page is written all the
    same (the findings are what the reader came for)."""
    sources = [data, *reports]
    builders = [("busbw", lambda: _busbw_chart(sources, data, go)), ("steps", lambda: _steps_chart(sources, data, go))]
    if timeline is not None:
        builders.append(("timeline", lambda: _timeline_chart(timeline, go)))
    charts = []
    for key, build in builders:
        try:
            chart = build()
        except Exception as exc:  # a malformed document or a plotly version we never met
            chart = Chart(key, f"{key} chart", note=f"not drawn: {type(exc).__name__}: {exc}")
        if chart is not None:
            charts.append(chart)
    return charts


def _layout(go: Any, height: int, **more: Any) -> Any:
    """The charts' common frame; the title is the page's own heading above it, the legend on top."""
    return go.Layout(height=height, template="plotly_white", margin={"l": 60, "r": 20, "t": 36, "b": 50},
                     legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom", "traceorder": "normal"},
                     **more)


def _expected_busbw(sources: Iterable[Mapping[str, Any]]) -> Optional[float]:
    """What the topology or the GPUs' model allows (GB/s), as the allreduce verdict's evidence says: the
    figure the verdict was judged by, not worked out again."""
    for source in sources:
        for f in _findings(source):
            value = (f.get("evidence") or {}).get("expected_busbw_gbps") if f.get("probe") == "allreduce" else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return float(value)
    return None


def _busbw_chart(sources: Sequence[Mapping[str, Any]], data: Mapping[str, Any], go: Any) -> Optional[Chart]:
    """busbw (GB/s) against message size, log x, one line per placement, the expected busbw dashed. The sums are
    the bench's own (probes/allreduce: merge_results, judge/busbw.py): slowest rank per iteration, median."""
    from ddpdoctor.judge.busbw import format_size, series
    from ddpdoctor.probes.allreduce.probe import merge_results

    facts, source = _probe_facts(sources, "allreduce")
    if not facts or source is None:
        return None
    try:
        results = merge_results(facts)
    except (KeyError, ValueError, TypeError, IndexError):
        return Chart("busbw", "all-reduce bandwidth", note="the allreduce facts could not be read")
    if not results:
        return None
    first = results[0]
    title = f"{first.op} busbw (GB/s) by message size, {first.world_size} ranks, {first.dtype}"
    table = _table(["size", "placement", "median time (µs)", "algbw (GB/s)", "busbw (GB/s)", "wrong"],
                   [[format_size(r.size_bytes), "in-place" if r.in_place else "out-of-place", f"{r.median_s * 1e6:.1f}",
                     f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}", "" if r.wrong is None else r.wrong] for r in results])
    chart = Chart("busbw", title, table=table)
    if first.world_size < 2:
        chart.note = ("not drawn: on 1 rank busbw is 0 by definition (nothing crosses a link); "
                      "the figures are below")
        return chart
    if go is None:
        return chart
    expected = _expected_busbw([data, source])
    figure = go.Figure(layout=_layout(go, 440))
    curves = series(results)
    for (_, in_place), group in curves.items():
        name = "job" if len(curves) == 1 else ("in-place" if in_place else "out-of-place")
        figure.add_trace(go.Scatter(
            x=[r.size_bytes for r in group], y=[r.busbw_gbps for r in group], mode="lines+markers", name=_t(name),
            hovertext=[_t(f"{format_size(r.size_bytes)}: busbw {r.busbw_gbps:.3f} GB/s, algbw {r.algbw_gbps:.3f} GB/s, "
                         f"median {r.median_s * 1e6:.1f} µs") for r in group],
            hovertemplate="%{hovertext}<extra></extra>"))
    sizes = sorted({r.size_bytes for r in results})
    if expected:
        figure.add_trace(go.Scatter(x=[sizes[0], sizes[-1]], y=[expected, expected], mode="lines",
                                    name=_t(f"expected {expected:.3g} GB/s"), line={"dash": "dash", "color": "#444"},
                                    hoverinfo="name"))
    ticks = [2 ** k for k in range(int(math.log2(sizes[0])), int(math.log2(sizes[-1])) + 1)]
    stride = max(1, math.ceil(len(ticks) / 10))
    ticks = ticks[::stride]
    figure.update_xaxes(type="log", title_text="message size (log scale)", tickvals=ticks,
                        ticktext=[format_size(t) for t in ticks])
    figure.update_yaxes(title_text="busbw (GB/s)", rangemode="tozero")
    chart.figure, chart.height = figure, 440
    return chart


@dataclass
class _RankSteps:
    rank: int
    node: str
    data_ms: float
    compute_ms: float
    wait_ms: float
    step_ms: float


def _median(values: Sequence[Any]) -> Optional[float]:
    from ddpdoctor.core.medians import median

    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return median(finite) if finite else None


def _steps_from_facts(facts: Mapping[str, Any]) -> list[_RankSteps]:
    """Each rank's median data, compute (forward, backward and optimizer of a step) and wait, in ms."""
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
            out.append(_RankSteps(int(key), str(fact.get("host") or ""), data, work, wait, step))
    return sorted(out, key=lambda r: r.rank)


def _steps_from_summary(summary: Mapping[str, Any]) -> list[_RankSteps]:
    """The callback's summary rows: each rank's median step cut by its data, compute and wait shares."""
    out = []
    for row in summary.get("ranks") or []:
        if not isinstance(row, Mapping) or not row.get("arrived", True):
            continue
        values = [row.get(k) for k in ("step_ms_median", "data_pct", "compute_pct", "wait_pct")]
        if not all(isinstance(v, (int, float)) for v in values):
            continue
        step, data, work, wait = (float(v or 0.0) for v in values)
        out.append(_RankSteps(int(row.get("rank") or 0), str(row.get("node") or ""), step * data / 100,
                              step * work / 100, step * wait / 100, step))
    return sorted(out, key=lambda r: r.rank)


def _steps_chart(sources: Sequence[Mapping[str, Any]], data: Mapping[str, Any], go: Any) -> Optional[Chart]:
    """Each rank's step as a stacked horizontal bar: data, compute, waiting for peers. A straggler's compute
    stands out, and so does the wait its peers spend on it."""
    facts, _ = _probe_facts(sources, "stragglers")
    rows = _steps_from_facts(facts) if facts else []
    origin = "the stragglers probe's steps, median of each phase"
    summary = data.get("summary")
    if not rows and isinstance(summary, Mapping):
        rows, origin = _steps_from_summary(summary), "the end-of-run summary: median step cut by each phase's share"
    if not rows:
        return None
    title = f"step time by rank (ms): {origin}"
    table = _table(["rank", "node", "data (ms)", "compute (ms)", "wait for peers (ms)", "median step (ms)"],
                   [[r.rank, r.node, f"{r.data_ms:.3f}", f"{r.compute_ms:.3f}", f"{r.wait_ms:.3f}", f"{r.step_ms:.3f}"]
                    for r in rows])
    chart = Chart("steps", title, table=table)
    shown = rows
    if len(rows) > MAX_ROWS:
        shown = sorted(sorted(rows, key=lambda r: -(r.data_ms + r.compute_ms))[:MAX_ROWS], key=lambda r: r.rank)
        chart.note = (f"{MAX_ROWS} of {len(rows)} ranks drawn: those with the longest data + compute; "
                      "every rank is in the table")
    if go is None:
        return chart
    nodes = len({r.node for r in rows}) > 1
    labels = [f"rank {r.rank}" + (f" ({r.node})" if nodes else "") for r in shown]
    height = 110 + 28 * len(shown)
    figure = go.Figure(layout=_layout(go, height, barmode="stack"))
    for name, key, colour in (("data", "data_ms", BAR_CLASSES["data"][1]), ("compute", "compute_ms", BAR_CLASSES["compute"][1]),
                              ("wait for peers", "wait_ms", BAR_CLASSES["wait"][1])):
        values = [getattr(r, key) for r in shown]
        figure.add_trace(go.Bar(y=[_t(x) for x in labels], x=values, orientation="h", name=_t(name), marker_color=colour,
                                hovertext=[_t(f"{label}: {name} {v:.3f} ms") for label, v in zip(labels, values)],
                                hovertemplate="%{hovertext}<extra></extra>"))
    figure.update_yaxes(autorange="reversed", type="category")
    figure.update_xaxes(title_text="ms per step (median)", rangemode="tozero")
    chart.figure, chart.height = figure, height
    return chart


# -- the timeline -------------------------------------------------------------------------------------

def _timeline_of(kind: str, data: Mapping[str, Any], reports: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """A check report's own timeline (render/trace_check.py), or the one check report a diagnosis read."""
    from ddpdoctor.render.trace_check import from_report

    report = data if kind in ("check", "allreduce-bench") else (reports[0] if len(reports) == 1 else None)
    if report is None or not isinstance(report.get("ranks"), list) or "started_at" not in report:
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
    return "<br>".join(_t(line) for line in lines)


def _timeline_chart(timeline: Mapping[str, Any], go: Any) -> Chart:
    """The trace-event document as a Gantt chart: one row per thread (a rank, a rank's steps), a bar per complete
    event coloured by kind, a diamond per finding; the latest MAX_BARS bars and every stuck one."""
    events = _events(timeline)
    labels, rows = _rows(events)
    bars = [_Bar((int(x.get("pid") or 0), int(x.get("tid") or 0)), str(x.get("name") or ""), _bar_class(x),
                 float(x.get("ts") or 0) / 1e6, max(0.0, float(x.get("dur") or 0)) / 1e6,
                 _map(x.get("args")))
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
    other = _map(timeline.get("otherData"))
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
    figure = go.Figure(layout=_layout(go, height, barmode="overlay", bargap=0.2))
    row_labels = {r: _t(labels[r]) for r in rows}
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
                name=_t(legend), legendgroup=cls, showlegend=cls not in shown_classes,
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
            y=[p[0] for p in points], x=[p[1] for p in points], mode="markers", name=_t(f"finding ({severity})"),
            marker={"symbol": "diamond", "size": 11, "color": SEVERITY_COLOURS.get(severity, "#555"),
                    "line": {"width": 1, "color": "#fff"}},
            hovertext=[_t(p[2]) for p in points], hovertemplate="%{hovertext}<extra></extra>"))


def _stuck_list(stuck: list[_Bar], labels: Mapping[tuple[int, int], str]) -> str:
    """The spans still open when the run ended, in words: the picture of a hang, readable without a chart."""
    if not stuck:
        return ""
    items = "".join(f"<li><b>{e(labels.get(b.row, b.row))}</b>: {e(b.name)} from {b.start_s:.3f} s, "
                    f"{b.dur_s:.3f} s open{(' · ' + e(b.args.get('finding'))) if b.args.get('finding') else ''}</li>"
                    for b in stuck[:MAX_LIST])
    return f'<div class="stuck"><b>Still running when the run ended</b><ul>{items}</ul></div>'


# -- the page's sections ------------------------------------------------------------------------------

def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{'' if v is None else e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return (f'<details class="figures"><summary>the figures</summary>'
            f'<table class="ev grid"><tr>{head}</tr>{body}</table></details>')


def _figure_html(chart: Chart) -> str:
    config = {"displaylogo": False, "responsive": True,
              "modeBarButtonsToRemove": ["sendDataToCloud"], "toImageButtonOptions": {"filename": f"ddpdoctor-{chart.key}"}}
    div: str = chart.figure.to_html(include_plotlyjs=False, full_html=False, div_id=f"chart-{chart.key}", config=config,
                                    default_width="100%", default_height=f"{chart.height}px")
    return div


def _chart_block(chart: Chart) -> str:
    parts = [f'<div class="chart" id="block-{e(chart.key)}" data-bars="{chart.bars}">', f"<h3>{e(chart.title)}</h3>"]
    if chart.note:
        parts.append(f'<p class="note">{e(chart.note)}</p>')
    if chart.about:
        parts.append(f'<p class="about">{e(chart.about)}</p>')
    if chart.figure is not None:
        parts.append(_figure_html(chart))
    # A chart not drawn leaves its figures in sight: the table opens where the picture would have been.
    parts.append(chart.table if chart.figure is not None
                 else chart.table.replace('<details class="figures">', '<details class="figures" open>', 1))
    parts.append("</div>")
    return "\n".join(p for p in parts if p)


def _charts_section(charts: list[Chart], have_plotly: bool) -> str:
    drawn = [c for c in charts if c.key != "timeline"]
    missing = "" if have_plotly else f'<p class="note" id="no-plotly">{e(NO_PLOTLY)}</p>'
    if not drawn:
        return (f'<section id="charts"><h2>Charts</h2>{missing}'
                "<p>No chart: this output measured no bandwidth or steps.</p></section>")
    return f'<section id="charts"><h2>Charts</h2>{missing}\n' + "\n".join(_chart_block(c) for c in drawn) + "</section>"


def _timeline_section(charts: list[Chart], kind: str, data: Mapping[str, Any], have_plotly: bool) -> str:
    chart = next((c for c in charts if c.key == "timeline"), None)
    if chart is not None:
        return f'<section id="timeline"><h2>Timeline</h2>\n{_chart_block(chart)}</section>'
    if kind == "explain" and isinstance(data.get("timeline"), list):
        events = [x for x in data["timeline"] if isinstance(x, Mapping)]
        rows = [[x.get("where"), x.get("role"), x.get("signature"), x.get("rank"), x.get("host"), x.get("count"), x.get("label")]
                for x in events[:200]]
        more = f"<p>… {len(events) - 200} more in the JSON</p>" if len(events) > 200 else ""
        table = _table(["where", "role", "signature", "rank", "host", "count", "what"], rows).replace(
            '<details class="figures">', '<details class="figures" open>', 1)
        return f'<section id="timeline"><h2>Timeline: the logs\' events in order</h2>{table}{more}</section>'
    return ('<section id="timeline"><h2>Timeline</h2><p>No timeline: give the run\'s trace file '
            "(check --trace, Doctor(trace_path=...)).</p></section>")


def _footer(data: Mapping[str, Any]) -> str:
    version = data.get("ddpdoctor_version") or ""
    return (f"<footer>ddpdoctor {e(version)} · one self-contained page: no request leaves it, "
            "secrets redacted as in the JSON</footer>")


# Before any other script (plotly.js included): a JS error or a request the CSP blocked is written into the page,
# where a reader and the browser test see it; what happens before the body exists is kept until it does.
_ERROR_CATCHER = """<script>
(function () {
  var pending = [];
  function put(text) {
    var box = document.getElementById("js-errors");
    if (!box) { return false; }
    var line = document.createElement("div"); line.textContent = text; box.appendChild(line); return true;
  }
  function say(text) { if (!put(text)) { pending.push(text); } }
  document.addEventListener("DOMContentLoaded", function () { pending.splice(0).forEach(say); });
  window.onerror = function (message, source, line) { say("error: " + message + " (line " + line + ")"); };
  window.addEventListener("unhandledrejection", function (ev) { say("unhandled rejection: " + ev.reason); });
  document.addEventListener("securitypolicyviolation", function (ev) { say("blocked: " + ev.blockedURI); });
})();
</script>"""

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #222;
       max-width: 1240px; margin: 0 auto; padding: 12px 20px 40px; }
h1 { font-size: 20px; margin: 8px 0; } h2 { font-size: 17px; margin: 24px 0 8px; } h3 { font-size: 15px; }
#js-errors { color: #b00020; font-family: monospace; } #js-errors:empty { display: none; }
.verdict { border: 2px solid; border-radius: 6px; padding: 6px 14px; margin: 8px 0; }
.verdict h2 { margin: 6px 0; } .verdict .line { font-size: 16px; font-weight: 600; margin: 6px 0; }
.exit { margin: 4px 0; color: #333; }
.sev { color: #fff; border-radius: 4px; padding: 1px 7px; font-size: 12px; text-transform: uppercase; vertical-align: 1px; }
ul.run { list-style: none; padding: 0; margin: 6px 0; color: #444; display: flex; flex-wrap: wrap; gap: 4px 18px; }
.finding { border: 1px solid #ddd; border-left: 5px solid; border-radius: 4px; padding: 4px 10px; margin: 6px 0; }
.finding.explained { margin-left: 28px; } .finding summary { cursor: pointer; font-weight: 600; }
.code { font-size: 13px; } .meta { color: #555; margin: 4px 0; } .fix { background: #f3f8f3; padding: 4px 6px; }
table.ev { border-collapse: collapse; margin: 4px 0; font-size: 13px; }
table.ev th, table.ev td { border: 1px solid #e0e0e0; padding: 2px 6px; text-align: left; vertical-align: top; }
table.ev th { background: #f6f6f6; font-weight: 600; }
pre { margin: 2px 0; white-space: pre-wrap; word-break: break-all; font-size: 12px; max-height: 320px; overflow: auto; }
.note { color: #6a4f00; background: #fff8e1; padding: 4px 8px; border-radius: 4px; }
.about { color: #555; font-size: 13px; margin: 2px 0; }
.chart { margin: 10px 0 22px; } .stuck { background: #fdecea; padding: 4px 10px; border-radius: 4px; }
footer { margin-top: 30px; color: #777; font-size: 12px; }
"""
