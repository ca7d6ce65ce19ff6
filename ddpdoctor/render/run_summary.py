"""The end-of-run summary on rank 0's stderr: one screen, the verdict first, the figures as its evidence.

Rendering decides nothing: the summary dict (callback/run_summary.py, as in the JSON) and the findings
(already in causal order) say it all; this only lays them out. At most SHOWN_RANKS rows of ranks: the ranks
the findings name, the slowest and the fastest; the JSON has every rank. On a terminal, under them, the same
ranks' median step as bars cut by phase (render/charts.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.render.charts import show as show_chart
from ddpdoctor.render.charts import step_phases_chart
from ddpdoctor.render.console import _STYLE, make_console

SHOWN_RANKS = 8


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}%"


def shown_ranks(ranks: Sequence[Mapping[str, Any]], named: set[int]) -> list[Mapping[str, Any]]:
    """The rows worth a line: named ranks, missing ones, then the slowest and fastest by median step."""
    if len(ranks) <= SHOWN_RANKS:
        return list(ranks)
    timed = sorted((r for r in ranks if r.get("step_ms_median") is not None), key=lambda r: -r["step_ms_median"])
    first = [r for r in ranks if r["rank"] in named or not r.get("arrived", True)]
    order = first + [r for pair in zip(timed, reversed(timed)) for r in pair]
    picked: dict[int, Mapping[str, Any]] = {}
    for r in order:
        if len(picked) >= SHOWN_RANKS:
            break
        picked.setdefault(r["rank"], r)
    return sorted(picked.values(), key=lambda r: r["rank"])


def job_line(s: Mapping[str, Any]) -> str:
    nodes = {r["node"] for r in s["ranks"] if r.get("node")}
    parts = [f"{s['world_size']} rank{'s' if s['world_size'] != 1 else ''} on {len(nodes) or 1} "
             f"node{'s' if len(nodes) > 1 else ''}", f"{s['steps']} steps in {s['wall_s']:.1f} s"]
    if s.get("step_ms_median") is not None:
        parts.append(f"step {_ms(s['step_ms_median'])} ms (median)")
    if s.get("samples_per_s") is not None:
        parts.append(f"{s['samples_per_s']:.0f} samples/s")
    lost = s.get("lost_to_slowest")
    if lost and lost.get("share_pct") is not None and lost.get("straggler"):
        parts.append(f"the straggler, rank {lost['rank']}, costs {lost['share_pct']:.0f}% of each step "
                     f"({lost['seconds']:.1f} s in all)")
    elif lost and lost.get("share_pct") is not None:
        parts.append(f"slowest rank {lost['rank']}: {lost['share_pct']:.0f}% of a step over the median rank "
                     "(no straggler)")
    return ", ".join(parts)


def print_summary(s: Mapping[str, Any], findings: Sequence[Finding], json_path: Optional[str] = None,
                  console: Optional[Console] = None, charts: bool = True) -> None:
    """On rank 0's stderr (`console` for tests). `charts`: False keeps the step-phases chart out even on a
    terminal; off a terminal it never shows (render/charts.py)."""
    console = console if console is not None else make_console(stderr=True)
    severity = Severity[s["severity"].upper()] if s["severity"].upper() in Severity.__members__ else Severity.OK
    head = Text("ddpdoctor end of run: ", style="bold")
    head.append(s["verdict"], style=_STYLE[severity])
    console.print(head)
    console.print(Text(job_line(s), style="dim"))
    judged = s.get("stragglers_judged")
    if judged and not judged.get("judged") and s["world_size"] > 1:
        console.print(Text(f"stragglers not judged: the run's windows stand for {judged['job_s']:.1f} s of the job and "
                           f"{judged['steps_per_rank']} steps a rank, where a verdict needs {judged['needs_s']:g} s and "
                           f"{judged['needs_steps']} (a longer run, or `ddpdoctor check --probes stragglers`)",
                           style="dim"))
    named = {r for f in findings if f.severity >= Severity.WARN for r in f.ranks}
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("rank", "node", "steps", "step ms p50", "p90", "data", "compute", "wait", "samples/s"):
        table.add_column(col, justify="left" if col in ("rank", "node") else "right")
    shown = shown_ranks(s["ranks"], named)
    for r in shown:
        style = "bold yellow" if r["rank"] in named else ""
        if not r.get("arrived", True):
            table.add_row(Text(str(r["rank"]), style="bold red"), r.get("node") or "-", str(r["steps"]),
                          Text(f"missing at the end: {r.get('missing')}", style="bold red"), "", "", "", "", "")
            continue
        rate = r.get("samples_per_s")
        table.add_row(Text(str(r["rank"]), style=style), r.get("node") or "-", str(r["steps"]),
                      _ms(r.get("step_ms_median")), _ms(r.get("step_ms_p90")), _pct(r.get("data_pct")),
                      _pct(r.get("compute_pct")), _pct(r.get("wait_pct")), "-" if rate is None else f"{rate:.0f}")
    console.print(table)
    if len(s["ranks"]) > SHOWN_RANKS:
        console.print(Text(f"  ({len(s['ranks']) - SHOWN_RANKS} more ranks in the JSON)", style="dim"))
    show_chart(console, lambda width, color: step_phases_chart(shown, width, color=color), charts)
    for f in findings[:6]:
        line = Text(f"  {f.severity.label:8s} ", style=_STYLE[f.severity])
        line.append(f"{f.code}  {'└ ' if f.explained_by else ''}{f.title}")
        if f.ranks:
            line.append(f"  (rank{'s' if len(f.ranks) > 1 else ''} {rank_ranges(f.ranks)})", style="dim")
        console.print(line)
    if len(findings) > 6:
        console.print(Text(f"  and {len(findings) - 6} more findings in the JSON", style="dim"))
    top = next((f for f in findings if f.severity >= Severity.WARN), None)
    if top is not None and top.fix:
        console.print(Text(f"fix: {top.fix}", style="bold"))
    if json_path:
        console.print(Text(f"report: {json_path}", style="dim"))
