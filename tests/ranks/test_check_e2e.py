"""End to end on real gloo CPU ranks: healthy runs and real faults (crashes and hangs at
every stage are the fault matrix, test_fault_matrix.py).

Each test runs `ddpdoctor check` as a user would and asserts on its exit code, its
JSON report, its wall time against the deadline, and that no process or port is left.
"""

from __future__ import annotations

import os
import signal

import pytest

from .harness import assert_nothing_left, probe_section, run_check

pytestmark = pytest.mark.ranks

TIMEOUT = 6  # the per-stage deadline the fault tests run with


def _rank(report: dict, rank: int) -> dict:
    return next(r for r in report["ranks"] if r["rank"] == rank)


# 4 ranks (time-sharing 2 cores: HOM013) is the slow tier; 2 ranks cross the same path.
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_healthy_run_gives_no_false_alarm(tmp_path, nproc):
    """Case 2 stays default (every default probe and the DDP smoke on real ranks); case 4 is the slow tier:
    the same path, with 4 ranks time-sharing 2 cores (HOM013)."""
    run = run_check(tmp_path, "--nproc", str(nproc))
    assert run.returncode == 0, run.explain()
    # torch's "Failed to initialize NumPy" where numpy is absent (CI's fresh venv): not a line for our users.
    assert "NumPy" not in run.stderr, run.stderr
    report = run.report
    assert report["schema"] == "ddpdoctor.report/1"
    assert report["world_size"] == nproc and report["backend"] == "gloo"
    assert report["verdict"] == "ok" and report["exit_code"] == 0
    assert run.severities() <= {"ok", "info"}, run.explain()
    # 4 single-thread ranks on 2 cores time-share: their speeds are not compared (HOM013), not flagged.
    expected = (["DDP001", "GPU000", "HOM000"] + (["HOM013"] if nproc > (os.cpu_count() or 1) else [])
                + ["INIT000", "LIM000", "TOP009"])
    assert sorted(f["code"] for f in run.findings()) == expected, run.explain()
    assert all(r["state"] == "ok" for r in report["ranks"])
    smoke = probe_section(report, "ddp-smoke")
    assert smoke["name"] == "ddp-smoke" and smoke["status"] == "ok"
    assert [(p["name"], p["status"]) for p in report["probes"]] == [
        ("init-hang", "ok"), ("limits", "ok"), ("topology", "ok"), ("gpu-count", "ok"), ("homogeneity", "ok"),
        ("ddp-smoke", "ok")]
    # The healthy control of test_limits_e2e.py: the same machine without a limit set.
    assert run.findings("LIM000")[0]["severity"] == "ok", run.explain()
    init = probe_section(report, "init-hang")["facts"]
    assert all(f["resolved"] == ["127.0.0.1"] and f["route"]["source"] == "127.0.0.1" and f["init_s"] > 0
               for f in init.values())
    facts = smoke["facts"]
    assert sorted(facts) == [str(r) for r in range(nproc)]
    # Real training happened: the gradient hook ran every step and weights agree bit for bit.
    assert len({f["param_sha256"] for f in facts.values()}) == 1
    assert all(f["comm_calls"] >= 5 and len(f["steps"]) == 5 for f in facts.values())
    assert all(s["step_ms"] > 0 and s["comm_ms"] > 0 for f in facts.values() for s in f["steps"])
    assert "OK" in run.stdout.splitlines()[0]
    assert_nothing_left(run)


# A signal from outside, mid-hang, as a user's Ctrl-C or a scheduler's kill. The fault matrix
# (test_fault_matrix.py) signals the launcher at every stage; these are the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_stops_everything_and_reports(tmp_path, sig):
    """Default twin: tests/ranks/test_fault_matrix.py::test_fault_cell (its ("report", "sigint") cell: the
    same launcher signal handler, RUN006, exit 3 and the report written; here sent from outside mid-hang)
    """
    # Rank 1 hangs forever (deadline 60 s), so only the signal can end the run early.
    run = run_check(tmp_path, "--nproc", "2", "--timeout", "60", "--inject", "hang:rank=1:stage=train",
                    signal_after=(8.0, sig), timeout_s=90)
    assert run.returncode == 3, run.explain()
    interrupted = run.findings("RUN006")
    assert interrupted and interrupted[0]["evidence"]["signal"] == sig.name
    assert run.report["interrupted"] == sig.name
    assert run.wall_s < 60, run.explain()  # the hang's own deadline (60 s) never came into it
    assert "Traceback" not in run.stderr
    assert_nothing_left(run)


def test_slow_rank_is_really_slower_and_reported_as_injected(tmp_path):
    run = run_check(tmp_path, "--nproc", "2", "--inject", "slow:rank=1:factor=4")
    # Training still succeeds; the homogeneity probe measures the slower rank and warns.
    assert run.returncode == 1, run.explain()
    assert [f["ranks"] for f in run.findings() if f["severity"] == "warn"] == [[1]], run.explain()
    assert run.findings("HOM006")[0]["ranks"] == [1]
    facts = probe_section(run.report, "ddp-smoke")["facts"]
    slow = [s["step_ms"] for s in facts["1"]["steps"]]
    delays = [s["injected_delay_ms"] for s in facts["1"]["steps"]]
    assert all(d > 0 for d in delays) and all(s["injected_delay_ms"] == 0 for s in facts["0"]["steps"])
    # Each slow step really took at least its injected delay longer (a real sleep, timed).
    assert all(step >= delay for step, delay in zip(slow, delays))
    assert run.findings("RUN010")[0]["evidence"]["injected"] == ["slow:rank=1:factor=4"]
    assert_nothing_left(run)


def test_diverged_weights_are_caught(tmp_path):
    run = run_check(tmp_path, "--nproc", "3", "--inject", "diverge:rank=2")
    assert run.returncode == 2, run.explain()
    diverged = run.findings("DDP002")
    assert len(diverged) == 1 and diverged[0]["ranks"] == [2], run.explain()
    # The callback's comparison (judge/replicas.py) names the one tensor the fault moved: DDP averages the
    # same gradient into every replica, so the others stay equal.
    [tensor] = diverged[0]["evidence"]["tensors_differing"]
    assert tensor in diverged[0]["title"] and tensor.endswith("weight"), diverged[0]
    assert not run.findings("DDP001")
    assert_nothing_left(run)


def _latency_after_deadline(report: dict, rank: int, stage: str) -> float:
    """Seconds from the named rank entering `stage` plus the deadline to the report being made."""
    entered = next(t["started"] for t in _rank(report, rank)["timeline"] if t["name"] == stage)
    return report["started_at"] + report["duration_s"] - entered - TIMEOUT


@pytest.mark.slow
def test_a_rank_calling_another_collective_is_named_as_the_desync(tmp_path):
    """Default twin: tests/ranks/test_check_e2e.py::test_a_dtype_only_torchs_flight_recorder_saw_is_named_without_any_barrier
    (the same collective-mismatch judgement: RUN009 naming the minority rank of 3 from the ranks' calls and
    torch's Flight Recorder; here the mismatch hangs until the stage deadline, there it does not)
    """
    run = run_check(tmp_path, "--nproc", "3", "--timeout", str(TIMEOUT), "--inject", "desync:rank=1")
    assert run.returncode == 2, run.explain()
    desync = run.findings("RUN009")
    assert len(desync) == 1 and desync[0]["ranks"] == [1], run.explain()
    assert desync[0]["evidence"]["collective_by_rank"]["1"].startswith("barrier #")
    assert desync[0]["evidence"]["collective_by_rank"]["0"].startswith("ddp_gradient_allreduce #")
    assert "rank 1 is in barrier" in desync[0]["title"]
    # torch's own record of the stuck calls agrees: a barrier against DDP's bucket all-reduce.
    recorded = desync[0]["evidence"]["flight_recorder"]["calls"]
    assert recorded["1"].startswith("barrier #") and recorded["0"].startswith("all_reduce #"), recorded
    # The bar: reported no later than the deadline + 3 s after the rank stopped matching.
    assert _latency_after_deadline(run.report, 1, "train") <= 3.0, run.explain()
    assert_nothing_left(run)


# Slow tier: a rank that never arrives is also the fault matrix's launch-hang cell, the missing
# Slurm node (test_multinode_e2e.py) and the too-large world size (test_launch_modes.py).
@pytest.mark.slow
def test_a_rank_that_never_joins_is_named(tmp_path):
    """Default twin: tests/ranks/test_check_e2e.py::test_a_rank_that_cannot_reach_the_rendezvous_is_named_with_why
    (the same rendezvous deadline and RUN001 naming the missing rank; there it tried and failed to connect)
    """
    run = run_check(tmp_path, "--nproc", "3", "--timeout", str(TIMEOUT), "--inject", "noshow:rank=2")
    assert run.returncode == 2, run.explain()
    missing = run.findings("RUN001")
    assert len(missing) == 1 and missing[0]["ranks"] == [2], run.explain()
    assert _latency_after_deadline(run.report, 0, "rendezvous") <= 3.0, run.explain()
    assert_nothing_left(run)


@pytest.mark.parametrize("fault, cause", [
    ("badport", "connection refused at 127.0.0.1:"),
    # test_unresolvable_master_addr_is_one_line (launch_modes) crosses the resolver too: slow tier.
    pytest.param("badaddr", "MASTER_ADDR='ddpdoctor-injected-badaddr.invalid' does not resolve",
                 marks=pytest.mark.slow),
])
def test_a_rank_that_cannot_reach_the_rendezvous_is_named_with_why(tmp_path, fault, cause):
    """Case badport stays default (a refused connection, RUN001 with why); badaddr is the slow tier:
    the same path, and the resolver's error is crossed by test_unresolvable_master_addr_is_one_line."""
    run = run_check(tmp_path, "--nproc", "2", "--timeout", str(TIMEOUT), "--inject", f"{fault}:rank=1")
    assert run.returncode == 2, run.explain()
    missing = run.findings("RUN001")
    assert len(missing) == 1 and missing[0]["ranks"] == [1], run.explain()
    assert missing[0]["evidence"]["why_not_arrived"]["1"].startswith(cause), run.explain()
    assert cause in missing[0]["title"]
    # The ranks that did arrive published how they got there before waiting on rank 1.
    assert sorted(probe_section(run.report, "init-hang")["facts"]) == ["0"]
    assert _latency_after_deadline(run.report, 0, "rendezvous") <= 3.0, run.explain()
    assert_nothing_left(run)


def test_a_dtype_only_torchs_flight_recorder_saw_is_named_without_any_barrier(tmp_path):
    """gloo reduces the same byte count in float64 on one rank and float32 on the others without
    a word (the weights still agree); only the ranks' Flight Recorders, compared afterwards, differ."""
    run = run_check(tmp_path, "--nproc", "3", "--inject", "dtype:rank=1")
    assert run.returncode == 2, run.explain()
    desync = run.findings("RUN009")
    assert len(desync) == 1 and desync[0]["ranks"] == [1], run.explain()
    recorded = desync[0]["evidence"]["flight_recorder"]
    assert recorded["differs_in"] == "shapes and dtypes"
    assert recorded["calls"]["1"].endswith("(in [24] Double)") and recorded["calls"]["0"].endswith("(in [48] Float)")
    assert run.findings("DDP001"), "the training itself was fine: only the metrics all-reduce disagreed"
    assert_nothing_left(run)


@pytest.mark.slow
def test_a_rank_stuck_inside_the_collective_before_the_backend_is_named_not_the_network(tmp_path):
    """Default twin: tests/ranks/test_fault_matrix.py::test_fault_cell (its ("train", "hang") cell: the same
    train-stage deadline and RUN004 naming the stuck rank alone by its `_hang_forever` stack, rank 0 its
    victim; here stuck inside the collective, told apart with torch's Flight Recorder as the dtype test
    of this file reads it)
    """
    run = run_check(tmp_path, "--nproc", "3", "--timeout", str(TIMEOUT), "--inject", "hang:rank=1:stage=collective")
    assert run.returncode == 2, run.explain()
    stuck = run.findings("RUN004")
    assert len(stuck) == 1 and stuck[0]["ranks"] == [1], run.explain()
    assert "never handed all_reduce #" in stuck[0]["title"]
    assert stuck[0]["evidence"]["flight_recorder"]["calls"]["1"].startswith("not reached")
    assert any("_hang_forever" in line for line in stuck[0]["evidence"]["python_stack_rank_1"])
    assert not run.findings("RUN008"), "not the transport"
    assert _latency_after_deadline(run.report, 1, "train") <= 3.0, run.explain()
    assert_nothing_left(run)
