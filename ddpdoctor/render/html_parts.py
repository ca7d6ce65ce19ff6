"""What the report page's modules share (render/html_report.py, html_charts.py, html_timeline.py): escaping,
the charts' record and frame, the caps and the colours. One place, so the page, its charts and its timeline
escape alike and draw in one palette."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MAX_BARS = 3000  # timeline bars drawn (the latest, and every stuck one): the page stays a few MB
MAX_ROWS = 64  # rows of the timeline and ranks of the step chart; a bigger job shows the ones that matter
MAX_LIST = 60  # items of an evidence list shown; the JSON has them all
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


def e(value: Any) -> str:
    """Escaped for HTML text and attribute values: every string of the data passes here."""
    return html.escape(str(value), quote=True)


def as_map(value: Any) -> Mapping[str, Any]:
    """`value` where it is a mapping, else an empty one: the data is JSON read back, of any shape."""
    return value if isinstance(value, Mapping) else {}


def plot_text(value: Any) -> str:
    """Escaped for a plotly label: plotly reads a few tags (<b>, <br>, <a>) and the entities &amp;, &lt;, &gt;
    and numeric ones, but not &quot; (shown as is): so only &, < and > are escaped."""
    return html.escape(str(value), quote=False)


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


def layout(go: Any, height: int, **more: Any) -> Any:
    """The charts' common frame; the title is the page's own heading above it, the legend on top."""
    return go.Layout(height=height, template="plotly_white", margin={"l": 60, "r": 20, "t": 36, "b": 50},
                     legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom", "traceorder": "normal"},
                     **more)


def figures_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{'' if v is None else e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return (f'<details class="figures"><summary>the figures</summary>'
            f'<table class="ev grid"><tr>{head}</tr>{body}</table></details>')


def findings_of(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The findings of a report, a diagnosis, an explanation or the Doctor's JSON, as read back."""
    return [f for f in data.get("findings") or [] if isinstance(f, Mapping)]
