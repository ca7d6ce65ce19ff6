"""The limits probe end to end, on limits made as the world makes them: a mount namespace with a
64 MB tmpfs on /dev/shm (Docker's default) and `ulimit -n 40`, both in one `check --probes limits`. The healthy
control is the healthy run of test_check_e2e.py (LIM000 on the same machine without them); the
other limits (pids, memory, CPU quota, memlock, nproc) are judged on readings recorded from real
limited processes (tests/unit/test_limits.py, tests/fixtures/limits/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .harness import assert_nothing_left, free_port, probe_section, run_command

pytestmark = pytest.mark.ranks

SHM_MB = 64
NOFILE = 40


def _can_mount_a_private_shm() -> str:
    """Why the limit cannot be made here, or '' when it can."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a mount namespace"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SHM_MB}m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare -m + mount failed: {probe.stderr.strip()}"


def test_check_names_a_64mb_shm_and_ulimit_n_40_with_their_values(tmp_path):
    why_not = _can_mount_a_private_shm()
    if why_not:
        pytest.skip(why_not)
    report = tmp_path / "report.json"
    port = free_port()
    inner = (f"mount -t tmpfs -o size={SHM_MB}m tmpfs /dev/shm && ulimit -n {NOFILE} && exec {sys.executable} "
             f"-m ddpdoctor check --no-live --probes limits --json {report} --port {port}")
    run = run_command(["unshare", "-m", "sh", "-c", inner], tmp_path, report_name="report.json")
    assert run.report is not None, run.explain()
    assert run.returncode == 1, run.explain()  # warnings: check's own ranks ran, a usual job would not
    shm, nofile = run.findings("LIM001"), run.findings("LIM002")
    assert len(shm) == 1 and shm[0]["evidence"]["shm_size_bytes"] == SHM_MB << 20, run.explain()
    assert shm[0]["ranks"] == [0, 1] and f"{SHM_MB}.0 MiB free" in shm[0]["title"]
    assert len(nofile) == 1 and nofile[0]["evidence"]["nofile_soft"] == NOFILE, run.explain()
    assert f"limited to {NOFILE}" in nofile[0]["title"] and nofile[0]["ranks"] == [0, 1]
    assert not run.findings("LIM000")
    facts = probe_section(run.report, "limits")["facts"]
    assert {f["shm"]["size_bytes"] for f in facts.values()} == {SHM_MB << 20}
    # The limits are readings, not a failure of the run (the default probes' own run under them is
    # not repeated here: suite time; `--probes limits` takes the same rank path up to the probe).
    assert [(p["name"], p["status"]) for p in run.report["probes"]] == [("limits", "ok")]
    assert_nothing_left(run)
