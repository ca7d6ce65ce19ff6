"""The scaling table: per size, samples/s, speedup, efficiency against its target, and the lost time."""

from __future__ import annotations

from typing import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.probes.scaling.facts import ScalingFacts
from ddpdoctor.probes.scaling.judge import evaluate


def render_table(facts: Mapping[int, ScalingFacts], console: Console) -> None:
    results = evaluate(facts)
    if not results:
        return
    table = Table(title="scaling  same batch per rank; lost: ms a step adds over 1 rank (comm not hidden, "
                        "straggler, data, slower compute on all)", title_justify="left", box=None, pad_edge=False,
                  header_style="bold")
    for col in ("ranks", "samples/s", "speedup", "efficiency", "target", "step ms", "comm", "straggler", "data",
                "compute", "other"):
        table.add_column(col, justify="right")
    for r in results:
        short = r.target_pct is not None and r.efficiency_pct < r.target_pct
        loss = [f"{r.loss_ms[k]:.1f}" if k in r.loss_ms else "" for k in ("comm", "straggler", "data", "contention",
                                                                         "other")]
        table.add_row(str(r.n), f"{r.samples_per_s:,.0f}", f"{r.speedup:.2f}x",
                      Text(f"{r.efficiency_pct:.0f}%", style="bold red" if short else ""),
                      f"{r.target_pct:g}%" if r.target_pct is not None else "", f"{r.step_ms:.2f}", *loss)
    console.print(table)
