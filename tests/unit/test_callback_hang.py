"""callback/hang.py: the first-cause rule on the ranks' records, the exchange's deadlines, the
user's frame, and the process states it reads from /proc."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from ddpdoctor.callback import hang
from ddpdoctor.core import keys


def record(rank: int, collective: str = hang.DDP_ALLREDUCE, step: int = 7, **kw) -> hang.RankRecord:
    return hang.RankRecord(rank=rank, step=step, pid=1000 + rank, host="h", collective=collective,
                           user_frame=f"/home/u/train.py:{50 + rank} in train", stack=[f"stack of {rank}"], **kw)


def test_the_rank_outside_any_collective_is_the_cause_and_the_others_its_victims():
    v = hang.judge({0: record(0), 1: record(1, collective=""), 2: record(2)}, {}, written_by=0)
    assert v.culprits == {1: "own code"} and v.victims == [0, 2]
    f = hang.verdict_finding(v)
    assert f.code == "DOC007" and f.ranks == (1,)
    assert f.title == ("Step 7 hung: rank 1 (h) is stuck in its own code at train.py:51 in train; "
                       "rank 0,2 waited for it")
    assert set(f.evidence["affected_ranks"]) == {"0", "2"}
    assert f.evidence["affected_ranks"]["0"].startswith("waiting in DDP's gradient all-reduce at step 7")
    assert f.evidence["python_stack_rank_1"] == ["stack of 1"]


def test_a_silent_rank_is_the_cause_as_dead_frozen_or_gone_from_the_loop():
    absent = {1: hang.Absent(1, "dead", pid=42, host="h"), 2: hang.Absent(2, "frozen", pid=43, host="h"),
              3: hang.Absent(3, "dead", pid=44, host="h", step=5, left=True)}
    v = hang.judge({0: record(0)}, absent, written_by=0)
    assert v.culprits == {1: "dead", 2: "frozen", 3: "left"} and v.victims == [0]
    title = hang.verdict_finding(v).title
    assert "rank 1 (h) died (process 42 is gone)" in title and "rank 2 (h) is frozen (process 43" in title
    assert "rank 3 (h) left the training loop after step 5" in title


def test_a_rank_that_answered_after_leaving_the_loop_is_the_cause_even_inside_a_collective():
    v = hang.judge({0: record(0), 1: record(1, collective="barrier", step=5, left=True)}, {}, written_by=0)
    assert v.culprits == {1: "left"} and v.victims == [0]


def test_a_desync_names_the_minority_and_on_a_tie_the_rank_not_in_the_loops_own_all_reduce():
    three = {0: record(0), 1: record(1, collective="all_reduce of a float32[3] tensor"), 2: record(2)}
    assert hang.judge(three, {}, 0).culprits == {1: "desync"}
    two = {0: record(0), 1: record(1, collective="all_reduce of a float32[3] tensor")}
    v = hang.judge(two, {}, 0)
    assert v.culprits == {1: "desync"} and v.victims == [0]
    assert "rank 1 (h) is in all_reduce of a float32[3] tensor at step 7" in hang.verdict_finding(v).title
    steps = {0: record(0, step=7), 1: record(1, step=8), 2: record(2, step=7)}
    assert hang.judge(steps, {}, 0).culprits == {1: "desync"}


def test_every_rank_in_the_same_collective_is_the_transport_not_a_rank():
    v = hang.judge({0: record(0), 1: record(1)}, {}, 0)
    assert v.culprits == {0: "transport", 1: "transport"} and v.victims == []
    assert "the collective itself did not complete" in hang.verdict_finding(v).title


def test_a_verdict_travels_through_the_store_unchanged():
    v = hang.judge({0: record(0, deadline={"allowance_s": 3.0, "rule": "r", "x": 1}), 1: record(1, collective="")},
                   {2: hang.Absent(2, "dead", pid=9, host="h")}, 0)
    back = hang.Verdict.from_json(v.to_json())
    assert back == v and hang.verdict_finding(back).to_json() == hang.verdict_finding(v).to_json()
    assert hang.verdict_finding(v).evidence["deadline_by_rank"] == {"0": {"allowance_s": 3.0, "rule": "r"}}


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, wanted: list[str]) -> bool:
        return all(k in self.data for k in wanted)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def exchange(store: FakeStore, rank: int, clock: FakeClock, world: int = 2) -> hang.Exchange:
    return hang.Exchange(store, rank, world, 1, "h", clock=clock, sleep=clock.sleep)


def test_a_peer_that_never_answers_costs_the_collect_deadline_and_is_named_silent():
    store, clock = FakeStore(), FakeClock()
    me = exchange(store, 0, clock)
    me.publish(record(0))
    records, absent = me.collect()
    assert set(records) == {0} and absent == {1: hang.Absent(1, "silent", None, "", None, False)}
    assert hang.COLLECT_S <= clock.t <= hang.COLLECT_S + 0.2
    assert me.decide(records, absent).culprits == {1: "silent"}
    assert store.check([keys.callback_hang_verdict(1)])


def test_a_dead_process_on_this_host_is_known_at_once_and_a_departed_one_as_left():
    store, clock = FakeStore(), FakeClock()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store.set(keys.callback_pid(1), f'{{"pid": {gone.pid}, "host": "h"}}')
    me = exchange(store, 0, clock)
    me.publish(record(0))
    assert me.collect()[1][1].how == "dead" and clock.t == 0.0
    store.set(keys.callback_left(1), "5")
    absent = me.collect()[1]
    assert absent[1].left and absent[1].step == 5
    assert hang.judge({0: record(0)}, absent, 0).culprits == {1: "left"}


def test_the_writer_is_the_lowest_rank_that_answered_and_the_others_read_its_verdict():
    store, clock = FakeStore(), FakeClock()
    zero, one = exchange(store, 0, clock), exchange(store, 1, clock)
    zero.publish(record(0))
    one.publish(record(1, collective=""))
    written = zero.decide(*zero.collect())
    read = one.decide(*one.collect())
    assert read == written and read.written_by == 0 and read.culprits == {1: "own code"}


def test_a_victim_waits_for_the_culprit_to_leave_then_a_little_more_and_never_past_the_grace():
    store, clock = FakeStore(), FakeClock()
    victim = exchange(store, 0, clock)
    alive = dataclasses.replace(record(1, collective=""), pid=os.getpid())  # on this host, and running
    v = hang.judge({0: record(0), 1: alive}, {}, 0)
    victim.wait_gone(v)  # the culprit never leaves
    assert hang.CULPRIT_EXIT_GRACE_S <= clock.t <= hang.CULPRIT_EXIT_GRACE_S + 0.2
    clock.t = 0.0
    exchange(store, 1, clock).leaving()
    victim.wait_gone(v)
    assert hang.AFTER_CULPRIT_S <= clock.t <= hang.AFTER_CULPRIT_S + 0.2


def test_process_states_from_proc():
    assert hang.process_state(os.getpid()) == "alive"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while hang.process_state(child.pid) != "frozen" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hang.process_state(child.pid) == "frozen"
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while hang.process_state(child.pid) != "gone" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hang.process_state(child.pid) == "gone"  # a zombie until reaped is gone too
    finally:
        child.kill()
        child.wait()
    assert hang.process_state(child.pid) == "gone"


def _user_code_calls(inner):
    return inner()  # this test file is the user's code here


def test_the_users_frame_is_the_innermost_outside_the_libraries():
    import json

    frames: list = []

    def library_side() -> None:
        frames.extend(hang.frames_of(sys._getframe()))

    json.loads("[1]", object_hook=None, parse_int=lambda s: _user_code_calls(library_side) or 1)
    where, stack = hang.describe([(f, f.f_lineno) for f in frames])
    assert where.startswith(__file__) and "in library_side" in where
    assert hang.is_user_file(__file__) and not hang.is_user_file(json.__file__)
    assert not hang.is_user_file(hang.__file__) and not hang.is_user_file("<frozen runpy>")
    assert any("json" in line for line in stack)


def test_a_collective_called_by_the_user_is_read_with_its_tensors_shape():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    frames: list = []
    real = sys.gettrace()

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "all_reduce" and "/torch/distributed/" in frame.f_code.co_filename:
            frames.extend(hang.frames_of(frame))
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(Exception):
            dist.all_reduce(torch.ones(2, 3))  # no process group: it raises, after its frame was seen
    finally:
        sys.settrace(real)
    assert hang.user_collective(frames) == "all_reduce of a float32[2, 3] tensor"


def test_the_errors_of_a_peer_gone_are_told_from_the_users_own():
    assert hang.peer_gone(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not hang.peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not hang.peer_gone(KeyboardInterrupt())
