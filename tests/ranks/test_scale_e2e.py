"""16 CPU ranks on this 2-core machine: `check` completes, every rank accounted for.

Slow tier (about a minute: 16 processes import torch on 2 cores). The growth of wall time
and memory from 2 to 16 ranks is measured by benchmarks/scale_ranks.py.
"""

from __future__ import annotations

import pytest

from .harness import assert_nothing_left, run_check

pytestmark = [pytest.mark.ranks, pytest.mark.slow]


@pytest.mark.timeout(420)
def test_sixteen_ranks_complete_with_every_rank_reported(tmp_path):
    """16 ranks: every rank ok, every probe ok, HOM013 (time-sharing) and no HOM006.

    Default twin: tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm
    (the same default check, every probe, to its report on 2 CPU ranks; ranks time-sharing the cores are
    said as HOM013 in test_multinode_e2e.py::test_two_healthy_nodes_give_one_report_grouped_by_node)."""
    run = run_check(tmp_path, "--nproc", "16", "--timeout", "120", timeout_s=400)
    assert run.returncode in (0, 1), run.explain()
    report = run.report
    assert report["world_size"] == 16 and [r["state"] for r in report["ranks"]] == ["ok"] * 16
    assert all(p["status"] == "ok" for p in report["probes"]), run.explain()
    # 16 single-thread ranks on 2 cores time-share: said (HOM013), not judged as slow ranks.
    assert run.findings("HOM013") and not run.findings("HOM006"), run.explain()
    assert not [f for f in run.findings() if f["severity"] == "critical"], run.explain()
    assert_nothing_left(run)
