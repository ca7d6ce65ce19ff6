"""The timeline files (core/timeline.py): check's report drawn (render/trace_check.py) and the callback's kept
windows (callback/trace_keep.py), each held to the trace-event format's rules (tests/trace_format.py).

The reports drawn here are real: ddpdoctor's own run on an H100 (tests/fixtures/gpu_runs) and a CPU check
whose rank 1 was frozen by SIGSTOP (tests/fixtures/trace). The faults drawn live are the end-to-end tests'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor.callback.row import GatheredRow
from ddpdoctor.callback.trace_keep import FIRST, LAST, TraceKeep
from ddpdoctor.core import codes
from ddpdoctor.core import timeline as trace
from ddpdoctor.render import trace_check
from tests.trace_format import check_rules, spans_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _report(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_a_real_h100_check_is_drawn_stage_by_stage_in_microseconds_with_its_measured_steps():
    report = _report("gpu_runs/h100x1_check_all.json")
    doc = trace_check.from_report(report).to_json()
    check_rules(doc)
    stages = {e["name"]: e for e in spans_of(doc, 0, "stage")}
    recorded = {s["name"]: s for s in report["ranks"][0]["timeline"]}
    init = recorded["init"]
    assert stages["init"]["dur"] == pytest.approx((init["ended"] - init["started"]) * 1e6, abs=1.0)
    assert stages["init"]["ts"] - stages["rendezvous"]["ts"] == pytest.approx(
        (init["started"] - recorded["rendezvous"]["started"]) * 1e6, abs=1.0)
    steps = [e for e in spans_of(doc, 0, "step")]
    measured = next(p for p in report["probes"] if p["name"] == "stragglers")["facts"]["0"]["steps"]["step_ms"]
    assert len(steps) == min(trace_check.STEPS_KEPT, len(measured))
    assert steps[-1]["dur"] >= measured[-1] * 1e3 - 1  # a step's span is at least its measured length
    marks = [e["name"].split()[0] for e in doc["traceEvents"] if e["ph"] == "i"]
    assert marks == [f["code"] for f in report["findings"]]
    assert doc["otherData"]["started_at_epoch_s"] == pytest.approx(report["started_at"], abs=1e-3)


def test_a_frozen_rank_is_an_open_span_to_the_end_named_stuck_with_the_finding_that_names_it():
    report = _report("trace/check_frozen_rank1.json")
    doc = trace_check.from_report(report).to_json()
    check_rules(doc)
    stuck = [e for e in spans_of(doc, 1) if e["name"].endswith(trace.OPEN)]
    assert stuck, [e["name"] for e in spans_of(doc, 1)]
    end = max(e["ts"] + e.get("dur", 0) for e in doc["traceEvents"] if e["ph"] in ("X", "i"))
    assert all(e["ts"] + e["dur"] == pytest.approx(end, abs=1.0) for e in stuck)
    assert any(e["args"].get("finding", "").startswith("RUN005") for e in stuck), stuck
    assert {e["name"] for e in stuck} == {"probe:gpu-count" + trace.OPEN, "train" + trace.OPEN}
    # It was inside DDP's gradient all-reduce, call 97 at step 93, when the run ended (the report's in-flight record).
    assert all(e["args"]["collective_in_flight"] == {"op": "ddp_gradient_allreduce", "seq": 97, "step": 93}
               for e in stuck)
    # Its victim's stages all ended (rank 0's train in error, when the frozen peer's connection was reset).
    assert not [e for e in spans_of(doc, 0) if e["name"].endswith(trace.OPEN)]
    [train0] = [e for e in spans_of(doc, 0) if e["name"] == "train"]
    assert train0["args"]["status"] == "error" and train0["ts"] + train0["dur"] < end


def _row(rank: int, steps_done: int, last_end: float, left: float, step_ms: float = 10.0, data_ms: float = 2.0,
         wait_ms: float = 0.0, n: int = 5) -> GatheredRow:
    return GatheredRow(rank=rank, steps_done=steps_done, window_steps=n, step_ms=[step_ms] * n,
                       data_ms=[data_ms] * n, wait_ms=[wait_ms] * n, samples=[0.0] * n, last_end_s=last_end,
                       gather_left_s=left, check_began_s=left - 0.25 if rank else left - 0.01)


def test_the_callbacks_windows_are_laid_back_from_each_ranks_last_step_on_rank_0s_clock():
    keep = TraceKeep(world_size=2)
    # Rank 1's host clock runs 5 s ahead: both left the previous gather together, at 100.0 on rank 0's clock.
    keep.add({0: _row(0, 5, 160.0, 100.0, wait_ms=4.0), 1: _row(1, 5, 165.0 - 0.004, 105.0, step_ms=14.0)},
             {0: "a", 1: "b"})
    doc = keep.timeline(170.0).to_json()
    check_rules(doc)
    origin = doc["otherData"]["started_at_epoch_s"]
    steps0, steps1 = spans_of(doc, 0, "step"), spans_of(doc, 1, "step")
    assert [e["name"] for e in steps0] == [f"step {i}" for i in range(1, 6)]
    last0, last1 = steps0[-1], steps1[-1]
    assert origin + (last0["ts"] + last0["dur"]) / 1e6 == pytest.approx(160.0, abs=1e-6)
    assert origin + (last1["ts"] + last1["dur"]) / 1e6 == pytest.approx(159.996, abs=1e-6)  # moved by -5 s
    assert last1["dur"] == pytest.approx(16_000, abs=0.01) and last0["dur"] == pytest.approx(12_000, abs=0.01)
    waits = [e for e in spans_of(doc, 0, "phase") if e["name"] == "wait for peers"]
    assert len(waits) == 5 and waits[-1]["dur"] == pytest.approx(4_000, abs=0.01)
    nodes = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name")
    assert nodes == ["node a", "node b"]
    # The check before the window: rank 1 came early and waited 250 ms in it for rank 0; both left it together.
    [check0], [check1] = spans_of(doc, 0, "check"), spans_of(doc, 1, "check")
    assert check0["dur"] == 10_000 and check1["dur"] == 250_000
    assert check0["ts"] + check0["dur"] == check1["ts"] + check1["dur"]


def test_a_long_run_keeps_its_first_and_last_windows_only():
    keep = TraceKeep(world_size=3)
    for check in range(1000):
        keep.add({r: _row(r, 5 * (check + 1), 1000.0 + check, 999.5 + check, step_ms=1.0, data_ms=0.0)
                  for r in range(3)}, {r: "n" for r in range(3)})
    doc = keep.timeline(3000.0).to_json()
    check_rules(doc)
    numbers = sorted({int(e["name"].split()[1]) for e in spans_of(doc, 2, "step")})
    assert len(numbers) == 5 * (FIRST + LAST) and numbers[0] == 1 and numbers[-1] == 5000
    big = TraceKeep(world_size=4096)
    assert big.steps_cap * 4096 * (FIRST + LAST) <= 21_000 * 4


def test_a_hang_draws_the_stuck_rank_open_with_its_stack_and_its_victims_waiting():
    keep = TraceKeep(world_size=2)
    keep.add({0: _row(0, 5, 160.0, 100.0), 1: _row(1, 5, 160.0, 100.0)}, {0: "a", 1: "a"})
    hang = codes.finding("DOC007", "callback", "Step 6 hung: rank 1 stopped", ranks=(1,), evidence={
        "cause_by_rank": {"1": "stopped"}, "affected_ranks": {"0": "waiting in allreduce at step 6"},
        "state_by_rank": {"0": "allreduce", "1": "own code"}, "step_by_rank": {"0": 6, "1": 6},
        "python_stack_rank_1": ["File \"train.py\", line 9, in <module>", "  time.sleep(600)"]})
    keep.finding(hang, 200.0)
    doc = keep.timeline(201.0).to_json()
    check_rules(doc)
    [stuck] = [e for e in spans_of(doc, 1, "hang")]
    assert stuck["name"] == "step 6" + trace.OPEN and "time.sleep(600)" in stuck["args"]["stack"]
    assert stuck["args"]["cause"] == "stopped"
    [waiting] = [e for e in spans_of(doc, 0, "hang")]
    assert waiting["name"].startswith("waiting in allreduce") and "step 6" in waiting["args"]["waiting"]
    origin = doc["otherData"]["started_at_epoch_s"]
    assert origin + stuck["ts"] / 1e6 == pytest.approx(160.0) and origin + (stuck["ts"] + stuck["dur"]) / 1e6 \
        == pytest.approx(201.0)
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert [m["tid"] for m in marks] == [1] and marks[0]["name"].startswith("DOC007")


@pytest.mark.parametrize("broken", [
    {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 5, "dur": -1, "cat": "c"},
    {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": "5", "dur": 1, "cat": "c"},
    {"ph": "i", "name": "a", "pid": 0, "tid": 0, "ts": 5},
    {"ph": "X", "name": "b", "pid": 0, "tid": 0, "ts": 5, "dur": 10, "cat": "c"},  # overlaps "a" without nesting
])
def test_the_rules_refuse_what_the_format_does_not_allow(broken):
    good = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "node a"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
        {"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 0, "dur": 10, "cat": "c"}]}
    check_rules(good)
    if broken["name"] == "b":
        good["traceEvents"][-1]["dur"] = 8  # "a" is [0, 8]: "b" [5, 15] overlaps it
    with pytest.raises(AssertionError):
        check_rules({"traceEvents": good["traceEvents"] + [broken]})


def test_diagnose_draws_one_check_report_and_refuses_two_with_one_line(tmp_path, capsys):
    from ddpdoctor import cli

    out = tmp_path / "t.json"
    report = FIXTURES / "trace/check_frozen_rank1.json"
    cli.main(["diagnose", str(report), "--trace", str(out)])
    doc = json.loads(out.read_text())
    check_rules(doc)
    assert doc == trace_check.from_report(json.loads(report.read_text())).to_json()
    capsys.readouterr()
    code = cli.main(["diagnose", str(report), str(FIXTURES / "gpu_runs/h100x1_check_all.json"), "--trace",
                     str(tmp_path / "two.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and "give exactly one" in err[0] and not (tmp_path / "two.json").exists()


def test_a_straggler_stopped_from_outside_shows_as_its_peer_waiting_in_the_recorded_check():
    report = _report("trace/check_preempt_rank1.json")
    assert [f["ranks"] for f in report["findings"] if f["code"] == "STR001"] == [[1]]
    doc = trace_check.from_report(report).to_json()
    check_rules(doc)

    def total(rank: int, name: str) -> int:
        return sum(e["dur"] for e in spans_of(doc, rank, "phase") if e["name"] == name)

    assert total(0, "wait for peers") > 1.2 * total(1, "wait for peers")


def test_a_node_throttled_by_tc_is_the_long_bar_of_every_node_pair_it_is_in():
    report = _report("trace/bench_tbf_node3.json")
    slow = report["nodes"][-1]
    doc = trace_check.from_report(report).to_json()
    check_rules(doc)
    bars = [(e["name"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].startswith("nodes ")]
    with_slow = [d for name, d in bars if slow in name]
    without = [d for name, d in bars if slow not in name]
    assert with_slow and without and min(with_slow) > 10 * max(without), bars
    # Every rank ended well: the report stage, still running while its report was made, is no hang.
    assert not [e["name"] for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].endswith(trace.OPEN)]
