"""`check` on a host whose every core another job keeps busy: it still works, says so, and
its deadlines still hold."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from .harness import assert_nothing_left, probe_section, run_check

pytestmark = pytest.mark.ranks

TIMEOUT = 8
# Start-up on a saturated host (imports at half speed), the default probes, the stuck rank's 8 s
# deadline and the launcher's grace after it. Measured: 12.4 s with both cores spun (2-core VM).
WALL_LIMIT_S = 60


def _foreign_busy_loops(n: int) -> list[psutil.Process]:
    """n processes spinning a core each, started through a shell that exits: another job's, not ours."""
    out = subprocess.run(["sh", "-c", " ".join(f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!;"
                                               for _ in range(n))],
                         capture_output=True, text=True, check=True)
    return [psutil.Process(int(pid)) for pid in out.stdout.split()]


@pytest.mark.slow
def test_a_saturated_host_is_named_and_a_hang_is_still_caught_at_its_deadline(tmp_path):
    """Both cores spun by another job's processes: HOM015 names the host, a hang is still RUN004 at its deadline.

    Default twin: tests/ranks/test_fault_matrix.py::test_fault_cell
    (its hang cell: the same stage-deadline path, RUN004 for the stuck rank at its deadline, on an
    unloaded host; HOM015 is judged in every default check's homogeneity probe, where a false one
    would fail test_multinode_e2e.py's healthy-nodes test, which allows no warning)."""
    busy = _foreign_busy_loops(os.cpu_count() or 2)
    try:
        run = run_check(tmp_path, "--nproc", "2", "--timeout", str(TIMEOUT), "--inject", "hang:rank=1:stage=report",
                        timeout_s=150)
    finally:
        for proc in busy:
            proc.kill()
        psutil.wait_procs(busy, timeout=5)
    assert run.returncode == 2, run.explain()
    # The deadlines held in wall time too: start-up under load, the probes, the hang's own deadline
    # and the launcher's grace, not the test's 150 s kill.
    assert run.wall_s < WALL_LIMIT_S, run.explain()
    # Every probe finished before the hang (in the report stage), on a host with no core to spare.
    assert [(p["name"], p["status"]) for p in run.report["probes"]] == [
        ("init-hang", "ok"), ("limits", "ok"), ("topology", "ok"), ("gpu-count", "ok"), ("homogeneity", "ok"),
        ("ddp-smoke", "ok")], \
        run.explain()
    saturated = run.findings("HOM015")
    assert len(saturated) == 1 and saturated[0]["nodes"] == [run.report["nodes"][0]], run.explain()
    named = {p["pid"] for load in saturated[0]["evidence"]["measured"].values() for p in load["top"]}
    assert named & {p.pid for p in busy}, saturated[0]
    # The deadline held: the hang is named with its own deadline, not a timeout of the test.
    hung = run.findings("RUN004")
    assert len(hung) == 1 and hung[0]["ranks"] == [1] and hung[0]["evidence"]["stage"] == "report", run.explain()
    assert hung[0]["evidence"]["deadline_s"] == TIMEOUT
    facts = probe_section(run.report, "homogeneity")["facts"]
    load = facts["0"]["host_load"]
    assert load["foreign_cpus_busy"] >= 0.5 and load["cpus_busy"] >= 0.9 * load["cpus"], load
    assert "Traceback" not in run.stderr
    assert_nothing_left(run)
