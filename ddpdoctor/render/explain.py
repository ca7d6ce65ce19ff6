"""`ddpdoctor explain` on one screen: verdict, findings, each rank's first error, a timeline."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.explain.command import ExplainRun
from ddpdoctor.explain.requeue import NO_RETRY, RETRY, UNKNOWN
from ddpdoctor.core.findings import Severity
from ddpdoctor.judge.causal_order import verdict_line
from ddpdoctor.render.console import _STYLE, _VERDICT, render_findings

RANK_ROWS = 16
TIMELINE_ROWS = 12
_REQUEUE_STYLE = {RETRY: "green", NO_RETRY: "red", UNKNOWN: "yellow"}


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render_explanation(run: ExplainRun, console: Console, full: bool = False, requeue_exit: bool = False) -> None:
    """`requeue_exit`: the process exits with the requeue verdict's code (`--exit-code requeue`)."""
    ex = run.explanation
    code = run.exit_code
    hosts = sorted(set(ex.hosts.values()))
    head = Text()
    head.append("ddpdoctor explain  ", style="bold")
    head.append(_VERDICT[code], style=_STYLE[max((f.severity for f in ex.findings), default=Severity.OK)])
    ranks = f"{ex.world_size} ranks" if ex.world_size else "ranks unknown"
    listed = f"{', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}"
    nodes = f" on {len(hosts)} node{'s' if len(hosts) != 1 else ''} ({listed})" if hosts else ""
    files = len(run.scan.files) + len(run.dumps)
    head.append(f"  {ranks}{nodes}  {files} file{'s' if files != 1 else ''}, {run.scan.lines} lines, "
                f"{_size(run.scan.bytes)}, {run.seconds:.1f}s")
    console.print(head)
    console.print(Text("verdict: " + verdict_line(ex.findings), style=_STYLE[max((f.severity for f in ex.findings),
                                                                                  default=Severity.OK)]))
    _requeue(run, console)
    render_findings(ex.findings, console, keep_order=True)
    _first_errors(run, console, full)
    _first_errors_by_node(run, console, full)
    _timeline(run, console, full)
    for note in run.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    if requeue_exit:
        console.print(Text(f"exit {run.requeue.exit_code} (requeue: {run.requeue.words})", style="dim"))
    else:
        console.print(Text(f"exit {code} ({_VERDICT[code]})", style="dim"))


def _requeue(run: ExplainRun, console: Console) -> None:
    """One line a person deciding whether to resubmit reads first."""
    r = run.requeue
    line = Text("Requeue: ", style="bold")
    line.append(f"{r.words}: {r.reason}", style=_REQUEUE_STYLE[r.verdict])
    line.append(f" (exit {r.exit_code} with --exit-code requeue)", style="dim")
    console.print(line)


def _first_errors(run: ExplainRun, console: Console, full: bool) -> None:
    stories = [s for s in run.explanation.ranks if s.first is not None]
    silent = [s.rank for s in run.explanation.ranks if s.first is None]
    if not stories:
        return
    console.print()
    table = Table(title="first error per rank", title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("rank", "node", "first error", "where", "more"):
        table.add_column(col, overflow="fold")
    shown = stories if full else stories[:RANK_ROWS]
    for s in shown:
        assert s.first is not None
        table.add_row(str(s.rank), s.host or "", s.first.label[:90], s.first.where, str(s.more) if s.more else "")
    console.print(table)
    if len(shown) < len(stories):
        console.print(Text(f"  ... {len(stories) - len(shown)} more ranks (--all shows them)", style="dim"))
    if silent:
        from ddpdoctor.core.findings import rank_ranges

        console.print(Text(f"  no error printed by rank {rank_ranges(silent)}", style="dim"))


def _first_errors_by_node(run: ExplainRun, console: Console, full: bool) -> None:
    from ddpdoctor.core.findings import rank_ranges

    nodes = run.explanation.nodes
    if len(nodes) < 2:
        return  # one node: the rank table already says it all
    console.print()
    table = Table(title="first error per node", title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("node", "ranks", "first error", "rank", "where"):
        table.add_column(col, overflow="fold")
    shown = nodes if full else nodes[:RANK_ROWS]
    for n in shown:
        first = n.first
        table.add_row(n.node, rank_ranges(n.ranks), first.label[:80] if first else "no error",
                      "" if first is None or first.rank is None else str(first.rank), first.where if first else "")
    console.print(table)
    if len(shown) < len(nodes):
        console.print(Text(f"  ... {len(nodes) - len(shown)} more nodes (--all shows them)", style="dim"))


def _timeline(run: ExplainRun, console: Console, full: bool) -> None:
    events = run.explanation.timeline
    if not events:
        return
    console.print()
    console.print(Text("timeline (first occurrences, earliest first)", style="bold"))
    shown = events if full else events[:TIMELINE_ROWS]
    for e in shown:
        who = f"rank {e.rank}" if e.rank is not None else (f"local {e.local_rank}" if e.local_rank is not None else "-")
        repeat = f" x{e.count}" if e.count > 1 else ""
        console.print(Text(f"  {e.where:<32} {who:<8} {e.label[:100]}{repeat}"))
    if len(shown) < len(events):
        console.print(Text(f"  ... {len(events) - len(shown)} more (--all, or --json for every one)", style="dim"))
