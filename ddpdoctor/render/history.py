"""`ddpdoctor history` in the terminal (a row per node, then the verdicts) and as a plot.

The table answers the weekly question, which nodes to look at: runs, the latest measured speed
against the fleet's median of the same model, the trend of that ratio, critical runs, verdicts;
under a node, a row for each of its GPUs with a verdict of its own (one slow GPU of 8), so a
fleet of 8-GPU nodes is not 8 times as long to read.
The plot (matplotlib, an optional extra) shows each node's ratio to the fleet over time.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.files import atomic_write_bytes
from ddpdoctor.core.findings import Severity
from ddpdoctor.history.verdicts import GpuSummary, NodeSummary, Verdicts
from ddpdoctor.render.charts import history_chart
from ddpdoctor.render.charts import show as show_chart
from ddpdoctor.render.console import _STYLE, render_findings

_VERDICT = {0: "OK", 1: "WARNING", 2: "CRITICAL"}


def _speed(summary: NodeSummary | GpuSummary) -> str:
    latest = summary.latest
    if latest is None:
        return "-"
    if latest.fleet is None:
        return f"{latest.value / 1e9:.3g} GFLOP/s"
    return f"{latest.value / 1e9:.3g} GFLOP/s ({100 * (latest.value / latest.fleet - 1):+.0f}% vs fleet)"


def _trend(summary: NodeSummary | GpuSummary) -> str:
    return "-" if summary.trend_pct is None else f"{summary.trend_pct:+.0f}%"


def render_history(verdicts: Verdicts, console: Console, charts: bool = True) -> None:
    """The nodes' table, worst first, the named nodes' speed over their runs (on a terminal, unless `charts`
    is False: render/charts.py), then every verdict with its evidence and fix."""
    worst = max((f.severity for f in verdicts.findings), default=Severity.OK)
    head = Text()
    head.append("ddpdoctor history  ", style="bold")
    head.append(_VERDICT[verdicts.exit_code], style=_STYLE[worst])
    head.append(f"  {verdicts.runs} runs, {len(verdicts.summaries)} nodes")
    console.print(head)
    table = Table(show_header=True, header_style="bold", expand=False, box=None, pad_edge=False)
    for col in ("node", "model", "runs", "latest speed", "trend", "critical runs", "verdict"):
        table.add_column(col, overflow="fold")
    for s in verdicts.summaries:
        verdict = ", ".join(f.code for f in s.findings) or "ok"
        table.add_row(Text(s.node), Text(s.model or "-"), Text(str(s.runs)), Text(_speed(s)), Text(_trend(s)),
                      Text(str(s.critical_runs)), Text(verdict, style=_STYLE[s.worst]))
        for g in s.gpus:
            if g.findings:
                table.add_row(Text(f"  GPU {g.gpu}"), Text(""), Text(str(len(g.speed) or "")), Text(_speed(g)),
                              Text(_trend(g)), Text(""),
                              Text(", ".join(f.code for f in g.findings), style=_STYLE[g.worst]))
    console.print(table)
    show_chart(console, lambda width, color: history_chart(verdicts, width, color=color), charts)
    if verdicts.findings:
        console.print()
        render_findings(verdicts.findings, console)


def write_plot(verdicts: Verdicts, path: str, *, overwrite: bool) -> str:
    """Each node's speed against the fleet median over time, as a PNG (matplotlib, only if installed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"--plot {path} needs matplotlib (pip install 'ddpdoctor[plot]')") from None
    import datetime
    import io

    figure = Figure(figsize=(10, 5))
    axes = figure.add_subplot(1, 1, 1)
    flagged = {n for f in verdicts.findings if f.code == "HIS001" for n in f.nodes}
    for s in verdicts.summaries:
        points = [p for p in s.speed if p.ratio is not None]
        if not points:
            continue
        times = [datetime.datetime.fromtimestamp(p.started_at, datetime.timezone.utc) for p in points]
        axes.plot(times, [p.ratio for p in points], marker=".", linewidth=2 if s.node in flagged else 0.6,
                  label=s.node if s.node in flagged else None, alpha=1.0 if s.node in flagged else 0.4)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    axes.set_ylabel("compute speed / fleet median of the model")
    axes.set_title("ddpdoctor history: nodes against their fleet")
    if flagged:
        axes.legend()
    figure.autofmt_xdate()
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return atomic_write_bytes(buffer.getvalue(), path, overwrite=overwrite)
