"""When the callback says a straggler (`Doctor._stragglers`): only once its checks have named the same rank for
CONFIRM_S of the job. Driven with gathered rows as the ranks send them, one check at a time, no processes.

Why it is tested apart: checked every 20 steps of 10 ms, two checks in a row judge windows that share three
quarters of their steps, so a half-second hiccup of one rank's CPU was named by both (a healthy Hugging Face
fit in CI). The rule must hold a hiccup back, still say a rank slow for good, and at the defaults (a check
about every 2 s) say it at the next check, as before.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpdoctor
from ddpdoctor.callback.doctor import CONFIRM_S, named_since, said, worth_naming_online
from ddpdoctor.callback.online_checks import RankWindow
from ddpdoctor.core.findings import Finding, Severity

STEPS = 20  # a check's window, as `every=20`


def window(rank: int, slow: bool) -> RankWindow:
    """A rank's 20 steps of 10 ms. Slow: it waits 0.5 ms in the all-reduce where its peer waits 3.5, so its work
    is 9.5 ms against 6.5 (the rank the other waits for); the steps differ by a few microseconds, as real ones do."""
    wait = 0.5 if slow else 3.5
    return RankWindow(rank=rank, host="vm", step=0, step_ms=[10.0 + 0.01 * i for i in range(STEPS)],
                      data_ms=[0.5] * STEPS, wait_ms=[wait] * STEPS, samples=[32.0] * STEPS, fingerprint=rank + 1,
                      loader_len=1000, stale_epoch=False, peak_mem_bytes=0)


@pytest.fixture
def doctor():
    model = nn.Linear(4, 2)
    d = ddpdoctor.Doctor(model, torch.optim.SGD(model.parameters(), lr=0.1), every=STEPS, check_every_s=0)
    yield d
    d.close()


def said_at(doctor, slow_at: list[bool], window_s: float) -> list[int]:
    """The checks (0-based) at which a straggler is said, rank 1 slow at the checks `slow_at` marks, each check's
    window `window_s` long (what `_check` adds to the job's time from the gathered table)."""
    out = []
    for k, slow in enumerate(slow_at):
        rows = {0: window(0, False), 1: window(1, slow)}
        doctor._job_s += window_s
        doctor._history.add(rows)
        found = doctor._stragglers(rows)
        assert all(f.code == "STR001" and f.ranks == (1,) and f.evidence["cause"] == "compute" for f in found), found
        if found:
            out.append(k)
    return out


def test_a_rank_slow_for_good_is_said_once_named_for_two_seconds_of_checks_every_fifth_of_a_second(doctor):
    said = said_at(doctor, [True] * 20, window_s=0.2)
    # Judged from the 4th check (64 steps in 4 windows), named there at 0.8 s; said at 2.8 s and every check after.
    first_named = 3
    assert said == list(range(first_named + round(CONFIRM_S / 0.2), 20)), said


def test_a_hiccup_shorter_than_that_is_never_said(doctor):
    # Rank 1 slow for 10 checks (2 s of the job, 1.4 s of it after the judging begins), then well again: the
    # checks named it from the 4th to the 12th (the kept windows still hold slow steps), never for 2 s.
    assert said_at(doctor, [True] * 10 + [False] * 20, window_s=0.2) == []


def test_a_straggler_that_stops_being_named_starts_its_two_seconds_again(doctor):
    # Slow, well for a full set of kept windows (no longer named), slow again: the 2 s count from the new naming.
    pattern = [True] * 8 + [False] * 6 + [True] * 20
    said = said_at(doctor, pattern, window_s=0.2)
    assert said and said[0] >= 14 + 2 + round(CONFIRM_S / 0.2), said


def test_at_the_defaults_checks_two_seconds_apart_say_it_at_the_next_check_as_before(doctor):
    assert said_at(doctor, [True] * 6, window_s=2.0) == [4, 5]


def verdict(cost_ms: float, severity: Severity = Severity.WARN, cause: str = "CPU contention") -> Finding:
    """STR001 on rank 1 of a 10 ms step, costing `cost_ms` a step (the bar: 10% of the step, 1 ms)."""
    return Finding("STR001", severity, "t", "stragglers", ranks=(1,),
                   evidence={"cause": cause, "cost_ms_per_step": cost_ms, "median_step_ms": 10.0})


def test_a_check_that_still_finds_the_rank_slower_but_under_the_cost_bar_keeps_its_run_and_one_that_does_not_ends_it():
    """A busy neighbour's share dips under 10% of the step at one check (the judge still names the rank slower, at
    warn): the run of checks goes on, so a 50% neighbour is said in a run of a few seconds (9 of 10, not 7). A
    check where the rank is no longer slower at all ends the run; a dip alone never starts one."""
    key = ("STR001", (1,))
    since = named_since({}, [verdict(3.0)], 0.8)
    assert since == {key: 0.8}
    since = named_since(since, [verdict(0.6)], 1.0)  # under the bar: kept, not said
    assert since == {key: 0.8} and not worth_naming_online(verdict(0.6))
    assert not said(named_since(since, [verdict(3.0)], 2.7), verdict(3.0), 2.7)  # 1.9 s of its run
    since = named_since(since, [verdict(3.0)], 2.9)
    assert said(since, verdict(3.0), 2.9)
    assert named_since(since, [], 3.0) == {}  # not slower any more: the run ends
    assert named_since({}, [verdict(0.6)], 1.0) == {}  # a dip does not start a run
    # Host overhead (time in neither data nor the step) is noise between medians: it keeps a run, never says one.
    assert named_since({key: 0.8}, [verdict(3.0, cause="host overhead")], 1.0) == {key: 0.8}
    assert named_since({key: 0.8}, [verdict(3.0, severity=Severity.INFO)], 1.0) == {}
