"""stragglers end to end on CPU ranks: a rank that really computes slower, one whose data
loader really stalls, one that really gets twice the batch, and a healthy run.

The faults are large (factor 2, a stall about the size of a step's own work) so one short
run decides; how small a slowdown is named reliably is the benchmark's question
(benchmarks/stragglers_detection.py), not a test's.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.trace_format import check_rules, spans_of

from .harness import assert_nothing_left, probe_section, run_check

pytestmark = pytest.mark.ranks


def _codes(report, code):
    return [f for f in report["findings"] if f["code"] == code]


def test_slow_compute_and_slow_data_are_each_named_with_their_cause(tmp_path):
    timeline = tmp_path / "trace.json"
    run = run_check(tmp_path, "--nproc", "4", "--probes", "stragglers", "--straggler-seconds", "2",
                    "--inject", "slow:rank=1:factor=2,slowdata:rank=2:ms=6", "--trace", str(timeline),
                    "--html", str(tmp_path / "check.html"))
    assert run.returncode == 1, run.explain()
    named = {f["ranks"][0]: f for f in _codes(run.report, "STR001")}
    assert sorted(named) == [1, 2], run.explain()
    assert named[1]["evidence"]["cause"] == "compute", named[1]
    assert named[2]["evidence"]["cause"] == "data loading", named[2]
    facts = probe_section(run.report, "stragglers")["facts"]
    # Measured, not simulated: the slow rank really spent extra time, the stall shows as data time.
    assert facts["1"]["injected_ms"] > 0 and facts["0"]["injected_ms"] == 0
    assert len(facts["0"]["steps"]["step_ms"]) >= 40 and len(facts["0"]["solo_ms"]) >= 5
    assert facts["0"]["clock"]["source"] == "rank 0" and facts["3"]["clock"]["offset_ms"] == 0.0
    sampled = facts["2"]["sampled"]
    assert sampled["samples"] >= 5 and sampled["host_cpu_pct"]["median"] > 0 and sampled["cpu_affinity"]
    assert "comm wait" in run.stdout and "stragglers" in run.stdout
    assert_nothing_left(run)
    # The timeline shows it at a glance: the slow rank computes longest, the healthy ones wait for it, and the
    # stalled rank's data bars are its longest.
    doc = json.loads(timeline.read_text())
    check_rules(doc)

    def median_us(rank: int, name: str) -> float:
        return statistics.median(e["dur"] for e in spans_of(doc, rank, "phase") if e["name"] == name)

    assert median_us(1, "compute") > max(median_us(r, "compute") for r in (0, 3))
    assert median_us(0, "wait for peers") > median_us(1, "wait for peers")
    assert median_us(2, "data") > max(median_us(r, "data") for r in (0, 1, 3))
    page = (tmp_path / "check.html").read_text()
    assert page.index('id="verdict"') < page.index('data-code="STR001"') < page.index('id="block-timeline"')


@pytest.mark.slow
def test_healthy_ranks_name_no_straggler(tmp_path):
    """3 healthy ranks for 3 s: no STR001 or STR003, STR002 (ok) for all, exit 0.

    Default twin: tests/ranks/test_stragglers_e2e.py::test_slow_compute_and_slow_data_are_each_named_with_their_cause
    (the same probe on 4 ranks time-sharing the 2 cores, where the healthy ranks 0 and 3 must not be
    named: it asserts exactly ranks 1 and 2)."""
    run = run_check(tmp_path, "--nproc", "3", "--probes", "stragglers", "--straggler-seconds", "3")
    assert run.returncode == 0, run.explain()
    assert not _codes(run.report, "STR001") and not _codes(run.report, "STR003"), run.explain()
    [clear] = _codes(run.report, "STR002")
    assert clear["severity"] == "ok" and clear["ranks"] == [0, 1, 2]
    assert_nothing_left(run)


@pytest.mark.slow
def test_a_rank_with_twice_the_batch_is_uneven_work_not_a_straggler(tmp_path):
    """STR003: rank 1 with twice the batch is uneven work, not a straggler.

    Default twin: tests/ranks/test_stragglers_e2e.py::test_slow_compute_and_slow_data_are_each_named_with_their_cause
    (the same stragglers probe and its per-rank step facts, judged per step there; per sample here)."""
    run = run_check(tmp_path, "--nproc", "3", "--probes", "stragglers", "--straggler-seconds", "0.5",
                    "--inject", "bigbatch:rank=1:factor=2")  # the batch sizes decide: the fewest steps do
    assert run.returncode == 1, run.explain()
    # Rank 1 is not called slow: per sample it works as fast as the others. (Only rank 1 is
    # asserted: 3 ranks on 2 cores for 0.5 s once gave a 12% STR001 on rank 2, scheduler noise
    # that the 3 s healthy run above does not show; that run asserts no STR001 at all.)
    assert not [f for f in _codes(run.report, "STR001") if 1 in f["ranks"]], run.explain()
    [uneven] = _codes(run.report, "STR003")
    assert uneven["ranks"] == [1] and uneven["evidence"]["samples_per_step"] == {"0": 32, "1": 64, "2": 32}
    assert_nothing_left(run)
