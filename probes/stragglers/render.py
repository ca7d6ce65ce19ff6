"""The per-rank table of the stragglers probe: where each rank's step goes, and its score.

Rendering only; the scores come from straggler_scores (default threshold: a user's
--slow-threshold is applied by the findings, the table marks by the default).
"""

from __future__ import annotations

from typing import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.stragglers.facts import StragglersFacts
from ddpdoctor.probes.stragglers.scores import _persistent, by_rank, score

MAX_ROWS = 32


def render_table(facts: Mapping[int, StragglersFacts], console: Console) -> None:
    scores = score(by_rank(facts), RunView(world_size=len(facts)))
    if scores is None:
        return
    table = Table(title=f"stragglers  {scores.steps} steps, medians in ms; arrives: ms after the others at the "
                        "all-reduce; score: % slower than the median of the other ranks, by work per sample",
                  title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("rank", "node", "step", "data", "compute", "optimizer", "comm wait", "arrives", "alone", "score"):
        table.add_column(col, justify="left" if col == "node" else "right")
    ordered = sorted(scores.ranks.values(), key=lambda s: -s.score_pct)
    for s in sorted(ordered[:MAX_ROWS], key=lambda s: s.rank):
        slow = _persistent(s, scores.threshold_pct)
        style = "bold red" if slow else ""
        table.add_row(Text(str(s.rank), style=style), s.host, f"{s.step_ms:.1f}", f"{s.data_ms:.1f}",
                      f"{s.compute_ms:.1f}", f"{s.optimizer_ms:.1f}", f"{s.comm_wait_ms:.1f}",
                      "" if s.late_ms is None else f"{s.late_ms:+.1f}",
                      "" if s.solo_ms is None else f"{s.solo_ms:.1f}",
                      Text(f"{s.score_pct:+.1f}%", style=style))
    console.print(table)
    if len(ordered) > MAX_ROWS:
        console.print(Text(f"(the {MAX_ROWS} slowest of {len(ordered)} ranks shown; all are in the JSON report)",
                           style="dim"))
