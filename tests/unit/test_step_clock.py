"""The learned step deadline (callback/step_clock.py): simulated healthy runs are never called hung,
and a hang in a job of 5 ms to 3 s steps is named within 30 s of its start."""

from __future__ import annotations

import math
from collections.abc import Set
import random
import time

import pytest
from torch import nn

from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.hang_watch import WATCH_TICK_S
from ddpdoctor.callback.step_clock import FLOOR_S, SLOWEST_WINDOW, StepClock

# A hang is named one watchdog tick at most after its allowance has run out.
TARGET_S = 30.0


def replay(durations: list[float], slow: Set[int] = frozenset(), clock: StepClock | None = None) -> list[int]:
    """Feed a run to a clock as the Doctor does; the steps that outlived their allowance (false hangs)."""
    clock = clock or StepClock()
    called = []
    for i, seconds in enumerate(durations):
        if seconds >= clock.allowance_s(slow=i in slow):
            called.append(i)
        clock.finished(seconds, slow=i in slow)
    return called


def jittered(base: float, n: int, seed: int = 0, spread: float = 0.3) -> list[float]:
    """n steps around `base`, log-normal: most near it, some up to twice as long."""
    rng = random.Random(seed)
    return [base * math.exp(rng.gauss(0.0, spread)) for _ in range(n)]


def hang_named_after(durations: list[float], slow: Set[int] = frozenset()) -> float:
    """Seconds from the start of a hang right after this run to its report."""
    clock = StepClock()
    assert replay(durations, slow, clock) == []
    return clock.allowance_s() + WATCH_TICK_S


@pytest.mark.parametrize("base", [0.005, 0.05, 0.3, 1.0, 2.0, 2.5])
def test_a_steady_job_is_never_called_hung_and_its_hang_is_named_within_30_s(base):
    run = jittered(base, 600)
    named = hang_named_after(run)
    assert named <= TARGET_S + WATCH_TICK_S, named
    if base <= 0.5:
        assert named == FLOOR_S + WATCH_TICK_S  # a fast loop: the floor, 10 s


def test_gc_pauses_in_a_5_ms_loop_are_not_hangs():
    run = jittered(0.005, 20_000, seed=1)
    for i in range(500, len(run), 997):
        run[i] = 0.2 + 2.0 * (i % 3)  # a 200 ms pause, sometimes a 2 or 4 s one (swapping, a busy host)
    assert replay(run) == []
    assert hang_named_after(run) <= 15.0


@pytest.mark.parametrize("base", [0.005, 0.1, 0.3])
def test_a_step_20x_slower_every_50_is_not_a_hang(base):
    run = jittered(base, 3000, seed=2)
    for i in range(49, len(run), 50):
        run[i] = 20 * base * (1.0 + 0.2 * ((i // 50) % 3))  # logging or metrics: 20x to 28x
    assert replay(run) == []
    assert hang_named_after(run) <= TARGET_S


def test_slow_steps_longer_than_ten_times_the_usual_must_be_marked():
    # 2 s steps with a 40 s step every 50: unmarked, the first such step outlives 10x the
    # typical and is called hung (the documented price of naming a 2 s job's hang in 20 s).
    run = jittered(2.0, 300, seed=3)
    slow = set(range(49, 300, 50))
    for i in slow:
        run[i] = 40.0
    assert replay(run) == [49]
    # Marked, none is; and the ordinary allowance stays 10x the typical step, not 3x the 40 s.
    assert hang_named_after(run, slow) <= 22.0


def test_marked_checkpoints_are_not_hangs_and_keep_ordinary_hangs_fast():
    run = jittered(0.05, 5000, seed=4)
    checkpoints = set(range(999, 5000, 1000))
    for k, i in enumerate(sorted(checkpoints)):
        run[i] = 30.0 + 10.0 * (k % 2)  # 30 or 40 s: the second is longer than the first
    assert replay(run, checkpoints) == []
    clock = StepClock()
    replay(run, checkpoints, clock)
    assert clock.allowance_s() == FLOOR_S  # the checkpoints did not stretch the ordinary steps'
    assert clock.allowance_s(slow=True) == 120.0  # 3x the slowest checkpoint


def test_the_first_steps_get_time_to_compile_and_warm_up():
    run = [150.0, 70.0, 20.0] + jittered(0.005, 200, seed=5)  # compile, a recompile, autotuning
    assert replay(run) == []
    assert hang_named_after(run) == FLOOR_S + WATCH_TICK_S  # then a hang is named as in any 5 ms loop
    clock = StepClock()
    assert clock.allowance_s() == 600.0  # nothing known of the first step
    clock.finished(0.01)
    assert clock.allowance_s() == 60.0  # warm-up: a floor of a minute


def test_a_slow_step_is_remembered_for_a_window_then_forgotten():
    clock = StepClock()
    replay(jittered(0.5, 100, seed=6) + [6.0], clock=clock)
    assert clock.allowance_s() == pytest.approx(18.0)  # 3x the 6 s step
    replay(jittered(0.5, SLOWEST_WINDOW, seed=7), clock=clock)
    assert clock.allowance_s() < 10.5


def test_the_ceiling_is_never_passed():
    clock = StepClock(ceiling_s=3.0)
    assert clock.allowance_s() == 3.0 and clock.allowance_s(slow=True) == 3.0
    replay(jittered(0.005, 100), clock=clock)
    assert clock.allowance_s() == 3.0
    assert clock.describe()["rule"].startswith("the ceiling step_deadline_s 3 s")


def test_describe_gives_the_numbers_behind_the_allowance():
    clock = StepClock()
    replay([0.005] * 200, clock=clock)
    said = clock.describe()
    assert said["allowance_s"] == 10.0 and said["typical_step_s"] == 0.005 and said["steps_seen"] == 200
    assert said["factor"] == 10.0 and said["floor_s"] == 10.0 and said["ceiling_s"] == 600.0
    assert said["rule"] == "max(floor 10 s, 10x typical step 5 ms, 3x slowest recent step 5 ms)"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "soon", None, True])
def test_a_bad_step_deadline_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="step_deadline_s"):
        StepClock(bad)
    with pytest.raises(ValueError, match="step_deadline_s"):
        Doctor(nn.Linear(2, 2), step_deadline_s=bad)


def test_a_bad_on_hang_is_refused_at_construction():
    with pytest.raises(ValueError, match="on_hang"):
        Doctor(nn.Linear(2, 2), on_hang="kill")


def test_a_doctor_learns_from_its_steps_and_marks_slow_work():
    """The step path only records each step's duration; the allowance the watchdog asks for
    (`Doctor.allowance_s`) feeds the clock what finished meanwhile."""
    doctor = Doctor(nn.Linear(2, 2), step_deadline_s=300.0)
    try:
        assert doctor.allowance_s() == 300.0
        for _ in range(30):
            with doctor.step():
                pass
        with doctor.step():
            assert doctor.allowance_s() == FLOOR_S  # learned: a fast loop gets the floor
            with doctor.expect_slow("checkpoint"):
                assert doctor.allowance_s() == 300.0 and doctor._slow == "checkpoint"  # nothing known yet
        with doctor.expect_slow("evaluation"):  # between steps: watched as a slow stretch of its own
            assert doctor._began and doctor.allowance_s() == 60.0  # a marked step is known: a minute's floor
        assert not doctor._began and doctor.allowance_s() and doctor._clock.steps_seen == 32
        with doctor.step(slow=True):
            assert doctor.allowance_s() == 60.0
        with doctor.step():
            assert doctor.allowance_s() == FLOOR_S  # the marked ones did not stretch the ordinary steps'
        assert doctor._steps == 33  # the block between steps was not a training step
    finally:
        doctor.close()


def test_a_step_that_outlives_its_allowance_is_reported_with_how_it_was_set():
    doctor = Doctor(nn.Linear(2, 2), step_deadline_s=1.0)
    try:
        for _ in range(25):
            with doctor.step():
                pass
        began = time.monotonic()
        with doctor.step():
            while not doctor.findings and time.monotonic() - began < 10:
                time.sleep(0.05)
        took = time.monotonic() - began
        [hang] = [f for f in doctor.findings if f.code == "DOC007"]
        assert 1.0 <= took < 1.0 + 4 * WATCH_TICK_S, took
        assert "allowance 1 s = the ceiling step_deadline_s 1 s" in hang.title
        assert hang.evidence["deadline"]["typical_step_s"] < 0.01
    finally:
        doctor.close()
