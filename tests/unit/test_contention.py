"""A rank denied the CPU: the readings (measure/contention.py), the verdict shared by the three
places that judge stragglers (probes/stragglers/contention.py), its row in the callback's gather,
and the outside faults' helper, which never outlives its target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddpdoctor.callback.online_checks import History, RankWindow, merge_contention
from ddpdoctor.callback.row import GatheredRow, contention_fields, pack, unpack
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.faults import parse_faults
from ddpdoctor.measure.contention import ContentionFacts, Corunner, Window, cpu_list, lost_cpu
from ddpdoctor.probes.stragglers.contention import LOST_GAP_PTS, classify, denied, peer_wait_pct
from ddpdoctor.runtime import outside_faults


def _facts(delay: float, off: float = 0.0, throttled: float = 0.0, corunners=(), stopped: float = 0.0,
           cpus: str = "1") -> ContentionFacts:
    return ContentionFacts(wall_s=2.0, run_delay_pct=delay, off_cpu_pct=off, throttled_pct=throttled, cpus=cpus,
                           corunners=list(corunners), stopped_pct=stopped)


def test_a_busy_thread_reads_its_cpu_time_and_a_sleeping_one_does_not_count_as_off_cpu():
    window = Window(corunners="never")
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    busy = window.take(wait_s=0.0)
    time.sleep(0.2)
    idle = window.take(wait_s=0.2)  # it waited on purpose the whole window
    assert busy.cpu_pct is not None and busy.cpu_pct > 20 and busy.wall_s >= 0.2
    assert idle.cpu_pct is not None and idle.cpu_pct < busy.cpu_pct
    assert idle.off_cpu_pct is not None and idle.off_cpu_pct < 20
    assert cpu_list(frozenset({0, 1, 2, 5})) == "0-2,5" and cpu_list(frozenset({3})) == "3"


def test_lost_is_run_delay_plus_time_stopped_and_not_time_blocked_on_purpose():
    assert lost_cpu(_facts(10, off=40, throttled=5, stopped=20)) == 30 and lost_cpu(ContentionFacts()) is None
    assert lost_cpu(_facts(1, off=60)) == 1  # a step that blocks on a file or a queue lost no CPU


@pytest.mark.parametrize("facts, cause, said", [
    (_facts(48, corunners=[Corunner(pid=77, name="busy", cpu_pct=60.0)]), "CPU contention",
     "another process (pid 77, busy) runs on its core"),
    (_facts(60, 55, 58), "CPU quota", "CPU quota"),
    (_facts(2, stopped=35), "stopped from outside", "stopped 35% of the time"),
])
def test_the_cause_is_named_from_what_the_kernel_counted(facts, cause, said):
    found = classify(1, facts, peers_lost=3.0)
    assert found is not None and found.cause == cause and said in found.sentence, found
    assert found.sentence.startswith("rank 1 ") and found.fix


def test_ranks_that_time_share_cores_evenly_are_not_denied_and_one_that_loses_more_is():
    even = {r: _facts(48 + r) for r in range(4)}
    assert all(denied(even, r, [p for p in even if p != r]) is None for r in even)
    one = {0: _facts(5, cpus="0"), 1: _facts(5 + LOST_GAP_PTS + 10, cpus="1"), 2: _facts(6, cpus="2")}
    assert denied(one, 1, [0, 2]) is not None and denied(one, 0, [1, 2]) is None


def test_the_peers_wait_for_the_rank_that_arrives_last():
    waits = {0: [3.0, 4.0, 0.1], 1: [0.1, 0.2, 0.1]}
    steps = [5.0, 5.0, 5.0]
    assert peer_wait_pct(waits, steps, 1, [0]) == pytest.approx(100 * (2.9 + 3.8) / 15)
    assert peer_wait_pct(waits, steps, 0, [1]) == 0.0


def test_the_row_carries_the_reading_and_rank_0_reads_it_back():
    reading = _facts(40, 12, corunners=[Corunner(pid=os.getpid(), name="x", cpu_pct=50.0)])
    row = GatheredRow(rank=1, steps_done=20, step_ms=[1.0], data_ms=[0.0], wait_ms=[0.5], samples=[32.0],
                      **contention_fields(reading))
    back = unpack(pack(row, 4))
    assert back == row
    window = back.to_window(os.uname().nodename)
    assert window.contention is not None and window.contention["run_delay_pct"] == 40
    assert window.contention["corunners"][0]["pid"] == os.getpid()
    assert window.contention["corunners"][0]["name"] == psutil.Process().name()  # named where the pid means something
    unread = GatheredRow(rank=0, steps_done=1, step_ms=[1.0], data_ms=[0.0], wait_ms=[0.0], samples=[0.0])
    assert unpack(pack(unread, 2)).to_window("h").contention is None


def test_windows_merge_weighted_by_their_wall_time():
    a = {"wall_s": 1.0, "run_delay_pct": 10.0, "corunners": [{"pid": 1, "name": "hog", "cpu_pct": 80.0}]}
    b = {"wall_s": 3.0, "run_delay_pct": 50.0, "corunners": [{"pid": 2, "name": "cc1", "cpu_pct": 30.0}]}
    merged = merge_contention(a, b)
    assert merged is not None and merged["run_delay_pct"] == 40.0 and merged["wall_s"] == 4.0
    # A co-runner's share over the whole span, 0 where it was not seen: 80% of 1 s, 30% of 3 s.
    assert merged["corunners"] == [{"pid": 2, "name": "cc1", "cpu_pct": 22.5}, {"pid": 1, "name": "hog", "cpu_pct": 20.0}]
    assert merge_contention(None, b) == b


def test_the_outside_faults_grammar():
    hog, quota, stop, mem = parse_faults("hog:rank=1,quota:rank=0:pct=30,preempt:rank=1:pct=20,mempressure:rank=1:mb=64")
    assert (hog.kind, hog.pct, quota.pct, stop.pct, mem.mb) == ("hog", None, 30.0, 20.0, 64.0)
    assert quota.describe() == "quota:rank=0:pct=30" and mem.describe() == "mempressure:rank=1:mb=64"
    for bad in ("quota:rank=1", "preempt:rank=1:pct=0", "hog:rank=1:pct=x", "mempressure:rank=1"):
        with pytest.raises(UsageError):
            parse_faults(bad)


def _target() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])


def _gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("kind", ["hog", "preempt", "mempressure"])
def test_a_helper_never_outlives_its_target_even_when_the_target_is_killed(kind):
    target = _target()
    try:
        made = outside_faults.start(kind, target.pid, pct=50, mb=16)
        helper = psutil.Process(made.pid)
        children = helper.children()
        assert helper.ppid() != os.getpid()  # detached: nobody's child but init's (or a subreaper's)
        if kind == "hog":
            assert [c.name() for c in children] == [outside_faults.HOG_NAME]
            assert set(psutil.Process(target.pid).cpu_affinity()) <= set(children[0].cpu_affinity())
        target.send_signal(signal.SIGKILL)  # a crashed rank: no chance to clean anything up
        target.wait()
        assert _gone(made.pid) and all(_gone(c.pid) for c in children)
    finally:
        if target.poll() is None:
            target.kill()


def test_stop_ends_the_helper_and_continues_a_stopped_target():
    target = _target()
    try:
        made = outside_faults.start("preempt", target.pid, pct=90)
        time.sleep(0.2)
        made.stop()
        assert _gone(made.pid)
        time.sleep(0.05)
        assert psutil.Process(target.pid).status() != psutil.STATUS_STOPPED
    finally:
        target.kill()
        target.wait()


def test_a_quota_is_set_and_removed_or_refused_with_the_reason():
    target = _target()
    try:
        try:
            made = outside_faults.start("quota", target.pid, pct=30)
        except outside_faults.OutsideFaultError as exc:
            assert "cgroup" in str(exc)  # no writable cgroup here: said so
            return
        path = made.note.split()[1].rstrip(":")
        assert os.path.isdir(path) and str(target.pid) in open(os.path.join(path, "cgroup.procs")).read().split()
        made.stop()
        assert _gone(made.pid) and not os.path.exists(path)
    finally:
        target.kill()
        target.wait()


def _fixture(name: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "stragglers_outside" / name).read_text())["facts"]


def _named(facts) -> list[tuple[tuple[int, ...], str]]:
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    return [(f.ranks, f.evidence["cause"]) for f in diagnose_stragglers(facts, RunView(world_size=len(facts)))
            if f.code == "STR001"]


@pytest.mark.parametrize("name", ["quota30_callback_a.json", "quota30_callback_b.json"])
def test_beside_a_rank_denied_the_cpu_a_healthy_peer_its_peers_do_not_wait_for_is_not_named(name):
    """Recorded: the callback on 2 ranks, rank 1 under a 30% quota. Rank 0's best-case work is 15% above
    rank 1's in most windows (0.4 of a 3.9 ms comm-bound step), which the older score took for a slow
    rank 0 (`compute`), beside rank 1 named for its quota; rank 1 is the one its peer waits for."""
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import _persistent, by_rank, score

    facts = by_rank(_fixture(name))
    scores = score(facts, RunView(world_size=2))
    assert scores is not None and _persistent(scores.ranks[0], scores.threshold_pct)  # what misled the score
    assert _named(facts) == [((1,), "CPU quota")]


def _loop(rank: int, work_ms: float, wait_ms: float, delay_pct: float, corunners=()) -> RankWindow:
    n = 40
    jitter = [0.02 * (i % 5) for i in range(n)]  # never two equal steps: a window's low quantile is a real one
    return RankWindow(rank=rank, host="vm", step=n, step_ms=[work_ms + wait_ms + j for j in jitter],
                      data_ms=[0.2] * n, wait_ms=[wait_ms] * n, samples=[32.0] * n, fingerprint=0, loader_len=-1,
                      stale_epoch=False, peak_mem_bytes=0,
                      contention=_facts(delay_pct, corunners=corunners, cpus=str(rank)).to_json())


@pytest.mark.parametrize("delay, seen, cause", [(45.0, 50.0, "CPU contention"), (27.0, 0.0, "compute"),
                                               (27.0, 50.0, "CPU contention"), (27.0, 4.0, "compute")])
def test_a_rank_slow_in_every_step_is_denied_the_cpu_when_its_wait_for_a_cpu_covers_its_extra_work(
        delay, seen, cause):
    """A neighbour running the whole time slows a rank's best steps too (its work 6 ms against 1.6 ms):
    that is CPU contention when the time it waited for a CPU beyond its peer's (35% of an 8 ms step:
    2.8 ms) covers most of its extra work (4.4 ms). A rank that waited 17 points more (1.4 ms) with no
    neighbour seen is slow by itself, its extra time spent on a CPU; with a process seen taking half
    of its core (4 ms a step) that process is the cause (`scores._neighbour`); one seen at 4% of a CPU
    (under NEIGHBOUR_SEEN_PCT, 0.3 ms a step) is not."""
    history = History()
    hog = [Corunner(pid=77, name="ddpdoctor-hog", cpu_pct=seen)] if seen else []
    history.add({0: _loop(0, 1.6, 4.6, 10.0), 1: _loop(1, 6.0, 0.2, delay, hog)})
    named = _named(history.facts())
    assert named == [((1,), cause)]


def test_a_recorded_rank_with_a_busy_neighbour_on_its_core_is_named_for_contention_not_compute():
    """Recorded: the probe, rank 1 sharing its core with a busy process the whole run, slow in its best
    steps too; it waited for a CPU far more than its peer, which covers its extra work."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "stragglers_outside" / "hog_100_rank1.json"
    named = _named(json.loads(path.read_text())["facts"])
    assert named == [((1,), "CPU contention")]


def test_a_rank_its_own_neighbour_holds_is_named_though_the_stalled_all_reduce_hides_whose_wait_it_was():
    """Recorded: the callback, rank 1 sharing its own core with a busy process, rank 0 on another core.
    Rank 1's neighbour stalls it inside the all-reduce too, so both ranks wait there alike: its peer
    waited for it only 8% of the step more than it waited for its peer (the threshold is 10%), while
    it lost 32% of its time off a CPU and rank 0 4%. On cores no peer shares that loss is its own."""
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import _peer_waits, _waited_for, by_rank, score

    facts = by_rank(_fixture("hog100_callback_step80.json"))
    scores = score(facts, RunView(world_size=2))
    assert scores is not None and not _waited_for(_peer_waits(facts, scores), scores, 1)  # the wait alone misses it
    assert _named(facts) == [((1,), "CPU contention")]
    # The same readings with both ranks on the same cores: a neighbour there takes from both alike.
    for f in facts.values():
        assert f.contention is not None
        f.contention.cpus = "0-1"
    assert _named(facts) == []


def test_a_victim_that_waits_longer_than_its_peer_in_the_all_reduce_is_not_named_for_its_slower_steps():
    """Recorded: the same run's next verdict. Rank 0, idle in the all-reduce 80% of each step while
    rank 1 shared its core with a busy process, computed 0.45 ms a step against 0.30 (43% in the score):
    a straggler arrives last and waits least, and rank 0 waited 2.5 ms a step against rank 1's 1.9."""
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import _persistent, by_rank, score

    facts = by_rank(_fixture("hog100_callback_step100.json"))
    scores = score(facts, RunView(world_size=2))
    assert scores is not None and _persistent(scores.ranks[0], scores.threshold_pct)  # what misled the score
    assert scores.ranks[0].comm_wait_ms > scores.ranks[1].comm_wait_ms
    # Rank 1 lost 11 points more of its time than rank 0 and a process took a third of its core.
    assert _named(facts) == [((1,), "CPU contention")]


def test_a_neighbour_seen_on_a_rank_s_own_core_is_named_with_a_smaller_gap_and_only_there():
    """A process busy half of every 100 ms on rank 1's core slowed the callback's loop 2.2x while rank 1
    lost 8 to 20 points more than rank 0; healthy pinned ranks differ by up to 13 points, with nobody
    else on their cores. Seen on its own core, 12 points suffice; unseen, or on shared cores, they do not."""
    from ddpdoctor.probes.stragglers.contention import denied

    hog = [Corunner(pid=77, name="ddpdoctor-hog", cpu_pct=28.0)]
    seen = {0: _facts(11.0, cpus="0"), 1: _facts(23.0, corunners=hog, cpus="1")}
    found = denied(seen, 1, [0])
    assert found is not None and found.cause == "CPU contention" and "ddpdoctor-hog" in found.sentence
    assert denied({0: _facts(11.0, cpus="0"), 1: _facts(23.0, cpus="1")}, 1, [0]) is None  # nobody seen
    shared = {0: _facts(11.0, corunners=hog, cpus="0-1"), 1: _facts(23.0, corunners=hog, cpus="0-1")}
    assert denied(shared, 1, [0]) is None  # the same cores: the neighbour takes from both
    both = {0: _facts(11.0, corunners=hog, cpus="0"), 1: _facts(23.0, corunners=hog, cpus="1")}
    assert denied(both, 1, [0]) is None  # as busy on its peer's core: nothing of its own


def test_cpu_lists_are_counted_as_taskset_writes_them():
    from ddpdoctor.measure.contention import cpu_count

    assert [cpu_count(c) for c in ("0", "0-3,8", "0,2,4-5", "", None, "x")] == [1, 5, 4, 0, 0, 0]


def test_time_a_rank_s_own_threads_took_on_its_core_is_not_a_neighbour_s():
    """Recorded: healthy ranks pinned one to a core. Rank 0's training thread lost 30% of its time
    against 6% and rank 1 waited for it, but its own transport thread took 48% of its core against
    16% on rank 1, and the job's step was as long as in runs where both lost alike: no straggler."""
    from ddpdoctor.probes.stragglers.contention import own_threads_pct

    facts = _fixture("healthy_pinned_own_threads.json")
    contention = {r: ContentionFacts.from_json(f["contention"]) for r, f in facts.items()}
    assert [round(own_threads_pct(contention[r]) or 0) for r in ("0", "1")] == [48, 16]
    assert _named(facts) == []
    # The same loss without its own threads' extra CPU is a neighbour's, and named.
    facts["0"]["contention"]["process_cpu_pct"] = facts["1"]["contention"]["process_cpu_pct"] + 10
    assert _named(facts) == [((0,), "CPU contention")]


def test_a_busy_process_seen_on_a_rank_s_own_core_is_named_though_the_rank_s_own_threads_got_busier():
    """Recorded through Lightning's fit (issue 42), each rank's main thread pinned to its own core after the
    process group had started its threads (those left free), a busy process on rank 1's core: the job's step from
    about 7 to 19 ms, both ranks waiting 12 to 14 ms of it in the all-reduce. Rank 1's other threads, held
    with it, took 23% of its core against 6% on rank 0: discounted as its own doing, that hid the 21 points
    of wall time it lost beyond rank 0 (28% against 7%), and the rules called the collective the bottleneck (STR005). With
    the process seen on its core the loss is the neighbour's, and it holds every rank: the cost the finding
    gives is that lost time where it exceeds the peers' measured wait for it."""
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.contention import (held_apart, neighbour_on_own_cores, own_threads_discount,
                                                        own_threads_excess)
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    facts = _fixture("hog100_lightning_collective_held.json")
    contention = {int(r): ContentionFacts.from_json(f["contention"]) for r, f in facts.items()}
    assert own_threads_excess(contention[1], [contention[0]]) > 15  # what hid it
    assert own_threads_discount(contention[1], [contention[0]]) == 0.0
    assert neighbour_on_own_cores(contention, 1, [0]) and held_apart(contention, 1, [0])
    found = [f for f in diagnose_stragglers(facts, RunView(world_size=2)) if f.code == "STR001"]
    assert [(f.ranks, f.evidence["cause"]) for f in found] == [((1,), "CPU contention")]
    assert "ddpdoctor-hog" in found[0].title
    evidence = found[0].evidence
    assert evidence["peers_wait_pct_of_step"] < 28.1 - 6.8  # the lost time beyond its peer is the larger
    assert evidence["cost_ms_per_step"] == round((28.1 - 6.8) * evidence["median_step_ms"] / 100, 2)
    # Without the process seen on its core, its busier threads are its own again, and nobody is named.
    for f in facts.values():
        f["contention"]["corunners"] = []
    assert _named(facts) == []


def test_a_stop_is_the_cause_when_it_covers_what_the_rank_lost_beyond_its_peers():
    """Measured (`preempt:rank=1:pct=20`, the probe): rank 1 stopped 14.4% of the time with 14.7% run
    delay, rank 0 13.2% run delay; the stop was under half of all it lost, and it was called CPU
    contention in 3 of 10 runs. Beyond its peers it lost 15.9 points, 14.4 of them stopped."""
    from ddpdoctor.probes.stragglers.contention import denied

    found = denied({0: _facts(13.2, cpus="0"), 1: _facts(14.7, stopped=14.4, cpus="1")}, 1, [0])
    assert found is not None and found.cause == "stopped from outside"
    hog = [Corunner(pid=77, name="ddpdoctor-hog", cpu_pct=60.0)]
    busy = denied({0: _facts(5.0, cpus="0"), 1: _facts(35.0, stopped=0.6, corunners=hog, cpus="1")}, 1, [0])
    assert busy is not None and busy.cause == "CPU contention"


def test_a_rank_whose_extra_work_does_not_make_it_arrive_late_is_not_slow():
    """Recorded: the one healthy 2-rank probe run of 120 the rules named (rank 1 `compute`, 12.0%
    slower in 5 of 8 windows): it arrived 0.05 ms after rank 0 on 0.13 ms of extra work a step. A
    rank really 1.2x slower arrives 0.94 ms late on 1.11 ms, and stays named."""
    import json
    from pathlib import Path

    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import _persistent, by_rank, score

    facts = by_rank(_fixture("healthy_pinned_not_late.json"))
    scores = score(facts, RunView(world_size=2))
    assert scores is not None and _persistent(scores.ranks[1], scores.threshold_pct)  # what misled the score
    assert scores.ranks[1].late_ms is not None and scores.ranks[1].late_ms < 0.1
    assert _named(facts) == []
    path = Path(__file__).resolve().parents[1] / "fixtures" / "stragglers" / "slow_compute_x1.2_rank2.json"
    assert _named(json.loads(path.read_text())["facts"]) == [((2,), "compute")]


def test_extra_in_step_time_without_extra_cpu_time_is_not_a_ranks_own_compute():
    """Recorded: the callback, 2 healthy unpinned ranks on 2 cores. Rank 1's in-step work was 24% above rank
    0's while both training threads had 56% of the wall time: the rules before named it `compute`. The same
    readings with rank 1's thread busier by its extra work (a rank that really computes more) name it."""
    import copy

    facts = _fixture("healthy_unpinned_cpu_equal.json")
    assert _named(facts) == []
    busier = copy.deepcopy(facts)
    busier["1"]["contention"]["cpu_pct"] = facts["1"]["contention"]["cpu_pct"] + 12.0  # 12% of a 4.3 ms step
    assert _named(busier) == [((1,), "compute")]
    on_gpus = copy.deepcopy(facts)  # GPU ranks' work is the GPU's: the CPU rule does not apply there
    for f in on_gpus.values():
        f["device"] = "cuda:0"
    assert _named(on_gpus) == [((1,), "compute")]


def test_a_rank_stopped_in_bursts_costs_the_time_it_lost_not_only_the_sampled_wait():
    """Recorded (tests/fixtures/stragglers_outside/preempt40_callback_step100.json): rank 1 stopped 40%
    from outside, in bursts. The callback reads the gradient wait from DDP's sampled iterations, and the
    bursts land mostly on unsampled ones: its peer was seen waiting for it 4.2% of the step, under the
    callback's bar (MIN_COST_SHARE), though it was stopped 16-33% of every window; the e2e test's loop
    went unnamed in 3 of 10 runs. A rank stopped from outside holds every rank: the wall time it lost
    beyond its peers is its cost (issue 40)."""
    from ddpdoctor.callback.doctor import MIN_COST_SHARE
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    facts = _fixture("preempt40_callback_step100.json")
    [found] = [f for f in diagnose_stragglers(facts, RunView(world_size=2, hosts={0: "vm", 1: "vm"}))
               if f.code == "STR001"]
    assert found.ranks == (1,) and found.evidence["cause"] == "stopped from outside"
    assert found.evidence["peers_wait_pct_of_step"] < 100 * MIN_COST_SHARE  # what the sampled wait saw
    assert found.evidence["cost_ms_per_step"] >= MIN_COST_SHARE * found.evidence["median_step_ms"]


def test_a_rank_its_quota_throttles_is_named_though_its_run_delay_is_close_to_its_peers():
    """Recorded (tests/fixtures/stragglers_outside/quota60_callback_unnamed.json): rank 1 under a 0.6-CPU
    quota, the job 1.6x slower, throttled 18% of the time and its peer 0%, yet its run delay only 8 points
    above its peer's and its peer's wait for it 7% of the step: the rules before named nobody (3 of 10
    runs). Throttled time is the kernel's own count of the cgroup held, with no noise to stand out from."""
    from ddpdoctor.callback.doctor import MIN_COST_SHARE
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.contention import QUOTA_GAP_PTS, throttled_gap
    from ddpdoctor.probes.stragglers.scores import by_rank, diagnose_stragglers

    facts = _fixture("quota60_callback_unnamed.json")
    ranks = by_rank(facts)
    assert throttled_gap(ranks[1].contention, [ranks[0].contention]) >= QUOTA_GAP_PTS
    [found] = [f for f in diagnose_stragglers(facts, RunView(world_size=2, hosts={0: "vm", 1: "vm"}))
               if f.code == "STR001"]
    assert found.ranks == (1,) and found.evidence["cause"] == "CPU quota"
    assert found.evidence["cost_ms_per_step"] >= MIN_COST_SHARE * found.evidence["median_step_ms"]
    # The same windows with no quota anywhere: throttled time 0 on both, and nobody is named.
    for f in facts.values():
        f["contention"]["throttled_pct"], f["contention"]["cpu_quota"] = 0.0, None
    assert _named(facts) == []


def test_a_rank_slower_beside_a_neighbour_on_its_core_is_named_for_the_neighbour_not_its_compute():
    """Recorded (tests/fixtures/stragglers_outside/mempressure_callback_neighbour.json): an unpinned process
    touching 2 GiB sat on rank 1's core; rank 1's work 3x rank 0's, its peer waiting for it half of each
    step, its run delay only 8 points above rank 0's (its training thread got more CPU, not less: a
    neighbour takes caches and memory bandwidth too). The rules before said `compute`, "nothing sampled
    on its host explains it", with the process seen on its core. The same windows without the neighbour
    seen keep `compute`, and on GPU ranks the rule does not apply."""
    facts = _fixture("mempressure_callback_neighbour.json")
    [(ranks, cause)] = _named(facts)
    assert ranks == (1,) and cause == "CPU contention"
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    [found] = [f for f in diagnose_stragglers(facts, RunView(world_size=2)) if f.code == "STR001"]
    assert "ddpdoctor-mem" in found.evidence["where"] and "taskset" in found.fix
    unseen = json.loads(json.dumps(facts))
    for f in unseen.values():
        f["contention"]["corunners"] = []
    assert _named(unseen) == [((1,), "compute")]
    for f in facts.values():
        f["device"] = "cuda:0"
    assert _named(facts) == [((1,), "compute")]


def test_a_peer_rank_on_the_same_machine_is_never_named_a_co_runner():
    """Four ranks pinned two to a core: rank 0's busiest "other process (pid 16462, python)" was rank 2,
    its fellow rank on the core (benchmarks/stragglers_detection.py --shapes, a 4-rank pinned Lightning
    cell). A real busy process on our CPUs is seen; the same process given as a peer rank's pid is not
    (core/hello.py `peer_pids`, the measurement's `exclude`)."""
    from ddpdoctor.core.hello import Hello, peer_pids

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = Window(corunners="always")
        time.sleep(0.6)
        assert busy.pid in {c.pid for c in seen.take().corunners}
        hellos = {0: Hello(rank=0, machine="m1", pid=os.getpid()), 2: Hello(rank=2, machine="m1", pid=busy.pid),
                  3: Hello(rank=3, machine="m2", pid=busy.pid + 1)}
        assert peer_pids(hellos, 0) == frozenset({busy.pid})  # rank 3 is on another machine: its pid means nothing here
        excluded = Window(corunners="always", exclude=peer_pids(hellos, 0))
        time.sleep(0.6)
        assert busy.pid not in {c.pid for c in excluded.take().corunners}
        seen.close()
        excluded.close()
    finally:
        busy.kill()
        busy.wait()


def test_the_callback_stops_counting_a_peer_rank_on_its_node_as_a_neighbour():
    """The callback learns each rank's node and pid from the job's store (what the ranks publish at
    `Doctor(...)`); a rank on its own node goes into the measurement's `exclude`, one on another node not."""
    import json as _json

    from ddpdoctor.callback.doctor import Doctor
    from ddpdoctor.core import keys

    class Store:
        def __init__(self, values: dict) -> None:
            self.values = {k: _json.dumps(v).encode() for k, v in values.items()}

        def check(self, names: list) -> bool:
            return all(n in self.values for n in names)

        def get(self, name: str) -> bytes:
            return self.values[name]

    doctor = Doctor.__new__(Doctor)
    doctor.rank, doctor.host, doctor._where = 0, "vm", {0: ("vm", "0")}
    doctor._cpu = Window(corunners="never")
    doctor._store = Store({keys.callback_host(2): {"host": "vm", "cpus": "0"}, keys.callback_pid(2): {"pid": 4242},
                           keys.callback_host(1): {"host": "other", "cpus": "1"}, keys.callback_pid(1): {"pid": 4343}})
    assert doctor._where_of(2) == ("vm", "0") and doctor._where_of(1) == ("other", "1")
    assert 4242 in doctor._cpu.exclude and 4343 not in doctor._cpu.exclude
    doctor._cpu.close()
