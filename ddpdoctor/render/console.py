"""Terminal output with rich: a live view while ranks run, then one screen of verdict.

Rendering never decides anything: severities and texts come from the findings.
rich honours NO_COLOR and drops colour and live updates when stdout is not a terminal.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.core.report import Report
from ddpdoctor.judge import causal_order

if TYPE_CHECKING:  # the type only: `ddpdoctor diagnose` (top level) renders through here
    from ddpdoctor.snapshot import Diagnosis

_STYLE = {Severity.OK: "green", Severity.INFO: "cyan", Severity.WARN: "yellow", Severity.CRITICAL: "bold red"}
_VERDICT = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr, highlight=False, soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Logs and CI: wide lines beat a finding folded over five lines.
        console = Console(stderr=stderr, highlight=False, soft_wrap=False, width=120)
    return console


class LiveView:
    """Which stage each rank is in, refreshed from heartbeats. Silent off a terminal."""

    def __init__(self, console: Console, world_size: int, enabled: bool) -> None:
        self.console = console
        self.world_size = world_size
        self.live: Optional[Live] = None
        if enabled and console.is_terminal:
            self.live = Live(self._table({}, {}), console=console, refresh_per_second=4, transient=True)

    def __enter__(self) -> "LiveView":
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, heartbeats: Mapping[int, Mapping[str, Any]], states: Mapping[int, str]) -> None:
        if self.live:
            self.live.update(self._table(heartbeats, states))

    def _table(self, heartbeats: Mapping[int, Mapping[str, Any]], states: Mapping[int, str]) -> Table:
        table = Table(title="ddpdoctor: ranks at work", title_justify="left", expand=False)
        for col in ("rank", "stage", "for", "waiting in", "state"):
            table.add_column(col)
        now = time.time()
        for rank in range(self.world_size):
            hb = heartbeats.get(rank) or {}
            coll = hb.get("collective") or {}
            since = hb.get("stage_started")
            table.add_row(Text(str(rank)), Text(str(hb.get("stage", "starting"))),
                          Text(f"{now - since:.1f}s" if since else ""),
                          Text(f"{coll.get('op')} #{coll.get('seq')}" if coll else ""),
                          Text(states.get(rank, "running")))
        return table


def _evidence_lines(evidence: Mapping[str, Any], width: int = 240) -> list[str]:
    lines = []
    for key, value in evidence.items():
        if value in (None, "", [], {}):
            continue
        if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            lines.append(f"{key}:")
            lines.extend(f"    {k}: {v}" for k, v in value.items())
            continue
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            lines.append(f"{key}:")
            lines.extend(f"    {v}" for v in value)
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > width:
            text = text[: width - 3] + "..."
        lines.append(f"{key}: {text}")
    return lines


def render_findings(findings: list[Finding], console: Console, keep_order: bool = False) -> None:
    """The table, then why / evidence / fix for every warning and worse.

    `keep_order`: within a severity, keep the caller's order (explain's is first cause first)."""
    table = Table(show_header=True, header_style="bold", expand=False, box=None, pad_edge=False)
    for col in ("severity", "code", "finding", "ranks", "nodes"):
        table.add_column(col, overflow="fold")
    # Causes first, each with what it explains under it (judge/causal_order.py); then by severity.
    ordered = causal_order.ordered(findings, keep_order=keep_order)
    for f in ordered:
        table.add_row(Text(f.severity.label, style=_STYLE[f.severity]), Text(("└ " if f.explained_by else "") + f.code),
                      Text(f.title + (f" (explained by {f.explained_by})" if f.explained_by else "")),
                      Text(rank_ranges(f.ranks)), Text(",".join(f.nodes)))
    console.print(table)
    for f in ordered:
        if f.severity < Severity.WARN:
            continue
        console.print()
        console.print(Text(f"{f.code} {f.title}", style=_STYLE[f.severity]))
        if f.why:
            console.print(Text(f"  why: {f.why}"))
        for line in _evidence_lines(f.evidence):
            console.print(Text(f"  {line}", style="dim"))
        if f.fix:
            console.print(Text(f"  fix: {f.fix}", style="bold"))


def render_diagnosis(diagnosis: Diagnosis, console: Console, charts: bool = True) -> None:
    """`charts`: False keeps the probes' charts out even on a terminal (a quiet run)."""
    code = diagnosis.exit_code
    nodes = diagnosis.nodes()
    files = len(diagnosis.inputs.files)
    head = Text()
    head.append("ddpdoctor diagnose  ", style="bold")
    head.append(_VERDICT[code], style=_STYLE[max((f.severity for f in diagnosis.findings), default=Severity.OK)])
    head.append(f"  {diagnosis.inputs.world_size} ranks on {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
                f" ({', '.join(nodes[:4])}{', ...' if len(nodes) > 4 else ''})  from {files} file{'s' if files != 1 else ''}")
    console.print(head)
    for name, facts in diagnosis.inputs.facts.items():
        _details(name, facts, console)
        _chart(name, facts, diagnosis.findings, console, charts)
    render_findings(diagnosis.findings, console)
    console.print(Text(f"exit {code} ({_VERDICT[code]})", style="dim"))


def _details(name: str, facts: Mapping[Any, Any], console: Console) -> None:
    """A probe with more to show than findings (a bandwidth table, a topology matrix) shows it above them."""
    from ddpdoctor.probes import get_probe

    details = getattr(get_probe(name), "render_details", None)
    if details is not None and facts:
        try:
            details(facts, console)
        except Exception as exc:  # a rendering bug must not hide the findings
            console.print(Text(f"({name}: details could not be shown: {type(exc).__name__}: {exc})"))


def _chart(name: str, facts: Mapping[Any, Any], findings: list[Finding], console: Console, enabled: bool) -> None:
    """Under the allreduce table, its busbw against message size, with the expectation its verdict was judged
    by; under the stragglers table, each rank's median step by phase; only on a terminal (render/charts.py)."""
    if name not in ("allreduce", "stragglers") or not facts:
        return
    from ddpdoctor.render import charts

    if name == "stragglers":  # each rank's median step by phase: the straggler computes, its peers wait
        rows = charts.stragglers_rows(facts)
        charts.show(console, lambda width, color: charts.step_phases_chart(rows, width, color=color), enabled)
        return
    expected = charts.expected_busbw(findings)
    charts.show(console, lambda width, color: charts.busbw_chart(facts, width, expected_gbps=expected, color=color),
                enabled)


def _probe_details(report: Report, console: Console, charts: bool = True) -> None:
    for section in report.probes:
        _details(section.name, section.facts, console)
        _chart(section.name, section.facts, report.findings, console, charts)


# Past this many nodes only the ones with findings are listed, and a count of the rest.
_NODES_LISTED = 8


def _by_node(report: Report, console: Console) -> None:
    """One line per node: which node to look at first, not only which rank."""
    nodes = report.by_node()
    quiet = [n for n in nodes if not n["findings"]]
    shown = nodes if len(nodes) <= _NODES_LISTED else [n for n in nodes if n["findings"]]
    line = Text("by node: ", style="bold")
    for n in shown:
        line.append(f" {n['host']} (ranks {n['ranks']}): ")
        said = ", ".join(n["findings"][:4]) + (", ..." if len(n["findings"]) > 4 else "")
        line.append(said or "ok", style=_STYLE[Severity.parse(n["worst_severity"])] if said else "green")
        line.append(";")
    if len(shown) < len(nodes):
        line.append(f" {len(quiet)} more node{'s' if len(quiet) != 1 else ''} with nothing to say;")
    console.print(line)


def render_report(report: Report, console: Console, charts: bool = True) -> None:
    """`charts`: False keeps the probes' charts out even on a terminal (`--no-live`)."""
    data_nodes = report.nodes()
    rec = report.record
    code = report.exit_code
    head = Text()
    head.append(f"ddpdoctor {report.title}  ", style="bold")
    head.append(_VERDICT[code], style=_STYLE[report.verdict] if code != 3 else "bold magenta")
    head.append(f"  {rec.world_size} rank{'s' if rec.world_size != 1 else ''} on {len(data_nodes)} "
                f"node{'s' if len(data_nodes) != 1 else ''}")
    if data_nodes:
        head.append(f" ({', '.join(data_nodes[:4])}{', ...' if len(data_nodes) > 4 else ''})")
    if report.backend and report.device:
        head.append(f"  {report.backend}/{report.device}")
    head.append(f"  {max(0.0, rec.ended - rec.started):.1f}s")
    console.print(head)
    console.print(Text("verdict: " + causal_order.verdict_line(report.findings), style=_STYLE[report.verdict]))
    if charts and any(f.kind != "ok" for f in report.fates.values()):  # a hang or a failure, as rich's bars
        from ddpdoctor.render import rank_strip

        rank_strip.show(report.to_json(), console)

    _probe_details(report, console, charts)
    render_findings(report.findings, console)
    if len(data_nodes) > 1:
        _by_node(report, console)
    status = ", ".join(f"{p.name}: {p.status}" for p in report.probes)
    console.print(Text(f"probes: {status}   exit {code} ({_VERDICT[code]})", style="dim"))
