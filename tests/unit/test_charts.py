"""render/charts.py: the terminal's charts, drawn by plotext, on recorded and built facts.

Each chart is read back as text: its axis labels, its series (the legend's rows or the title's key),
its y range against the figures it draws, its bars' lengths in cells. The renderers print one on a
terminal only: a rich Console on a StringIO is not one, the same forced to be a terminal is, and
`ddpdoctor diagnose` with its stdout piped prints none (and none into its JSON).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from ddpdoctor.callback.run_summary import RankLedger, RunLedger, summary
from ddpdoctor.history.store import History, Measurement, NodeRow, RunRow
from ddpdoctor.history.verdicts import judge
from ddpdoctor.probes.allreduce.probe import merge_results
from ddpdoctor.render import charts
from ddpdoctor.render.console import render_diagnosis
from ddpdoctor.render.history import render_history
from ddpdoctor.render.run_summary import print_summary
from ddpdoctor.snapshot import diagnose_inputs, read_inputs

ROOT = Path(__file__).resolve().parents[2]
H100_BENCH = ROOT / "tests" / "fixtures" / "gpu_runs" / "h100x1_bench2.json"  # `allreduce-bench --nproc 2` on an H100
PAIRS_BENCH = ROOT / "tests" / "fixtures" / "allreduce" / "bench-2rank-gloo-pairs.json"  # with --localise always
ONE_RANK = ROOT / "tests" / "fixtures" / "gpu_runs" / "h100x1_check_all.json"  # the sweep at 1 rank
BARS = "▒█░"  # the phases' markers
LEGEND_ROW = re.compile(r"│ \S ((?:job|ranks \d|nodes |inside |expected ).*?)\s*│")
MiB = 2**20


def _allreduce_facts(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    return next(p["facts"] for p in report["probes"] if p["name"] == "allreduce")


def _y_labels(chart: str) -> list[float]:
    return [float(m.group(1)) for line in chart.splitlines() if (m := re.match(r"\s*([-0-9.e+]+)┤", line))]


def _legend(chart: str) -> list[str]:
    """The legend's labels, top to bottom."""
    return [m.group(1) for line in chart.splitlines() if (m := LEGEND_ROW.search(line))]


# -- busbw against message size ---------------------------------------------------------------------------

def test_busbw_on_the_recorded_h100_bench_has_its_axes_one_series_and_its_peak_in_range():
    facts = _allreduce_facts(H100_BENCH)
    peak = max(r.busbw_gbps for r in merge_results(facts))  # 2.18 GB/s at 16 MiB (gloo: the GPU was unused)
    chart = charts.busbw_chart(facts, 100)
    assert "all_reduce busbw (GB/s), 2 ranks, float32" in chart and "message size (log scale)" in chart
    assert "1 KiB" in chart and "1 MiB" in chart and "16 MiB" in chart  # sizes in KiB/MiB, on a log axis
    assert _legend(chart) == ["job"]  # in-place only, no pairs timed
    assert "expected" not in chart  # BW000: "not modelled: fewer than 2 GPUs in the job"
    labels = _y_labels(chart)
    assert min(labels) == 0 and peak <= max(labels) <= 1.2 * peak, (labels, peak)
    assert max(len(line) for line in chart.splitlines()) <= 100 and "\x1b" not in chart


def test_busbw_draws_each_timed_pair_and_the_expected_line_and_covers_both():
    facts = _allreduce_facts(PAIRS_BENCH)
    chart = charts.busbw_chart(facts, 100, expected_gbps=3.0)
    # The job, the ring pair 0-1 (at the size it was timed), the expectation.
    assert _legend(chart) == ["job", "ranks 0-1 (64 KiB)", "expected 3 GB/s"], chart
    assert 3.0 <= max(_y_labels(chart)) <= 3.6


def test_busbw_across_nodes_draws_the_node_pairs_and_each_nodes_own_ranks():
    size, n = 4 * MiB, 4
    factor = 2 * (n - 1) / n
    times = {s: [s * factor / (20e9 if s < MiB else 40e9)] * 3 for s in (64 * 1024, MiB, size)}
    hosts = ["a", "a", "b", "b"]

    def rank(r: int) -> dict[str, Any]:
        mine = {p: [size / 5e9] * 3 for p in ("0-1", "1-2", "2-3", "0-3") if str(r) in p.split("-")}
        return {"host": hosts[r], "rank": r, "device": "cuda:0", "backend": "nccl", "op": "all_reduce",
                "dtype": "float32", "world_size": n, "iters": 3,
                "results": [{"size_bytes": s, "count": s // 4, "in_place": True, "times_s": t, "wrong": 0}
                            for s, t in times.items()],
                "pairs": {"size_bytes": size, "times_s": mine},
                "nodes": {"size_bytes": size, "node_of_rank": hosts, "intra_times_s": {hosts[r]: [size / 9e9] * 3},
                          "leader_times_s": {"0-2": [size / 2e9] * 3} if r in (0, 2) else {}}}

    chart = charts.busbw_chart({str(r): rank(r) for r in range(n)}, 100)
    legend = _legend(chart)
    assert legend[0] == "job" and len(legend) <= 1 + charts.POINTS_SHOWN, legend
    assert {"nodes a-b (4 MiB)", "inside a (4 MiB)", "inside b (4 MiB)", "ranks 0-1 (4 MiB)"} <= set(legend), legend


def test_no_busbw_chart_for_one_size_or_one_rank():
    facts = _allreduce_facts(H100_BENCH)
    one_size = {r: {**f, "results": f["results"][-1:]} for r, f in facts.items()}
    assert charts.busbw_chart(one_size, 100) == ""
    assert charts.busbw_chart(_allreduce_facts(ONE_RANK), 100) == ""  # busbw is 0 at 1 rank (BW008)
    assert charts.busbw_chart({}, 100) == ""


def test_the_expectation_is_the_verdicts_own():
    inputs = read_inputs([str(H100_BENCH)])
    assert charts.expected_busbw(diagnose_inputs(inputs).findings) is None  # not modelled here
    from ddpdoctor.core.findings import Finding, Severity

    said = Finding(code="BW000", severity=Severity.OK, title="t", probe="allreduce",
                   evidence={"expected_busbw_gbps": 360.0})
    assert charts.expected_busbw([said]) == 360.0


# -- the summary's step phases --------------------------------------------------------------------------

def _summary(slow_rank: Optional[int] = None, world: int = 4) -> dict[str, Any]:
    """A run's summary with the callback's keys (callback/run_summary.py; its ledger's histogram needs torch,
    which would take most of these tests' time to import): every rank 100 ms a step (5 data, 30 waiting for
    peers), and `slow_rank` twice as long, its own compute more than doubled (it waits for no one)."""
    ranks = []
    for r in range(world):
        step, data, wait = (200.0, 10.0, 2.0) if r == slow_rank else (100.0, 5.0, 30.0)
        base = RankLedger(r, host="node-a").to_json()
        row = {**base, "steps": 20, "step_ms_median": step, "step_ms_p90": step, "data_pct": 100 * data / step,
               "wait_pct": 100 * wait / step, "compute_pct": 100 * (step - data - wait) / step,
               "samples_per_s": 32e3 / step, "sampled_steps": 20}
        assert set(row) == set(base), set(row) ^ set(base)  # the callback's keys, no more
        ranks.append(row)
    return {**summary(RunLedger(), [], world, 4.0, {}, 0.0, 4.0), "ranks": ranks}


def _bar_cells(chart: str) -> dict[int, int]:
    out = {}
    for line in chart.splitlines():
        m = re.match(r"rank (\d+)┤(.*)│", line)
        if m:
            out[int(m.group(1))] = sum(m.group(2).count(c) for c in BARS)
    return out


def test_a_rank_twice_as_slow_has_a_bar_twice_as_long():
    s = _summary(slow_rank=2)
    chart = charts.step_phases_chart(s["ranks"], 100)
    cells = _bar_cells(chart)
    assert sorted(cells) == [0, 1, 2, 3], chart
    peers = [cells[r] for r in (0, 1, 3)]
    assert len(set(peers)) == 1 and 1.8 <= cells[2] / peers[0] <= 2.2, cells
    assert "data" in chart and "compute" in chart and "wait" in chart
    # The peers' wait stands out too: their bars hold more of the wait marker than the slow rank's.
    waits = {int(m.group(1)): m.group(2).count("░") for line in chart.splitlines()
             if (m := re.match(r"rank (\d+)┤(.*)│", line))}
    assert waits[0] > 3 * waits[2], waits


def test_no_phases_chart_for_one_rank():
    assert charts.step_phases_chart(_summary(world=1)["ranks"], 100) == ""
    two = _summary(world=2)["ranks"]
    assert charts.step_phases_chart([two[0], {**two[1], "arrived": False, "step_ms_median": None}], 100) == ""


# -- the renderers: a terminal only -----------------------------------------------------------------------

def _consoles() -> tuple[Console, Console]:
    return Console(file=io.StringIO()), Console(file=io.StringIO(), force_terminal=True, width=100)


def _out(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def test_the_summary_prints_its_chart_on_a_terminal_only():
    plain, terminal = _consoles()
    s = _summary(slow_rank=1)
    print_summary(s, [], console=plain)
    print_summary(s, [], console=terminal)
    assert "rank" in _out(plain) and not any(c in _out(plain) for c in BARS)
    assert "median step (ms) by phase" in _out(terminal) and "█" in _out(terminal)
    quiet = Console(file=io.StringIO(), force_terminal=True, width=100)
    print_summary(s, [], console=quiet, charts=False)
    assert "step ms p50" in _out(quiet) and "█" not in _out(quiet)


def _fleet(slow: Optional[str]) -> History:
    """3 nodes, 12 runs of all three, 100 TFLOP/s each; `slow` at 80 from run 6 on."""
    h = History(path="built", schema_version=1, runs=[], nodes=[], measurements=[], findings=[])
    for i in range(12):
        run_id = f"r{i:02d}"
        h.runs.append(RunRow(run_id, 1_700_000_000.0 + i * 86400, "check", "ok", 0, 6, "0.1.0"))
        for k, node in enumerate(("node00", "node01", "node02")):
            h.nodes.append(NodeRow(run_id, node, "0-1"))
            speed = 100e12 * (0.8 if node == slow and i >= 6 else 1.0) * (1 + 0.01 * ((i + k) % 3 - 1))
            h.measurements.append(Measurement(run_id, node, 0, f"GPU-{node}", "H100", "compute_speed", speed,
                                              "flop/s"))
    return h


def test_history_charts_the_drifting_node_against_the_fleet():
    verdicts = judge(_fleet("node01"))
    assert [s.node for s in charts.charted_nodes(verdicts)] == ["node01"]
    chart = charts.history_chart(verdicts, 100)
    assert "compute speed (TFLOP/s) by run" in chart and "• node01" in chart and "· fleet median" in chart
    assert "run date (UTC)" in chart and "2023-11-14" in chart
    labels = _y_labels(chart)
    assert min(labels) <= 81 and max(labels) >= 100, labels  # the fall from 100 to 80 TFLOP/s is in range
    assert charts.history_chart(judge(_fleet(None)), 100) == ""  # no verdict, no chart


def test_history_prints_its_chart_on_a_terminal_only():
    verdicts = judge(_fleet("node01"))
    plain, terminal = _consoles()
    render_history(verdicts, plain)
    render_history(verdicts, terminal)
    assert "node01" in _out(plain) and "fleet median" not in _out(plain)
    assert "fleet median" in _out(terminal)


def test_diagnose_prints_the_busbw_chart_on_a_terminal_only():
    diagnosis = diagnose_inputs(read_inputs([str(H100_BENCH)]))
    plain, terminal = _consoles()
    render_diagnosis(diagnosis, plain)
    render_diagnosis(diagnosis, terminal)
    assert "BW000" in _out(plain) and "message size" not in _out(plain)
    assert "message size (log scale)" in _out(terminal)
    # Under the table, before the findings.
    assert _out(terminal).index("busbw (GB/s)") < _out(terminal).index("BW000")


def test_a_failing_chart_leaves_the_report_whole(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("plotext changed")

    monkeypatch.setattr(charts, "step_phases_chart", broken)
    monkeypatch.setattr("ddpdoctor.render.run_summary.step_phases_chart", broken)
    _, terminal = _consoles()
    print_summary(_summary(slow_rank=1), [], console=terminal)
    assert "step ms p50" in _out(terminal) and "median step (ms) by phase" not in _out(terminal)


# -- the command, piped -----------------------------------------------------------------------------------

def _diagnose(tmp_path: Path, **env: str) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TERM")}
    out = tmp_path / f"d{len(env)}.json"
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "diagnose", str(H100_BENCH), "--json", str(out)],
                          capture_output=True, text=True, timeout=60, env={**clean, **env}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout, out.read_text()


def test_diagnose_piped_prints_no_chart_and_its_json_never_holds_one(tmp_path):
    piped, report = _diagnose(tmp_path)
    assert "BW000" in piped and "message size" not in piped and not re.search("[▀▄▚▞▌▐]", piped)
    # The same command where rich is told the pipe is a terminal draws it: the pipe is what kept it out.
    told, report_told = _diagnose(tmp_path, TTY_COMPATIBLE="1", TERM="xterm")
    assert "message size (log scale)" in told
    assert "message size" not in report and "message size" not in report_told
    assert json.loads(report_told)["findings"] == json.loads(report)["findings"]


def test_a_chart_fits_the_width_it_is_given():
    facts = _allreduce_facts(H100_BENCH)
    for width in (60, 100, 120):
        chart = charts.busbw_chart(facts, width)
        assert max(len(line) for line in chart.splitlines()) <= width
    rows = _summary(slow_rank=0)["ranks"]
    assert max(len(line) for line in charts.step_phases_chart(rows, 70).splitlines()) <= 70


def test_colour_is_only_there_when_asked():
    facts = _allreduce_facts(H100_BENCH)
    assert "\x1b[" in charts.busbw_chart(facts, 100, color=True)
    assert "\x1b[" not in charts.busbw_chart(facts, 100)


def test_checks_stragglers_probe_is_charted_by_phase_from_its_recorded_steps():
    """check's stragglers table gets the summary's chart: on the recorded check whose rank 1 was stopped from
    outside (STR001), rank 1's median step is more compute and rank 0's more waiting for it."""
    report = json.loads((Path(__file__).resolve().parents[1] / "fixtures/trace/check_preempt_rank1.json").read_text())
    facts = next(p for p in report["probes"] if p["name"] == "stragglers")["facts"]
    rows = {r["rank"]: r for r in charts.stragglers_rows(facts)}
    assert sorted(rows) == [0, 1]
    assert rows[1]["compute_pct"] > rows[0]["compute_pct"] and rows[0]["wait_pct"] > rows[1]["wait_pct"]
    assert all(abs(r["data_pct"] + r["compute_pct"] + r["wait_pct"] - 100) < 1e-6 for r in rows.values())
    drawn = charts.step_phases_chart(list(rows.values()), 100)
    lines = {line.split("┤")[0].strip(): line for line in drawn.splitlines() if "┤" in line and "rank" in line}
    assert lines["rank 1"].count("█") > lines["rank 0"].count("█")
    assert lines["rank 0"].count("░") > lines["rank 1"].count("░")


def test_a_node_throttled_by_tc_is_charted_as_its_node_pairs_points_far_under_the_good_pair():
    """The recorded allreduce-bench over three namespace nodes, the third throttled by tc (BW005): each node pair
    is a point of its own, the two with the slow node far under the third."""
    report = json.loads((Path(__file__).resolve().parents[1] / "fixtures/trace/bench_tbf_node3.json").read_text())
    facts = next(p for p in report["probes"] if p["name"] == "allreduce")["facts"]
    slow = report["nodes"][-1]
    drawn = charts.busbw_chart(facts, 100)
    pairs = [line for line in drawn.splitlines() if "nodes " in line]
    assert len(pairs) == 3 and sum(slow in line for line in pairs) == 2, drawn
    top = max(float(line.split("┤")[0]) for line in drawn.splitlines() if "┤" in line and line.split("┤")[0].strip())
    assert top > 1.0  # the axis reaches the good pair's 1.38 GB/s, where the job's line stays near 0.02
