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

This module lays the page out (the verdict, the findings, the sections, the style); the charts are
render/html_charts.py's, the timeline render/html_timeline.py's, what all three share render/html_parts.py's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from ddpdoctor.core.exits import (
    EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, INJECTED_CRASH_EXIT, ORPHANED_EXIT, PEER_HUNG_EXIT,
    REQUEUE_NO_RETRY_EXIT, REQUEUE_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT, STAGE_TIMEOUT_EXIT)
from ddpdoctor.core.files import atomic_write_text
from ddpdoctor.core.redact import redact_json
from ddpdoctor.render.html_charts import charts as made_charts
from ddpdoctor.render.html_parts import MAX_LIST, SEVERITY_COLOURS, Chart, as_map, e, figures_table, findings_of
from ddpdoctor.render.html_timeline import timeline_of

KINDS = ("check", "allreduce-bench", "diagnose", "explain", "doctor")
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
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
        "font-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")


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
        timeline = timeline_of(kind, data, reports)
    timeline = redact_json(timeline) if timeline is not None else None
    go = _plotly()
    charts = made_charts(data, reports, timeline, go)
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
    findings = findings_of(data)
    if kind == "doctor":
        summary = as_map(data.get("summary"))
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
        summary = as_map(data.get("summary"))
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

    findings = _ordered(findings_of(data))
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


# -- the page's sections ------------------------------------------------------------------------------

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
        table = figures_table(["where", "role", "signature", "rank", "host", "count", "what"], rows).replace(
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
