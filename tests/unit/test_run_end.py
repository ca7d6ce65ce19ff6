"""The end of the run (issue 53): the final exchange through the store, the whole run's windows, the summary.

The pieces, without rank processes: a real store (torch's HashStore) with real processes whose fate is read
from /proc (one gone, one stopped, one alive), the ledger's figures against the steps' own, the run's windows
thinned over a long run, and a Doctor in a world of one closed by `with`, by close() and by
dist.destroy_process_group(). Two-rank runs that end in a verdict are tests/ranks/test_run_end_e2e.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpdoctor
from ddpdoctor.callback import doctor as doctor_module
from ddpdoctor.callback.doctor import missing_finding
from ddpdoctor.callback.final_check import FINAL_WAIT_CAP_S, FinalExchange, Missing, final_wait_s
from ddpdoctor.callback.online_checks import RankWindow, RunHistory
from ddpdoctor.callback.row import GatheredRow, pack, unpack
from ddpdoctor.callback.run_summary import RunLedger, lost_to_slowest, summary
from ddpdoctor.core import codes, keys
from ddpdoctor.core.findings import Severity


def row(rank: int, steps_done: int, step_ms: list[float], data_ms: float = 1.0, wait_ms: float = 0.0,
        samples: float = 32.0, window_s: float = 0.0) -> GatheredRow:
    n = len(step_ms)
    return GatheredRow(rank=rank, steps_done=steps_done, window_steps=n,
                       window_s=window_s or (sum(step_ms) + data_ms * n) / 1e3, step_ms=list(step_ms),
                       data_ms=[data_ms] * n, wait_ms=[wait_ms] * n, samples=[samples] * n)


# -- the final exchange ---------------------------------------------------------------------------
def _publish_pid(store, rank: int, pid: int, host: str) -> None:
    store.set(keys.callback_pid(rank), json.dumps({"pid": pid, "host": host}))


def test_every_row_comes_back_as_sent_and_no_wait_when_all_arrived():
    store = dist.HashStore()
    sent = {r: pack(row(r, 100 + r, [5.0, 6.0, 7.0]), 8) for r in range(3)}
    for r in range(3):
        FinalExchange(store, r, 3, 0, "vm").publish(sent[r])
    began = time.monotonic()
    got = FinalExchange(store, 0, 3, 0, "vm").collect(wait_s=3.0)
    assert time.monotonic() - began < 0.5 and not got.missing
    assert {r: unpack(v) for r, v in got.rows.items()} == {r: unpack(v) for r, v in sent.items()}
    assert unpack(got.rows[2]).steps_done == 102 and math.isnan(got.rows[2][2])  # an unknown travels as NaN


def test_a_second_doctor_of_the_process_has_keys_of_its_own():
    store = dist.HashStore()
    FinalExchange(store, 1, 2, 0, "vm").publish(pack(row(1, 10, [1.0]), 4))
    FinalExchange(store, 0, 2, 1, "vm").publish(pack(row(0, 5, [1.0]), 4))
    got = FinalExchange(store, 0, 2, 1, "vm").collect(wait_s=0.2)
    assert sorted(got.missing) == [1], "the first Doctor's row was taken for the second's"


def test_a_rank_whose_process_is_gone_or_stopped_is_known_at_once_and_a_silent_one_costs_the_wait():
    store = dist.HashStore()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        FinalExchange(store, 0, 3, 0, "vm").publish(pack(row(0, 50, [2.0]), 4))
        _publish_pid(store, 1, gone.pid, "vm")
        _publish_pid(store, 2, stopped.pid, "vm")
        began = time.monotonic()
        got = FinalExchange(store, 0, 3, 0, "vm").collect(wait_s=3.0, last_steps={1: 40, 2: 40})
        assert time.monotonic() - began < 1.0, "waited for ranks whose fate was known"
        assert {r: m.how for r, m in got.missing.items()} == {1: "dead", 2: "frozen"}
        assert got.missing[1].last_step == 40 and got.missing[1].pid == gone.pid
        # The same stopped rank, but on another node: not knowable from here, so waited for, then silent.
        _publish_pid(store, 2, stopped.pid, "node-b")
        began = time.monotonic()
        got = FinalExchange(store, 0, 3, 0, "vm").collect(wait_s=0.6)
        assert 0.55 < time.monotonic() - began < 1.5
        assert got.missing[2].how == "silent" and got.missing[2].host == "node-b"
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.wait()


def test_the_wait_follows_the_step_within_two_and_five_seconds():
    assert final_wait_s(None) == FINAL_WAIT_CAP_S == 5.0
    assert final_wait_s(0.002) == 2.0 and final_wait_s(1.0) == 3.0 and final_wait_s(30.0) == 5.0


def test_a_missing_rank_is_critical_when_known_dead_and_a_warning_when_only_silent():
    dead = missing_finding({1: Missing(1, "dead", "vm", 4242, 480)}, [0], {0: "vm"}, 0.1)
    assert dead.code == "DOC021" and dead.severity == Severity.CRITICAL and dead.ranks == (1,)
    assert "Rank 1 on vm did not reach the end of the run" in dead.title and "its process is gone" in dead.title
    assert dead.evidence["fate_by_rank"] == {1: "dead"} and dead.evidence["arrived_ranks"] == [0]
    silent = missing_finding({2: Missing(2, "silent", "node-b"), 3: Missing(3, "silent", "node-b")}, [0, 1],
                             {0: "a", 1: "a"}, 5.0)
    assert silent.severity == Severity.WARN and silent.ranks == (2, 3) and silent.nodes == ("node-b",)
    assert "did not answer within 5.0 s" in silent.title and "3 silent" in silent.title
    assert silent.severity in codes.CODES["DOC021"].severities


# -- the ledger and the summary -----------------------------------------------------------------------
def test_the_ledger_reads_each_ranks_median_p90_and_parts_as_the_steps_have_them():
    ledger = RunLedger()
    rng = torch.Generator().manual_seed(3)
    steps = {r: [float(v) for v in (4.0 + 6.0 * torch.rand(400, generator=rng))] for r in (0, 1)}
    for k in range(4):  # four checks of 100 steps
        ledger.add({r: row(r, 100 * (k + 1), steps[r][100 * k:100 * (k + 1)], data_ms=1.0 if r == 0 else 3.0,
                           wait_ms=2.0 if r == 0 else 0.5) for r in (0, 1)}, {0: "a", 1: "b"})
    for r in (0, 1):
        periods = [s + (1.0 if r == 0 else 3.0) for s in steps[r]]
        got = ledger.ranks[r].to_json()
        assert got["steps"] == 400 and got["sampled_steps"] == 400 and got["node"] == "ab"[r]
        assert got["step_ms_median"] == pytest.approx(statistics.median(periods), rel=0.02)
        assert got["step_ms_p90"] == pytest.approx(statistics.quantiles(periods, n=10)[-1], rel=0.03)
        total = sum(periods)
        assert got["data_pct"] == pytest.approx(100 * (1.0 if r == 0 else 3.0) * 400 / total, abs=0.1)
        assert got["wait_pct"] == pytest.approx(100 * (2.0 if r == 0 else 0.5) * 400 / total, abs=0.1)
        assert got["data_pct"] + got["wait_pct"] + got["compute_pct"] == pytest.approx(100.0, abs=0.2)
        assert got["samples_per_s"] == pytest.approx(1e3 * 32 * 400 / total, rel=1e-3)
    # Rank 1's work (step less wait) is about 3.5 ms longer a step: the time lost to it.
    work = {r: statistics.mean(steps[r]) + (1.0 if r == 0 else 3.0) - (2.0 if r == 0 else 0.5) for r in (0, 1)}
    lost = lost_to_slowest(ledger)
    assert lost["rank"] == 1 and lost["ms_per_step"] == pytest.approx(work[1] - work[0], abs=0.01)
    assert lost["straggler"] is False and lost["seconds"] == pytest.approx(lost["ms_per_step"] * 400 / 1e3, abs=0.01)


def test_the_summary_names_the_stragglers_cost_not_another_ranks_noise():
    ledger = RunLedger()
    # Rank 0's means look slower (noise: its work 1 ms longer), but the verdict names rank 1.
    ledger.add({0: row(0, 64, [6.0] * 64, wait_ms=0.5), 1: row(1, 64, [5.0] * 64, wait_ms=0.5)}, {})
    straggler = codes.finding("STR001", "stragglers", "Rank 1 on vm is a straggler", severity=Severity.WARN,
                              ranks=(1,), nodes=("vm",),
                              evidence={"cost_ms_per_step": 2.0, "median_step_ms": 8.0})
    s = summary(ledger, [straggler], 2, 3.0, {}, 0.01, 2.5)
    assert s["verdict"].startswith("STR001 (rank 1): Rank 1 on vm is a straggler") and s["code"] == "STR001"
    assert s["lost_to_slowest"] == {"rank": 1, "ms_per_step": 2.0, "share_pct": 25.0, "seconds": 0.13,
                                    "straggler": True}
    healthy = summary(ledger, [], 2, 3.0, {}, 0.01, 2.5)
    assert healthy["verdict"] == "healthy: 64 steps on 2 ranks, no warning or critical finding"
    assert healthy["severity"] == "ok" and healthy["code"] is None


def test_the_summary_is_the_same_size_after_ten_checks_and_after_two_thousand():
    def run(checks: int) -> int:
        ledger = RunLedger()
        rng = torch.Generator().manual_seed(0)
        for k in range(checks):
            ledger.add({r: row(r, 128 * (k + 1), [float(v) for v in 5.0 + torch.rand(128, generator=rng)])
                        for r in range(2)}, {r: "vm" for r in range(2)})
        assert all(len(led.hist) < 200 for led in ledger.ranks.values())
        return len(json.dumps(summary(ledger, [], 3, 10.0, {2: "dead"}, 1.0, 9.0)))
    short, long = run(10), run(2000)
    assert abs(long - short) < 40, (short, long)  # digits of the counts only


def test_a_rank_that_never_reported_is_in_the_summary_as_missing():
    ledger = RunLedger()
    ledger.add({0: row(0, 10, [5.0] * 10)}, {0: "vm"})
    s = summary(ledger, [], 2, 1.0, {1: "silent"}, 5.0, 1.0)
    assert s["ranks"][1]["arrived"] is False and s["ranks"][1]["missing"] == "silent"
    assert s["final_check"] == {"arrived": 1, "missing": [1], "waited_ms": 5000.0, "replicas": None}


# -- the run's windows -------------------------------------------------------------------------------
def window(rank: int, k: int, n: int = 128) -> RankWindow:
    return RankWindow(rank=rank, host="vm", step=k, step_ms=[float(k)] * n, data_ms=[0.0] * n, wait_ms=[0.0] * n,
                      samples=[1.0] * n, fingerprint=0, loader_len=-1, stale_epoch=False, peak_mem_bytes=k)


def test_the_runs_windows_stay_bounded_and_spread_over_the_whole_run():
    run = RunHistory(max_steps=1024)
    for k in range(1, 201):  # 200 checks of 128 steps: a long run
        run.add({r: window(r, k) for r in range(2)}, job_s=2.0)
    kept = [w[0].step for w in run.windows]
    assert run.steps() <= 1024 + 128 and len(kept) >= 5
    assert kept[0] == run.stride and kept[-1] == 200, kept  # from the first stride to the end of the run
    gaps = [b - a for a, b in zip(kept, kept[1:])]
    assert max(gaps[:-1]) == min(gaps[:-1]), kept  # evenly spread (the latest one may be nearer)
    assert len(run.job_s) == len(run.windows) and sum(run.job_s) == 2.0 * len(kept)
    assert set(run.facts()) == {0, 1}


# -- a Doctor's end, in a world of one ---------------------------------------------------------------
@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _train(doctor, steps: int) -> None:
    for _ in range(steps):
        with doctor.step(torch.zeros(8, 4)):
            time.sleep(0.001)


def test_leaving_with_closes_and_writes_the_summary(world_of_one, tmp_path):
    path = tmp_path / "r.json"
    with ddpdoctor.Doctor(nn.Linear(4, 2), json_path=str(path), summary=False) as doctor:
        _train(doctor, 30)
    assert doctor._closed
    report = json.loads(path.read_text())
    s = report["summary"]
    assert s["steps"] == 30 and s["world_size"] == 1 and s["ranks"][0]["steps"] == 30
    assert s["ranks"][0]["sampled_steps"] == 30  # every step since the first check was timed, none lost
    assert s["ranks"][0]["step_ms_median"] >= 1.0  # each step slept 1 ms: a floor on any host
    assert s["verdict"].startswith("healthy: 30 steps on 1 rank")


def test_destroy_process_group_closes_the_doctor_first(world_of_one, tmp_path, capsys):
    path = tmp_path / "r.json"
    doctor = ddpdoctor.Doctor(nn.Linear(4, 2), json_path=str(path))
    _train(doctor, 12)
    from torch.distributed import destroy_process_group  # imported after the Doctor, as scripts do at the top

    destroy_process_group()
    assert doctor._closed and not dist.is_initialized()
    assert json.loads(path.read_text())["summary"]["steps"] == 12
    err = capsys.readouterr().err
    assert "ddpdoctor end of run: healthy: 12 steps on 1 rank" in err and "samples/s" in err
    assert doctor_module.SUMMARY_PRINTER is not None


def test_the_end_is_judged_once_and_a_closed_doctor_costs_nothing_more(world_of_one, tmp_path, monkeypatch):
    doctor = ddpdoctor.Doctor(nn.Linear(4, 2), summary=False)
    _train(doctor, 5)
    calls = []
    real = doctor._finish
    monkeypatch.setattr(doctor, "_finish", lambda: calls.append(1) or real())
    doctor.close()
    doctor.close()
    dist.destroy_process_group()
    assert calls == [1]


class _GoneStore:
    """A job store whose host is gone: every call fails, as a TCPStore's does once rank 0 has exited."""

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")

    check = get = set


class _Sampler:
    epoch, shuffle = 0, True


def test_a_rank_that_cannot_send_its_last_window_says_what_it_knows_alone(world_of_one, tmp_path):
    """The exchange is impossible (the store went with rank 0): this rank still names its own stale sampler
    (DOC003) and its own first non-finite loss (DOC018), in its own report."""
    path = tmp_path / "r.json"
    loader = [torch.zeros(8, 4)] * 4  # four batches an epoch, a sampler whose epoch never moves
    doctor = ddpdoctor.Doctor(nn.Linear(4, 2), loader=loader, sampler=_Sampler(), json_path=str(path), summary=False)
    for step in range(10):
        with doctor.step(loader[0]) as s:
            s.loss = torch.tensor(float("nan") if step == 6 else 1.0)
    doctor.distributed, doctor.world_size, doctor.rank, doctor._store = True, 2, 1, _GoneStore()
    doctor.close()
    found = {f["code"]: f for f in json.loads(path.with_name("r.json.rank1").read_text())["findings"]}
    assert found["DOC003"]["ranks"] == [1] and found["DOC018"]["ranks"] == [1], found
    assert "step 7" in found["DOC018"]["title"]
