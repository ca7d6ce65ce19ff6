"""When the callback checks, and how DDP's sampled timings are counted: pure arithmetic, tested alone.

callback/schedule.py agrees the next check's step from the gathered table (every rank computes the
same); callback/reducer_wait.py counts DDP's sampled iterations by the reducer's own rule
(`Reducer::should_collect_runtime_stats`: iterations 1-10, then every `rate`-th).
"""

from __future__ import annotations

import pytest

from ddpdoctor.callback.reducer_wait import TORCH_DEFAULT_RATE, rate_for, sampled_count
from ddpdoctor.callback.schedule import next_check, slowest_step_s


@pytest.mark.parametrize("iteration, rate, count", [
    (0, 100, 0), (1, 100, 1), (10, 100, 10), (99, 100, 10), (100, 100, 11), (250, 100, 12),
    (7, 1, 7), (500, 1, 500), (10, 3, 10), (11, 3, 10), (12, 3, 11), (30, 3, 17), (10, 10, 10), (20, 10, 11),
])
def test_the_reducers_sampled_iterations_are_counted_by_its_rule(iteration, rate, count):
    assert sampled_count(iteration, rate) == count


def test_the_sample_rate_gives_one_sample_per_20_ms_on_cpu_and_100_ms_on_a_gpu_never_rarer_than_torch():
    assert [rate_for(ms, "cpu") for ms in (0.5, 2.0, 10.0, 50.0, 400.0)] == [40, 10, 2, 1, 1]
    assert [rate_for(ms, "cuda") for ms in (0.5, 2.0, 10.0, 50.0)] == [TORCH_DEFAULT_RATE, 50, 10, 2]
    assert rate_for(0.0, "cpu") == rate_for(-1.0, "cuda") == TORCH_DEFAULT_RATE  # unknown: torch's own


def test_checks_are_on_multiples_of_every_and_at_least_check_every_s_apart():
    # 2 ms steps: every=50 alone would check ten times a second; 2 s of them is 1000 steps.
    assert next_check(1, 50, 2.0, 0.002) == 1050 and next_check(1000, 50, 2.0, 0.002) == 2000
    # Slow steps: `every` wins (2 s is less than 50 steps of 0.5 s).
    assert next_check(100, 50, 2.0, 0.5) == 150
    # By count alone, or the step time unknown (a GPU's first check): the next multiple of every.
    assert next_check(1, 50, 0.0, 0.002) == 50 and next_check(1, 50, 2.0, None) == 50
    assert next_check(50, 50, 0.0, None) == 100 and next_check(1, 1, 0.0, None) == 2
    # Not a step is lost or repeated whatever the numbers: always a later step.
    for steps in (1, 7, 50, 999):
        for every in (1, 3, 50):
            for step_s in (None, 1e-6, 0.01, 5.0):
                nxt = next_check(steps, every, 2.0, step_s)
                assert nxt > steps and nxt % every == 0


def test_the_schedule_follows_the_slowest_ranks_mean_step():
    # (steps since the last check, wall seconds): the slowest rank's mean step sets the pace.
    assert slowest_step_s([(100, 0.2), (100, 0.4), (0, 0.0)]) == pytest.approx(0.004)
    assert slowest_step_s([(0, 1.0)]) is None and slowest_step_s([]) is None
