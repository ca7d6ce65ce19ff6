"""ddpdoctor.judge.run_diagnosis on hand-made RunRecords, and the ddpdoctor.core.findings helpers.

The records are filled the way the channel and the standalone launcher fill them:
hello/timeline/error/timeout values are the JSON the ranks publish, exits are ExitInfo.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdoctor.core.findings import (EXIT_CRITICAL, EXIT_OK, EXIT_WARNING, Finding, Severity, exit_code_for,
                                rank_ranges)
from ddpdoctor.runtime.inject import INJECTED_CRASH_EXIT
from ddpdoctor.judge.run_diagnosis import diagnose_run, rank_fates
from ddpdoctor.core.run_record import ExitInfo, RunRecord

T0 = 1_700_000_000.0
STACK = ('Thread 0x7f00 (most recent call first):\n'
         '  File "/usr/lib/python3.11/site-packages/ddpdoctor/workload.py", line 494 in run_workload\n'
         '  File "/usr/lib/python3.11/site-packages/ddpdoctor/probes/ddp_smoke.py", line 26 in collect\n')


def hello(rank: int, world: int, host: str = "node-a", **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "host": host, "pid": 4000 + rank, "local_rank": rank, "local_world_size": world,
            "world_size": world, "mode": "ddpdoctor", "cuda_devices": 0, "t": T0 + 1.0, "torch": "2.13.0",
            **extra}


def timeline(upto: str, status: str = "ok") -> list[dict[str, Any]]:
    """The stages a rank entered, ending in `upto` with `status` (nested workload stages included)."""
    order = ["rendezvous", "init", "probe:ddp-smoke", "ddp", "train", "verify", "report"]
    entries = []
    for i, name in enumerate(order[: order.index(upto) + 1]):
        last = name == upto
        enclosing = name == "probe:ddp-smoke" and upto in ("ddp", "train", "verify")
        st_ = status if last else ("running" if enclosing and status != "ok" else "ok")
        entries.append({"name": name, "started": T0 + 1 + i, "ended": None if st_ == "running" else T0 + 2 + i,
                        "status": st_, "detail": ""})
    return entries


def heartbeat(stage: str, t: float, collective: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"t": t, "stage": stage, "stage_started": t - 1, "collective": collective, "seq": 3}


def timeout(stage: str, collective: Optional[dict[str, Any]], t: float = T0 + 35) -> dict[str, Any]:
    return {"stage": stage, "deadline_s": 30.0, "t": t, "collective": collective,
            "seq": (collective or {}).get("seq", 0), "stack": STACK}


def allreduce(seq: int = 7, step: int = 2) -> dict[str, Any]:
    return {"op": "ddp_gradient_allreduce", "seq": seq, "step": step}


def make_record(world: int, **fields: Any) -> RunRecord:
    record = RunRecord(world_size=world, mode="ddpdoctor", probes=("ddp-smoke",), started=T0,
                       ended=T0 + 40, default_host="node-a")
    record.hellos = {r: hello(r, world, host=f"node-{'ab'[r % 2]}") for r in range(world)}
    record.heartbeats = {r: heartbeat("report", T0 + 10) for r in range(world)}
    record.timelines = {r: timeline("report") for r in range(world)}
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def healthy(world: int = 2) -> RunRecord:
    return make_record(world, done=set(range(world)), exits={r: ExitInfo(0, t=T0 + 12) for r in range(world)})


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def critical(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == Severity.CRITICAL]


def assert_jsonable(findings: list[Finding]) -> None:
    json.dumps([f.to_json() for f in findings], allow_nan=False)


# == healthy ========================================================================

@pytest.mark.parametrize("world", [1, 2, 4])
def test_healthy_run_has_nothing_above_info(world):
    record = healthy(world)
    findings = diagnose_run(record)
    assert all(f.severity <= Severity.INFO for f in findings), codes(findings)
    assert {f.kind for f in rank_fates(record).values()} == {"ok"}
    assert exit_code_for(f.severity for f in findings) == EXIT_OK


def test_healthy_run_under_torchrun_without_exit_info():
    record = make_record(2, done={0, 1}, mode="torchrun")
    assert diagnose_run(record) == []


# == crashes: RUN002 ==================================================================

def _crash_with_victim(code: int = INJECTED_CRASH_EXIT, signal: Optional[str] = None,
                       faults: tuple[str, ...] = ("crash:rank=1:stage=train",)) -> RunRecord:
    return make_record(
        2,
        timelines={0: timeline("train", "timeout"), 1: timeline("train", "running")},
        heartbeats={0: heartbeat("train", T0 + 34, allreduce()), 1: heartbeat("train", T0 + 5)},
        timeouts={0: timeout("train", allreduce())},
        exits={1: ExitInfo(code, signal=signal, t=T0 + 5.2,
                           log_tail=["ddpdoctor: injected crash on rank 1 in stage train"]),
               0: ExitInfo(124, t=T0 + 35.1)},
        faults=faults,
    )


def test_crashed_rank_is_the_one_critical_and_the_waiting_rank_is_only_affected():
    findings = diagnose_run(_crash_with_victim())
    crit = critical(findings)
    assert codes(crit) == ["RUN002"]
    crash = crit[0]
    assert crash.ranks == (1,)
    assert crash.nodes == ("node-b",)
    assert "rank 1 (node-b)" in crash.title and "stage train" in crash.title
    assert "exit code 86" in crash.title and "[injected]" in crash.title
    assert crash.evidence["stage"] == "train"
    assert crash.evidence["exit_code"] == 86 and crash.evidence["injected"] is True
    assert crash.evidence["last_output"] == ["ddpdoctor: injected crash on rank 1 in stage train"]
    assert "log_tail" not in crash.evidence
    assert set(crash.evidence["affected_ranks"]) == {"0"}
    assert "ddp_gradient_allreduce #7" in crash.evidence["affected_ranks"]["0"]
    assert "step=2" in crash.evidence["affected_ranks"]["0"]
    # rank 0 appears in no finding of its own
    assert not [f for f in findings if 0 in f.ranks]
    assert codes(findings) == ["RUN010", "RUN002"]
    assert_jsonable(findings)


def test_crash_that_was_not_injected_says_so():
    findings = diagnose_run(_crash_with_victim(code=1, faults=()))
    crash, = critical(findings)
    assert "exit code 1" in crash.title and "[injected]" not in crash.title
    assert "injected" not in crash.evidence
    assert "RUN010" not in codes(findings)


def test_sigkill_is_named_and_points_at_out_of_memory():
    findings = diagnose_run(_crash_with_victim(code=-9, signal="SIGKILL", faults=()))
    crash, = critical(findings)
    assert crash.code == "RUN002" and crash.ranks == (1,)
    assert crash.evidence["signal"] == "SIGKILL"
    assert crash.evidence["exit_code"] == -9
    assert "(SIGKILL)" in crash.title
    assert "out-of-memory" in crash.why
    assert "dmesg" in crash.fix


def test_unknown_negative_exit_is_still_a_crash_with_its_signal_number():
    findings = diagnose_run(_crash_with_victim(code=-200, faults=()))
    crash, = critical(findings)
    assert crash.evidence["signal"] == "signal 200"


def test_two_crashes_are_listed_first_one_first():
    record = make_record(
        3,
        timelines={r: timeline("train", "running") for r in range(3)},
        exits={0: ExitInfo(-11, signal="SIGSEGV", t=T0 + 9), 1: ExitInfo(1, t=T0 + 4), 2: ExitInfo(0, t=T0 + 12)},
        done={2},
    )
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN002", "RUN002"]
    assert [f.ranks for f in findings] == [(1,), (0,)]


def test_the_same_crash_on_several_ranks_is_one_finding_naming_them_all():
    """Issue 51: every rank's DDP constructor died of SIGSEGV, and the report said it once a rank."""
    record = make_record(
        3,
        timelines={r: timeline("ddp", "running") for r in range(3)},
        exits={r: ExitInfo(-11, signal="SIGSEGV", t=T0 + 4 + r, log_tail=[f"Fatal Python error on rank {r}"])
               for r in range(3)},
    )
    crash, = critical(diagnose_run(record))
    assert crash.code == "RUN002" and crash.ranks == (0, 1, 2) and crash.nodes == ("node-a", "node-b")
    assert crash.title.startswith("ranks 0-2 (node-a, node-b) crashed in stage ddp (SIGSEGV)"), crash.title
    assert crash.evidence["same_on_ranks"] == "0-2" and crash.evidence["last_output"] == ["Fatal Python error on rank 0"]


def test_the_same_error_but_for_its_numbers_is_one_cause_another_error_is_another():
    def error(message: str, t: float) -> dict[str, Any]:
        return {"stage": "init", "t": t, "type": "RuntimeError", "message": message, "traceback": ""}

    record = make_record(
        3, timelines={r: timeline("init", "error") for r in range(3)},
        errors={0: error("Connection reset by peer [127.0.0.1]:40011", T0 + 3),
                1: error("Connection reset by peer [127.0.0.1]:40017", T0 + 4),
                2: error("unsupported device type", T0 + 5)},
        exits={r: ExitInfo(1, t=T0 + 6) for r in range(3)})
    found = critical(diagnose_run(record))
    assert [(f.code, f.ranks) for f in found] == [("RUN003", (0, 1)), ("RUN003", (2,))]


def test_rank_found_dead_by_the_reporter_is_a_crash():
    record = make_record(2, mode="torchrun", timelines={0: timeline("report"), 1: timeline("train", "running")},
                         done={0}, dead={1: "its process had ended, without an error"})
    crash, = critical(diagnose_run(record))
    assert crash.code == "RUN002" and crash.ranks == (1,)
    assert "process gone" in crash.title
    assert crash.evidence["note"].startswith("its process had ended")


# == errors and hangs: RUN003 / RUN004 / RUN005 ======================================

def test_error_outside_a_collective_is_run003_with_its_message():
    record = make_record(
        2,
        timelines={0: timeline("init", "error"), 1: timeline("init", "timeout")},
        errors={0: {"stage": "init", "t": T0 + 3, "type": "RuntimeError",
                    "message": "the NCCL backend is not available in this torch build; use --backend gloo",
                    "traceback": "Traceback (most recent call last):\n  ...\nRuntimeError: the NCCL backend",
                    "collective": None}},
        timeouts={1: timeout("init", {"op": "init_process_group", "seq": 2, "backend": "nccl"})},
    )
    findings = diagnose_run(record)
    err, = critical(findings)
    assert err.code == "RUN003" and err.ranks == (0,)
    assert "RuntimeError: the NCCL backend is not available" in err.title
    assert err.evidence["traceback"][-1] == "RuntimeError: the NCCL backend"
    assert "init_process_group #2 (backend=nccl)" in err.evidence["affected_ranks"]["1"]


def test_rank_hung_outside_a_collective_is_the_only_cause():
    record = make_record(
        3,
        timelines={r: timeline("train", "timeout") for r in range(3)},
        timeouts={0: timeout("train", allreduce(), t=T0 + 36),
                  1: timeout("train", None, t=T0 + 35.5),
                  2: timeout("train", allreduce(), t=T0 + 36.2)},
        exits={r: ExitInfo(124, t=T0 + 36.5) for r in range(3)},
    )
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN004"]
    hang = findings[0]
    assert hang.severity == Severity.CRITICAL
    assert hang.ranks == (1,)
    assert "rank 1 (node-b) hung in stage train, outside any collective" in hang.title
    assert "the others waited for it" in hang.title
    assert hang.evidence["deadline_s"] == 30.0
    assert any("workload.py" in line for line in hang.evidence["python_stack"])
    assert set(hang.evidence["affected_ranks"]) == {"0", "2"}


def test_lone_hang_does_not_claim_others_waited():
    record = make_record(1, timelines={0: timeline("verify", "timeout")}, timeouts={0: timeout("verify", None)})
    hang, = diagnose_run(record)
    assert hang.code == "RUN004" and "the others waited" not in hang.title
    assert hang.evidence["affected_ranks"] == {}


def test_rank_stopped_by_the_launcher_for_silence_is_run005():
    record = make_record(
        2,
        timelines={0: timeline("report"), 1: timeline("train", "running")},
        heartbeats={0: heartbeat("report", T0 + 20), 1: heartbeat("train", T0 + 6)},
        done={0},
        exits={0: ExitInfo(0, t=T0 + 21),
               1: ExitInfo(-9, t=T0 + 22, killed_by_us="silent: no heartbeat for 16.0s")},
    )
    silent, = critical(diagnose_run(record))
    assert silent.code == "RUN005" and silent.ranks == (1,)
    assert "stopped answering in stage train" in silent.title
    assert silent.evidence["reason"] == "silent: no heartbeat for 16.0s"


# == collective hangs: RUN008 / RUN009 ==================================================

def test_every_rank_stuck_in_the_same_collective_is_run008():
    record = make_record(
        2,
        timelines={r: timeline("train", "timeout") for r in range(2)},
        timeouts={0: timeout("train", allreduce(seq=5, step=0)), 1: timeout("train", allreduce(seq=5, step=0))},
    )
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN008"]
    hang = findings[0]
    assert hang.severity == Severity.CRITICAL
    assert hang.ranks == (0, 1) and hang.nodes == ("node-a", "node-b")
    assert "ddp_gradient_allreduce" in hang.title
    assert hang.evidence["state_by_rank"] == {"0": "timeout", "1": "timeout"}
    assert hang.evidence["collective_by_rank"]["1"] == "ddp_gradient_allreduce #5 (step=0)"


def test_transport_errors_inside_one_collective_are_run008_with_the_errors():
    err = {"stage": "train", "t": T0 + 8, "type": "RuntimeError", "message": "Connection closed by peer",
           "traceback": "", "collective": allreduce(seq=4, step=1)}
    record = make_record(2, timelines={r: timeline("train", "error") for r in range(2)},
                         errors={0: err, 1: dict(err, t=T0 + 8.1)})
    hang, = diagnose_run(record)
    assert hang.code == "RUN008"
    assert hang.evidence["errors"] == {"0": "RuntimeError: Connection closed by peer",
                                       "1": "RuntimeError: Connection closed by peer"}


def test_ranks_in_different_collectives_is_a_desync_naming_the_odd_rank():
    record = make_record(
        4,
        timelines={r: timeline("train", "timeout") for r in range(4)},
        timeouts={0: timeout("train", {"op": "barrier", "seq": 9}),
                  1: timeout("train", {"op": "all_reduce", "seq": 9}),
                  2: timeout("train", {"op": "all_reduce", "seq": 9}),
                  3: timeout("train", {"op": "all_reduce", "seq": 9})},
    )
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN009"]
    desync = findings[0]
    assert desync.severity == Severity.CRITICAL
    assert desync.ranks == (0,) and desync.nodes == ("node-a",)
    assert desync.title == ("Collective mismatch (desync): rank 0 is in barrier #9, while rank 1-3 are in "
                            "all_reduce #9")
    assert desync.evidence["collective_by_rank"]["0"] == "barrier #9"
    assert desync.evidence["waiting_ranks"] == "0-3"


def test_a_desync_with_no_majority_names_every_rank():
    record = make_record(
        2,
        timelines={r: timeline("train", "timeout") for r in range(2)},
        timeouts={0: timeout("train", {"op": "barrier", "seq": 4}), 1: timeout("train", {"op": "all_reduce", "seq": 4})},
    )
    desync = diagnose_run(record)[0]
    assert desync.code == "RUN009" and desync.ranks == (0, 1)
    assert desync.title == "Collective mismatch (desync): rank 0 in barrier #4; rank 1 in all_reduce #4"


def test_same_op_at_different_sequence_numbers_is_a_desync_too():
    # One rank skipped a collective: it is already at the next one.
    record = make_record(
        3,
        timelines={r: timeline("train", "timeout") for r in range(3)},
        timeouts={0: timeout("train", {"op": "all_reduce", "seq": 7}), 1: timeout("train", {"op": "all_reduce", "seq": 7}),
                  2: timeout("train", {"op": "all_reduce", "seq": 8})},
    )
    desync = diagnose_run(record)[0]
    assert desync.code == "RUN009" and desync.ranks == (2,)
    assert "rank 2 is in all_reduce #8, while rank 0-1 are in all_reduce #7" in desync.title


# == arrival, world size, interruption, injection ========================================

def test_missing_rank_is_run001_with_counts_and_the_waiting_ranks_affected():
    record = make_record(
        3, mode="torchrun",
        timelines={0: timeline("rendezvous", "timeout"), 1: timeline("rendezvous", "timeout")},
        timeouts={0: timeout("rendezvous", {"op": "rendezvous", "seq": 1}),
                  1: timeout("rendezvous", {"op": "rendezvous", "seq": 1})},
    )
    del record.hellos[2], record.heartbeats[2]
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN001"]
    missing = findings[0]
    assert missing.severity == Severity.CRITICAL
    assert missing.ranks == (2,)
    assert "Rank 2 never arrived (2 of 3 ranks connected)" == missing.title
    assert missing.evidence["arrived_ranks"] == "0-1"
    assert missing.evidence["expected_world_size"] == 3
    assert missing.evidence["arrived_hosts"] == ["node-a", "node-b"]
    assert set(missing.evidence["affected_ranks"]) == {"0", "1"}
    assert rank_fates(record)[2].kind == "missing"


def test_missing_rank_reported_by_the_orderly_rendezvous_error_is_run001_only():
    # The waiting ranks give up inside the rendezvous collective with an error of their own.
    err = {"stage": "rendezvous", "t": T0 + 24, "type": "RuntimeError",
           "message": "ranks [2] did not arrive within 24s (2 of 3 arrived)", "traceback": "",
           "collective": {"op": "rendezvous", "seq": 1}}
    record = make_record(3, mode="torchrun",
                         timelines={0: timeline("rendezvous", "error"), 1: timeline("rendezvous", "error")},
                         errors={0: err, 1: dict(err, t=T0 + 24.1)})
    del record.hellos[2], record.heartbeats[2]
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN001"]
    assert findings[0].ranks == (2,)
    assert set(findings[0].evidence["affected_ranks"]) == {"0", "1"}
    assert findings[0].evidence["affected_ranks"]["0"].startswith("error in rendezvous waiting in rendezvous #1")


@pytest.mark.parametrize("said, title_end, fix_word", [
    ("ddpdoctor: rank 2 on node-a could not reach the rendezvous store at 10.0.0.1:29511 within 21s: connection "
     "refused at 10.0.0.1:29511 (nothing listens there: rank 0 is not running, or it listens on another port; "
     "compare MASTER_PORT on every node)", ": connection refused at 10.0.0.1:29511", "MASTER_PORT"),
    ("ddpdoctor: rank 2 on node-a could not reach the rendezvous store at 10.0.0.1:29500 within 21s: no answer "
     "from 10.0.0.1:29500 (a firewall drops the packets, or MASTER_ADDR is not the host where rank 0 runs)",
     ": no answer from 10.0.0.1:29500", "nc -zv"),
    ("ddpdoctor: error: MASTER_ADDR='head-node' does not resolve on node-a (Name or service not known): use an "
     "address every node can resolve, e.g. the first node's IP", ": MASTER_ADDR='head-node' does not resolve on node-a",
     "getent hosts"),
])
def test_a_rank_that_said_why_it_could_not_arrive_is_run001_with_its_reason(said, title_end, fix_word):
    # The standalone launcher saw the rank exit before its hello, with this line as its last output.
    err = {"stage": "rendezvous", "t": T0 + 24, "type": "RuntimeError",
           "message": "ranks [2] did not arrive within 24s (2 of 3 arrived)", "traceback": "",
           "collective": {"op": "rendezvous", "seq": 1}}
    record = make_record(3, timelines={0: timeline("rendezvous", "error"), 1: timeline("rendezvous", "error")},
                         errors={0: err, 1: dict(err, t=T0 + 24.1)},
                         exits={2: ExitInfo(2 if "reach" in said else 3, t=T0 + 21, log_tail=["noise", said])})
    del record.hellos[2], record.heartbeats[2]
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN001"]
    missing = findings[0]
    assert missing.ranks == (2,) and missing.title.endswith(title_end)
    reason = missing.evidence["why_not_arrived"]["2"]
    assert reason.startswith(title_end[2:]) and said.endswith(reason)
    assert fix_word in missing.fix and "last_output_rank_2" not in missing.evidence


def test_a_rank_that_crashed_before_arriving_stays_a_crash_with_its_output():
    record = make_record(3, exits={2: ExitInfo(1, t=T0 + 5, log_tail=["ImportError: No module named 'apex'"])})
    del record.hellos[2], record.heartbeats[2]
    fate = rank_fates(record)[2]
    assert fate.kind == "crash" and fate.detail["exit_code"] == 1


def test_no_rank_arrived():
    record = make_record(2, mode="slurm", hellos={}, heartbeats={}, timelines={})
    missing, = diagnose_run(record)
    assert missing.code == "RUN001" and missing.ranks == (0, 1)
    assert "(0 of 2 ranks connected)" in missing.title
    assert missing.evidence["arrived_ranks"] == "none"


def test_world_size_disagreement_is_run007_on_the_odd_rank():
    record = healthy(3)
    record.hellos[1] = hello(1, 4, host="node-b")
    findings = diagnose_run(record)
    odd, = critical(findings)
    assert odd.code == "RUN007" and odd.ranks == (1,) and odd.nodes == ("node-b",)
    assert odd.evidence["expected"] == 3
    assert odd.evidence["world_size_by_rank"] == {0: 3, 1: 4, 2: 3}


def test_interrupted_run_is_run006_and_nothing_else():
    record = make_record(
        2,
        timelines={r: timeline("train", "running") for r in range(2)},
        heartbeats={r: heartbeat("train", T0 + 6, allreduce()) for r in range(2)},
        exits={r: ExitInfo(-15, t=T0 + 7, killed_by_us="interrupted by SIGINT") for r in range(2)},
        interrupted="SIGINT",
    )
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN006"]
    stop = findings[0]
    assert stop.severity == Severity.CRITICAL
    assert "interrupted by SIGINT" in stop.title
    assert stop.ranks == (0, 1)
    assert stop.evidence["signal"] == "SIGINT"
    assert stop.evidence["stage_by_rank"] == {0: "train", 1: "train"}
    assert {f.kind for f in rank_fates(record).values()} == {"interrupted"}


def test_injected_faults_are_an_info_finding():
    record = healthy(2)
    record.faults = ("slow:rank=1:factor=4", "diverge:rank=0")
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN010"]
    info = findings[0]
    assert info.severity == Severity.INFO
    assert info.evidence["injected"] == ["slow:rank=1:factor=4", "diverge:rank=0"]
    assert "slow:rank=1:factor=4, diverge:rank=0" in info.title
    assert exit_code_for(f.severity for f in findings) == EXIT_OK


def test_last_stage_is_the_first_unfinished_one_from_the_end():
    record = make_record(1, timelines={0: timeline("train", "timeout")})
    assert record.last_stage(0) == "train"
    record.timelines[0] = timeline("verify")
    assert record.last_stage(0) == "verify"
    record.timelines = {}
    assert record.last_stage(0) == "launch"
    assert record.host(0) == "node-a"
    record.hellos = {}
    record.default_host = "?"
    assert record.host(0) == "?"


# == findings helpers ===================================================================

@pytest.mark.parametrize("severities, code", [
    ([], EXIT_OK),
    ([Severity.OK], EXIT_OK),
    ([Severity.OK, Severity.INFO], EXIT_OK),
    ([Severity.INFO, Severity.WARN, Severity.OK], EXIT_WARNING),
    ([Severity.WARN, Severity.CRITICAL, Severity.INFO], EXIT_CRITICAL),
    ([Severity.CRITICAL], EXIT_CRITICAL),
])
def test_exit_code_for_follows_nagios(severities, code):
    assert (EXIT_OK, EXIT_WARNING, EXIT_CRITICAL) == (0, 1, 2)
    assert exit_code_for(severities) == code
    assert exit_code_for(iter(severities)) == code  # a generator works too


@pytest.mark.parametrize("ranks, text", [
    ([0, 1, 2, 3, 6], "0-3,6"),
    ([6, 3, 2, 1, 0, 3], "0-3,6"),
    ([], ""),
    ([5], "5"),
    ([0, 2, 4], "0,2,4"),
    ([1, 2, 4, 5, 7, 8, 9], "1-2,4-5,7-9"),
    (range(1000), "0-999"),
])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def _expand(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@settings(database=None, deadline=None, max_examples=100)
@given(st.sets(st.integers(0, 300)))
def test_rank_ranges_expands_back_to_the_same_ranks(ranks):
    assert _expand(rank_ranges(ranks)) == sorted(ranks)


def test_severity_labels_and_order():
    assert [s.label for s in Severity] == ["ok", "info", "warn", "critical"]
    assert Severity.parse("WARN") is Severity.WARN
    assert Severity.OK < Severity.INFO < Severity.WARN < Severity.CRITICAL


def test_finding_json_round_trip():
    finding = Finding(code="RUN002", severity=Severity.CRITICAL, title="rank 1 (n1) crashed", probe="run",
                      ranks=(1, 3), nodes=("n1",), evidence={"exit_code": 86, "affected_ranks": {"0": "timeout"}},
                      fix="fix it", why="because")
    data = finding.to_json()
    assert data["severity"] == "critical" and data["ranks"] == [1, 3]
    assert Finding.from_json(data) == finding
    assert Finding.from_json(json.loads(json.dumps(data))) == finding


def test_finding_from_minimal_json():
    finding = Finding.from_json({"code": "X1", "severity": "info", "title": "t", "probe": "p"})
    assert finding == Finding(code="X1", severity=Severity.INFO, title="t", probe="p")


_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=10))


@settings(database=None, deadline=None, max_examples=100)
@given(code=st.from_regex(r"[A-Z]{3}[0-9]{3}", fullmatch=True), severity=st.sampled_from(list(Severity)),
       title=st.text(max_size=30), ranks=st.lists(st.integers(0, 4096), max_size=5).map(tuple),
       nodes=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
       evidence=st.dictionaries(st.text(max_size=8), _JSON_LEAF, max_size=4))
def test_finding_round_trips_through_json_text(code, severity, title, ranks, nodes, evidence):
    finding = Finding(code=code, severity=severity, title=title, probe="ddp-smoke", ranks=ranks, nodes=nodes,
                      evidence=evidence, fix="f", why="w")
    assert Finding.from_json(json.loads(json.dumps(finding.to_json()))) == finding


# == torch's Flight Recorder, read live by each rank ======================================

def fr_entry(seq: int, op: str, sizes: list, dtypes: list, pg: str = "0") -> dict[str, Any]:
    """An entry as fr_snapshot.take keeps it (torch's own keys, from _dump_fr_trace)."""
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "process_group": [pg, "default_pg"],
            "input_sizes": sizes, "input_dtypes": dtypes, "output_sizes": sizes, "state": "scheduled",
            "is_p2p": False}


def fr_run(world: int, odd: dict[int, dict[str, Any]], upto: int = 6) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(world):
        entries = [fr_entry(s, "all_reduce", [[399370]], ["Float"]) for s in range(1, upto + 1)]
        if r in odd:
            entries[3] = dict(entries[3], **odd[r])
        out[r] = {"version": "2.10", "entries": entries}
    return out


def test_a_dtype_disagreement_only_torch_recorded_is_run009_on_the_odd_rank():
    # Every rank finished (gloo reduced equal byte counts without a word); the record disagrees at #4.
    record = healthy(3)
    record.flight_recorder = fr_run(3, {1: {"input_sizes": [[24]], "input_dtypes": ["Double"]}})
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN009"]
    desync = findings[0]
    assert desync.ranks == (1,) and "in torch's Flight Recorder" in desync.title
    assert "rank 1 called all_reduce #4 (in [24] Double), while rank 0,2 called all_reduce #4 (in [399370] Float)" \
        in desync.title
    assert desync.evidence["flight_recorder"]["differs_in"] == "shapes and dtypes"


def test_agreeing_records_and_a_rank_that_only_stopped_earlier_are_not_a_mismatch():
    record = healthy(3)
    record.flight_recorder = fr_run(3, {})
    assert codes(diagnose_run(record)) == []
    record.flight_recorder[2]["entries"] = record.flight_recorder[2]["entries"][:4]  # stopped after #4
    assert codes(diagnose_run(record)) == []
    record.flight_recorder[0] = {"unknown": "the Flight Recorder holds no collective yet"}
    assert codes(diagnose_run(record)) == []


def test_a_hang_our_marks_call_one_collective_becomes_a_desync_when_torch_saw_other_shapes():
    t = {"op": "ddp_gradient_allreduce", "seq": 4, "step": 0}
    record = make_record(2, timelines={r: timeline("train", "timeout") for r in range(2)},
                         timeouts={r: timeout("train", t) for r in range(2)})
    assert codes(diagnose_run(record)) == ["RUN008"]
    record.flight_recorder = fr_run(2, {0: {"input_sizes": [[399371]]}}, upto=4)
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN009"] and findings[0].evidence["flight_recorder"]["differs_in"] == "shapes"
    assert findings[0].evidence["state_by_rank"] == {"0": "timeout", "1": "timeout"}  # our marks kept too


def test_a_rank_that_never_handed_the_collective_to_the_backend_is_the_stuck_one():
    # Our marks: every rank timed out inside the same gradient all-reduce. torch's record: ranks 0 and 2
    # issued #4, rank 1 stopped at #3, so rank 1 is stuck in its own code before the call.
    t = {"op": "ddp_gradient_allreduce", "seq": 4, "step": 0}
    record = make_record(3, timelines={r: timeline("train", "timeout") for r in range(3)},
                         timeouts={r: timeout("train", t) for r in range(3)})
    record.flight_recorder = fr_run(3, {}, upto=4)
    record.flight_recorder[1]["entries"] = record.flight_recorder[1]["entries"][:3]
    findings = diagnose_run(record)
    assert codes(findings) == ["RUN004"]
    stuck = findings[0]
    assert stuck.ranks == (1,) and "never handed all_reduce #4 to the backend" in stuck.title
    assert stuck.evidence["flight_recorder"]["calls"]["1"] == "not reached (last #3)"
    assert stuck.evidence["waiting_ranks"] == "0,2" and stuck.evidence["python_stack_rank_1"]


def test_a_transport_hang_shows_each_hosts_interface_and_a_recorder_that_was_off():
    t = {"op": "ddp_gradient_allreduce", "seq": 4, "step": 0}
    record = make_record(2, timelines={r: timeline("train", "timeout") for r in range(2)},
                         timeouts={r: timeout("train", t) for r in range(2)})
    record.results = {"init-hang": {
        0: {"route": {"interface": "eth0"}, "socket_ifname": {"NCCL_SOCKET_IFNAME": {"value": "eth", "selects": ["eth0"]}}},
        1: {"route": {"interface": "ib0"}, "socket_ifname": {}}}}
    record.flight_recorder = fr_run(2, {}, upto=4)
    record.flight_recorder[1] = {"unknown": "the Flight Recorder is turned off (TORCH_FR_BUFFER_SIZE=0)", "off": True}
    hang, = diagnose_run(record)
    assert hang.code == "RUN008"
    assert hang.evidence["network"] == {"node-a": "route to MASTER_ADDR via eth0; NCCL_SOCKET_IFNAME=eth (selects eth0)",
                                        "node-b": "route to MASTER_ADDR via ib0"}
    assert "TORCH_FR_BUFFER_SIZE=2000" in hang.evidence["flight_recorder_off"]["1"]


def test_a_rank_one_call_behind_but_inside_torch_is_the_transport_not_its_own_code():
    # gloo never marks a call completed: a ring whose last receive never came leaves the rank
    # one call behind too. Its stack (inside torch) says it is in the backend: RUN008, no blame.
    t = {"op": "allreduce_sweep", "seq": 4}
    in_torch = ('Thread MainThread:\n  File "/job/ddpdoctor/probes/allreduce.py", line 57 in collect\n'
                '  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce\n')
    record = make_record(3, timelines={r: timeline("train", "timeout") for r in range(3)},
                         timeouts={r: dict(timeout("train", t), stack=in_torch) for r in range(3)})
    record.flight_recorder = fr_run(3, {}, upto=5)
    record.flight_recorder[1]["entries"] = record.flight_recorder[1]["entries"][:4]
    assert codes(diagnose_run(record)) == ["RUN008"]


def test_junk_in_the_published_facts_never_loses_the_run_findings():
    t = {"op": "ddp_gradient_allreduce", "seq": 4, "step": 0}
    record = make_record(2, timelines={r: timeline("train", "timeout") for r in range(2)},
                         timeouts={r: timeout("train", t) for r in range(2)})
    record.results = {"init-hang": {0: "not a dict", 1: {"route": "eth0", "socket_ifname": {"X": "y"}}}}
    record.flight_recorder = {0: ["junk"], 1: {"entries": "junk"}}
    assert codes(diagnose_run(record)) == ["RUN008"]


def test_recorder_windows_subgroups_and_nccl_names_give_no_false_mismatch():
    record = healthy(3)
    record.flight_recorder = fr_run(3, {}, upto=70)
    # Ring buffers kept different windows (rank 2 holds only the last 64 calls).
    record.flight_recorder[2]["entries"] = record.flight_recorder[2]["entries"][-64:]
    # A subgroup of ranks 0 and 1 only (the allreduce probe's pairs): rank 2 has no such group.
    for r in (0, 1):
        record.flight_recorder[r]["entries"] += [fr_entry(s, "all_reduce", [[1024]], ["Float"], pg="3")
                                                  for s in range(1, 6)]
    # NCCL names its calls "nccl:all_reduce", gloo "gloo:all_reduce": the op is the same.
    record.flight_recorder[1]["entries"] = [dict(e, profiling_name=e["profiling_name"].replace("gloo:", "nccl:"))
                                            for e in record.flight_recorder[1]["entries"]]
    assert codes(diagnose_run(record)) == []
    # ...and a real difference inside the subgroup is still found.
    record.flight_recorder[1]["entries"][-1]["input_sizes"] = [[2048]]
    desync, = diagnose_run(record)
    assert desync.code == "RUN009" and desync.evidence["flight_recorder"]["process_group"] == "3"
    assert desync.ranks == (0, 1)  # two ranks, two calls: no majority, both named


# -- out of memory, and a signalled launcher -------------------------------------------

def test_a_memory_error_is_named_as_out_of_memory():
    record = make_record(2, errors={1: {"stage": "train", "t": T0 + 5, "type": "MemoryError", "message": "MemoryError",
                                         "traceback": "Traceback ...\nMemoryError\n", "collective": None}},
                         done={0}, exits={0: ExitInfo(0, t=T0 + 12), 1: ExitInfo(1, t=T0 + 6)})
    oom = [f for f in diagnose_run(record) if f.code == "RUN003"]
    assert len(oom) == 1 and oom[0].ranks == (1,)
    assert "ran out of memory in stage train" in oom[0].title and oom[0].evidence["out_of_memory"] is True
    assert "batch" in oom[0].fix and "expandable_segments" in oom[0].fix


def test_a_crash_whose_last_output_says_cuda_out_of_memory_says_so():
    tail = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    record = make_record(2, done={0}, exits={0: ExitInfo(0, t=T0 + 12), 1: ExitInfo(1, t=T0 + 6, log_tail=tail)})
    crash = [f for f in diagnose_run(record) if f.code == "RUN002"]
    assert len(crash) == 1 and crash[0].title.endswith("(exit code 1): out of memory")


def test_ranks_stopped_because_the_launcher_was_signalled_are_interrupted_even_before_their_hello():
    record = make_record(2, interrupted="SIGINT",
                         exits={r: ExitInfo(None, t=T0 + 3, killed_by_us="interrupted by SIGINT") for r in (0, 1)})
    record.hellos.pop(1)
    record.heartbeats.pop(1)
    record.timelines.pop(1)
    findings = diagnose_run(record)
    assert codes(critical(findings)) == ["RUN006"], findings
    assert critical(findings)[0].evidence["stage_by_rank"][1] == "launch"


# -- a whole node missing ---------------------------------------------------------------

def _torchrun_nodes(world: int, per_node: int, arrived: list[int], nodelist: Optional[list[str]] = None,
                    source: str = "torchrun", hosts: Optional[list[str]] = None) -> RunRecord:
    record = make_record(world)
    extra = {"nodelist": nodelist} if nodelist else {}
    names = hosts or [f"h{n}" for n in range(world // per_node)]
    record.hellos = {r: hello(r, world, host=names[r // per_node], local_rank=r % per_node, local_world_size=per_node,
                              node_rank=r // per_node, node_rank_from=source, **extra) for r in arrived}
    record.heartbeats = {r: record.heartbeats[r] for r in arrived}
    record.timelines = {r: record.timelines[r] for r in arrived}
    record.errors = {r: {"stage": "rendezvous", "t": T0 + 20, "type": "RendezvousTimeout", "message": "missing ranks",
                         "traceback": "", "collective": None} for r in arrived}
    return record


def test_a_node_none_of_whose_ranks_arrived_is_named_by_its_slurm_host_name():
    record = _torchrun_nodes(6, 2, [0, 1, 4, 5], nodelist=["gpu-a01", "gpu-a02", "gpu-a03"], source="slurm",
                             hosts=["gpu-a01", "gpu-a02", "gpu-a03"])
    missing = [f for f in diagnose_run(record) if f.code == "RUN001"]
    assert len(missing) == 1 and missing[0].ranks == (2, 3) and missing[0].nodes == ("gpu-a02",)
    assert missing[0].title.startswith("Node rank 1 (gpu-a02) never arrived: none of its ranks (2-3) connected "
                                       "(4 of 6 ranks connected)"), missing[0].title
    assert missing[0].evidence["missing_nodes"] == [{"node_rank": 1, "ranks": "2-3", "host": "gpu-a02"}]


def test_two_missing_nodes_and_a_partly_missing_one():
    two = [f for f in diagnose_run(_torchrun_nodes(6, 2, [0, 1])) if f.code == "RUN001"][0]
    assert two.title.startswith("Node ranks 1, 2 never arrived: none of their ranks (2-5) connected"), two.title
    # One rank of a node missing is a rank, not a node.
    part = [f for f in diagnose_run(_torchrun_nodes(4, 2, [0, 1, 2])) if f.code == "RUN001"][0]
    assert part.title.startswith("Rank 3 never arrived") and "missing_nodes" not in part.evidence


def test_a_layout_that_is_not_node_by_node_names_ranks_only():
    record = _torchrun_nodes(4, 2, [0, 1])
    record.hellos[1]["node_rank"] = 1  # rank 1 says node 1: not the contiguous layout the inference needs
    missing = [f for f in diagnose_run(record) if f.code == "RUN001"][0]
    assert missing.title.startswith("Rank 2-3 never arrived") and not missing.nodes


def test_under_torchrun_the_missing_host_is_the_one_listed_host_no_rank_came_from():
    # c10d gave node rank 0 to gpu10 and 1 to gpu11; gpu9 never came: its node rank is 2 here,
    # not its position in Slurm's list, so the host is the one listed host nobody arrived from.
    record = _torchrun_nodes(6, 2, [0, 1, 2, 3], nodelist=["gpu9", "gpu10", "gpu11"],
                             hosts=["gpu10.cluster", "gpu11.cluster", "gpu9"])
    missing = [f for f in diagnose_run(record) if f.code == "RUN001"][0]
    assert missing.nodes == ("gpu9",) and missing.title.startswith("Node rank 2 (gpu9) never arrived")


def test_a_rank_stopped_while_it_dialled_the_store_still_gives_its_reason():
    """Issue 40: rank 0's rendezvous wait ended before rank 1's own dial deadline (rank 1 started
    later on 2 busy cores), the launcher stopped rank 1, and RUN001 named it with no reason. A rank
    stopped while dialling prints why (session/rank.py `_connect`); the judge reads it from a
    stopped rank's output as from one that gave up by itself."""
    line = ("ddpdoctor: rank 1 on node-b could not reach the rendezvous store at 127.0.0.1:40001 within 3.9s: "
            "connection refused at 127.0.0.1:40001 (nothing listens there: rank 0 is not running, or it listens "
            "on another port; compare MASTER_PORT on every node)")
    err = {"stage": "rendezvous", "t": T0 + 5, "type": "RuntimeError",
           "message": "ranks [1] did not arrive within 4.8s (1 of 2 arrived)", "traceback": "",
           "collective": {"op": "rendezvous", "seq": 1}}
    record = make_record(2, timelines={0: timeline("rendezvous", "error")}, errors={0: err},
                         exits={0: ExitInfo(1, t=T0 + 5.2),
                                1: ExitInfo(1, t=T0 + 5.3, killed_by_us="stopped: the run ended", log_tail=[line])})
    del record.hellos[1], record.heartbeats[1]
    [missing] = [f for f in diagnose_run(record) if f.code == "RUN001"]
    assert missing.ranks == (1,)
    assert missing.evidence["why_not_arrived"]["1"].startswith("connection refused at 127.0.0.1:40001")
    assert missing.title.endswith(": connection refused at 127.0.0.1:40001")
