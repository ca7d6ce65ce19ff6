"""The ranks' strip (render/rank_strip.py): a hang or a failure at a glance under check's verdict, on real reports."""

from __future__ import annotations

import io

from rich.console import Console

from ddpdoctor.render import rank_strip
from tests.page_parts import load


def _printed(report: dict, terminal: bool = True) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=110, color_system=None)
    rank_strip.show(report, console)
    return out.getvalue()


def test_the_frozen_rank_runs_to_the_end_and_its_victim_stopped_before_it():
    text = _printed(load("trace/check_frozen_rank1.json"))
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("rank ")}
    assert "train (stuck)" in rows["1"] and "RUN005" in rows["1"], text
    assert "train (error)" in rows["0"], text
    # One time axis: the stuck bar reaches the right end of the bars' column, the failed one stops short of it.
    assert rows["1"].count("█") > rows["0"].count("█"), text
    assert text.index("rank 0") < text.index("rank 1")  # both did not end well: rank order


def test_a_run_whose_ranks_all_ended_well_draws_nothing_and_a_pipe_never_gets_one():
    assert _printed(load("gpu_runs/h100x1_check_all.json")) == ""
    assert _printed(load("trace/bench_tbf_node3.json")) == ""  # a warning, but every rank ended well
    assert _printed(load("trace/check_frozen_rank1.json"), terminal=False) == ""
