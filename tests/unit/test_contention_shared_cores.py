"""Ranks that time-share the same cores are not told apart by who waited longer for a CPU.

The readings are the ones the default check recorded in a healthy run on a loaded 2-core VM
(tests/ranks/test_prom_e2e.py, 2026-11-25): both ranks unpinned (CPUs 0-1), other sessions'
processes busy; rank 0 lost 34.8% of the wall time, rank 1 12.1%, and HOM006 named rank 0.
"""

from __future__ import annotations

from ddpdoctor.measure.contention import ContentionFacts, Corunner
from ddpdoctor.probes.stragglers.contention import denied


def _rank(delay: float, cpus: str, throttled: float = 0.0, stopped: float = 0.0) -> ContentionFacts:
    return ContentionFacts(wall_s=6.0, run_delay_pct=delay, off_cpu_pct=delay, throttled_pct=throttled,
                           stopped_pct=stopped, cpus=cpus,
                           corunners=[Corunner(pid=3260, name="python", cpu_pct=62.0)])


def test_unpinned_ranks_on_a_busy_host_name_no_rank():
    readings = {0: _rank(34.8, "0-1"), 1: _rank(12.1, "0-1")}
    assert denied(readings, 0, [1]) is None


def test_a_neighbour_on_a_rank_of_its_own_core_is_still_named():
    readings = {0: _rank(12.1, "0"), 1: _rank(48.0, "1")}
    found = denied(readings, 1, [0])
    assert found is not None and found.cause == "CPU contention" and "pid 3260" in found.sentence


def test_a_spent_quota_is_named_even_on_shared_cores():
    readings = {0: _rank(10.0, "0-1"), 1: _rank(45.0, "0-1", throttled=30.0)}
    found = denied(readings, 1, [0])
    assert found is not None and found.cause == "CPU quota"
