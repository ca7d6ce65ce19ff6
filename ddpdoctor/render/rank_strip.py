"""A hang or a failure at a glance in the terminal: each rank's run as a bar, its last stage marked.

Why: a verdict says "rank 1 hung in stage train"; a strip of bars shows it, one row per rank on one time
axis: where every rank's last stage began and ended, the stuck one running to the end in red, the ones that
failed in yellow, the others in green. It is the timeline (render/trace_check.py) cut to what a hang needs,
drawn with rich's own bars, and only when a rank did not end well: a healthy run's screen stays as it was.
Only on a terminal (render/charts.py `wanted`), never in a pipe, a log or the JSON.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rich.bar import Bar
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.timeline import Span
from ddpdoctor.render.charts import MIN_WIDTH, wanted
from ddpdoctor.render.trace_check import from_report

ROWS = 16  # ranks shown: the ones that did not end well first
BAR_SHARE = 0.5  # of the console's width


def strip(report: Mapping[str, Any], width: int) -> Optional[Table]:
    """The strip of a `check` report (its JSON), or None where every rank ended well."""
    timeline = from_report(report)
    origin, end = timeline.started_s(), timeline.ended_s
    last: dict[int, Span] = {}
    for span in timeline.spans:
        if span.track or span.cat not in ("stage", "probe") or span.name == "report":
            continue  # the report stage is ddpdoctor's own, after the work: not where a rank stopped
        mine = last.get(span.rank)
        # A rank's last stage: the one begun last; a stuck one wins over what it contains.
        if mine is None or (span.end_s is None) > (mine.end_s is None) or (
                (span.end_s is None) == (mine.end_s is None) and span.start_s > mine.start_s):
            last[span.rank] = span
    bad = {r: s for r, s in last.items() if s.end_s is None or s.args.get("status") in ("error", "timeout")}
    if not bad or end <= origin:
        return None
    shown = sorted(bad) + sorted(r for r in last if r not in bad)
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(width=max(10, int(width * BAR_SHARE)))
    table.add_column(no_wrap=True, overflow="ellipsis")
    size = end - origin
    for rank in shown[:ROWS]:
        span = last[rank]
        stuck = span.end_s is None
        colour = "red" if stuck else ("yellow" if rank in bad else "green")
        host = timeline.hosts.get(rank, "")
        began = span.start_s - origin
        stop = (end if stuck else span.end_s or end) - origin
        said = " (stuck)" if stuck else (f" ({span.args.get('status')})" if rank in bad else "")
        label = Text(f"{span.name}{said} {stop - began:.1f} s", style=colour)
        if span.args.get("finding"):
            label.append(f"  {str(span.args['finding']).split(':')[0]}", style="bold " + colour)
        table.add_row(Text(f"rank {rank}" + (f" ({host})" if host else ""), style="bold" if rank in bad else ""),
                      Bar(size, began, max(stop, began + size / 200), color=colour), label)
    if len(shown) > ROWS:
        table.add_row(Text(f"{len(shown) - ROWS} more ranks", style="dim"), Text(""), Text(""))
    return table


def show(report: Mapping[str, Any], console: Console, enabled: bool = True) -> bool:
    """Print the strip under the verdict where a person looks and a rank did not end well; True if printed."""
    if not enabled or not wanted(console) or console.width < MIN_WIDTH:
        return False
    table = strip(report, console.width)
    if table is None:
        return False
    console.print(Text("ranks (each rank's last stage; seconds since the run began):", style="dim"))
    console.print(table)
    return True
