"""The limits probe end to end, on limits made as the world makes them: a mount namespace with a
64 MB tmpfs on /dev/shm (Docker's default) and `ulimit -n 40`, both in one `check --probes limits`;
and a cgroup with pids.max, a memory limit and a CPU quota, all three in one run. The healthy
control is the healthy run of test_check_e2e.py (LIM000 on the same machine without them);
and `ulimit -u` (RLIMIT_NPROC) on a non-root user, `nobody`, whose limit the kernel enforces (it does
not hold root back). Locked memory, which needs an RDMA device, is judged on readings recorded from
real limited processes (tests/unit/test_limits.py, tests/fixtures/limits/).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Optional
import subprocess
import sys

import psutil
import pytest

from .harness import assert_nothing_left, free_port, probe_section, run_command

NOBODY = 65534

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


PIDS_MAX = 48  # the check's launcher and 2 ranks hold about 16 tasks at the probe: room 32 < 38 to come
MEMORY_MAX = 640 << 20  # they hold about 450 MiB (peak 465 MiB): a 2-rank job would need about 850
QUOTA_CPUS = 1.5  # below a core per rank


def _cgroup_dirs() -> tuple[dict[str, Path], str]:
    """New cgroups (v1: one per controller; v2: one child of ours) with the three limits, or why not."""
    name = f"ddpdoctor_e2e_{uuid.uuid4().hex[:8]}"
    text = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = {c: Path(f"/sys/fs/cgroup/{c}") for c in ("pids", "memory", "cpu") if Path(f"/sys/fs/cgroup/{c}/tasks").exists()}
    made: dict[str, Path] = {}
    try:
        if len(v1) == 3:
            for c, root in v1.items():
                (root / name).mkdir()
                made[c] = root / name
            (made["pids"] / "pids.max").write_text(str(PIDS_MAX))
            (made["memory"] / "memory.limit_in_bytes").write_text(str(MEMORY_MAX))
            (made["cpu"] / "cpu.cfs_period_us").write_text("100000")
            (made["cpu"] / "cpu.cfs_quota_us").write_text(str(int(QUOTA_CPUS * 100000)))
            return made, ""
        own = next((line.split(":", 2)[2] for line in text if line.startswith("0::")), None)
        if own is None:
            return {}, "no cgroup v1 pids/memory/cpu controllers and no cgroup v2"
        child = Path(f"/sys/fs/cgroup{own}") / name
        child.mkdir()
        made["v2"] = child
        (child / "pids.max").write_text(str(PIDS_MAX))
        (child / "memory.max").write_text(str(MEMORY_MAX))
        (child / "cpu.max").write_text(f"{int(QUOTA_CPUS * 100000)} 100000")
        return made, ""
    except OSError as exc:
        _remove(made)
        return {}, f"cannot make a limited cgroup here: {exc.strerror or exc}"


def _remove(made: dict[str, Path]) -> None:
    for path in made.values():
        try:
            path.rmdir()
        except OSError:
            pass


def test_check_names_a_cgroup_s_pids_memory_and_cpu_limits_with_their_values(tmp_path):
    made: dict[str, Path] = {}
    why_not: Optional[str] = "needs root to make a cgroup" if os.geteuid() != 0 else None
    if why_not is None:
        made, why_not = _cgroup_dirs()
    if why_not:
        pytest.skip(why_not)
    try:
        report = tmp_path / "report.json"
        join = " ".join(f"echo $$ > {path}/cgroup.procs;" for path in set(made.values()))
        inner = (f"{join} exec {sys.executable} -m ddpdoctor check --no-live --probes limits --json {report} "
                 f"--port {free_port()}")
        run = run_command(["sh", "-c", inner], tmp_path, report_name="report.json")
        assert_nothing_left(run)
    finally:
        _remove(made)
    assert run.report is not None and run.returncode == 1, run.explain()
    pids, memory, quota = run.findings("LIM004"), run.findings("LIM005"), run.findings("LIM006")
    assert len(pids) == 1 and pids[0]["evidence"]["pids_max"] == PIDS_MAX, run.explain()
    assert f"allows {PIDS_MAX} tasks" in pids[0]["title"] and pids[0]["ranks"] == [0, 1]
    assert len(memory) == 1 and memory[0]["evidence"]["memory_max_bytes"] == MEMORY_MAX, run.explain()
    assert len(quota) == 1 and quota[0]["evidence"]["cpu_quota_cpus"] == QUOTA_CPUS, run.explain()
    assert not run.findings("LIM000")


SMALL_TMP_MB = 48  # a nearly full scratch disk: below the 1 GiB LIM009 asks, room enough for check's own files


def test_check_names_an_absent_rdma_device_a_transport_switched_off_and_a_small_scratch_disk(tmp_path):
    """The environment and the disk, made as a job script or a container makes them: NCCL_IB_HCA naming a
    device this node lacks (LIM007), NCCL_P2P_DISABLE=1 (LIM008, information) and TMPDIR on a 48 MB tmpfs
    (LIM009, information), in one `check --probes limits`. Healthy control: test_check_e2e.py's healthy run
    (LIM000, no variable set, TMPDIR on the machine's disk)."""
    why_not = _can_mount_a_private_shm()  # the same mount namespace and tmpfs, on another folder
    if why_not:
        pytest.skip(why_not)
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices: NCCL_IB_HCA=mlx5_97 may name one")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    report = tmp_path / "report.json"
    inner = (f"mount -t tmpfs -o size={SMALL_TMP_MB}m tmpfs {scratch} && TMPDIR={scratch} NCCL_IB_HCA=mlx5_97 "
             f"NCCL_P2P_DISABLE=1 exec {sys.executable} -m ddpdoctor check --no-live --probes limits "
             f"--json {report} --port {free_port()}")
    run = run_command(["unshare", "-m", "sh", "-c", inner], tmp_path, report_name="report.json")
    assert run.report is not None and run.returncode == 1, run.explain()
    hca, p2p, disk = run.findings("LIM007"), run.findings("LIM008"), run.findings("LIM009")
    assert len(hca) == 1 and hca[0]["evidence"]["absent"] == ["mlx5_97"] and hca[0]["ranks"] == [0, 1], run.explain()
    assert hca[0]["severity"] == "warn" and "NET/IB : No device found" in hca[0]["evidence"]["expected_errors"]
    assert [(f["evidence"]["variable"], f["evidence"]["value"], f["severity"]) for f in p2p] == [
        ("NCCL_P2P_DISABLE", "1", "info")], run.explain()
    scratch_disk = [f for f in disk if f["evidence"]["path"] == str(scratch)]
    assert len(scratch_disk) == 1 and scratch_disk[0]["severity"] == "info", run.explain()
    assert scratch_disk[0]["evidence"]["size_bytes"] == SMALL_TMP_MB << 20
    assert scratch_disk[0]["evidence"]["free_bytes"] <= SMALL_TMP_MB << 20 and scratch_disk[0]["ranks"] == [0, 1]
    assert not any(f["evidence"]["path"] == str(tmp_path) for f in disk)  # the report's folder has room
    assert_nothing_left(run)


NPROC = 48  # as pids.max above: the check's launcher and 2 ranks start about 38 tasks more than they hold


def _as_nobody(argv: str, out: Path) -> str:
    """A shell line, for `unshare -m`, that runs `argv` as the user nobody with this interpreter.

    The interpreter lives under /root (mode 700 here), which nobody cannot enter: in the private mount
    namespace a tmpfs with mode 755 covers /root and the interpreter's tree is bound back into it."""
    hold = out / "pyenv"
    home = Path.home()
    tree = Path(os.path.realpath(sys.executable))
    inside = next((p for p in tree.parents if p.parent == home), None)
    binds = ""
    if inside is not None:  # the interpreter's top folder under the home (e.g. /root/.pyenv)
        binds = (f"mkdir -p {hold} && mount --bind {inside} {hold} && mount -t tmpfs -o mode=755 tmpfs {home} && "
                 f"mkdir -p {inside} && mount --bind {hold} {inside} && ")
    return (f"{binds}exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups env HOME={out} TMPDIR={out} "
            f"{argv}")


def _can_run_as_nobody(out: Path) -> str:
    """Why `nobody` cannot run this interpreter here, or ''."""
    if os.geteuid() != 0:
        return "needs root to switch to the user nobody"
    if not all(shutil.which(tool) for tool in ("unshare", "setpriv", "prlimit")):
        return "needs util-linux's unshare, setpriv and prlimit"
    if any(p.uids().real == NOBODY for p in psutil.process_iter()):  # RLIMIT_NPROC counts all of nobody's tasks
        return "another process already runs as nobody: its tasks would count against the limit"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            _as_nobody(f"{sys.executable} -c 'import ddpdoctor'", out)],
                           capture_output=True, text=True, timeout=60)
    return "" if probe.returncode == 0 else f"nobody cannot import ddpdoctor here: {probe.stderr.strip()[-300:]}"


@pytest.mark.slow
def test_check_names_a_ulimit_u_that_holds_a_non_root_user_and_not_the_same_user_without_it(tmp_path):
    """`ulimit -u 48` (prlimit --nproc) on the user nobody: LIM004 names it with the value; the same user
    without the limit gets no LIM004 (its healthy control: the same command, no prlimit).

    Default twin: tests/ranks/test_limits_e2e.py::test_check_names_a_cgroup_s_pids_memory_and_cpu_limits_with_their_values
    (LIM004 from the cgroup's pids.max, the same judge of the tasks to come)."""
    out = Path(tempfile.mkdtemp(prefix="ddpd-nproc-"))  # /tmp itself: nobody cannot enter pytest's tmp_path
    try:
        out.chmod(0o777)
        why_not = _can_run_as_nobody(out)
        if why_not:
            pytest.skip(why_not)
        runs = {}
        for name, limit in (("limited", f"prlimit --nproc={NPROC} "), ("control", "")):
            report = out / f"{name}.json"
            argv = (f"{limit}{sys.executable} -m ddpdoctor check --no-live --probes limits --json {report} "
                    f"--port {free_port()}")
            runs[name] = run_command(["unshare", "-m", "--propagation", "private", "sh", "-c", _as_nobody(argv, out)],
                                     tmp_path,
                                     report_name=str(report))  # absolute: tmp_path / it is it
            assert_nothing_left(runs[name])
    finally:
        # The binds lived in the private namespaces only, gone with them; never delete through a mount.
        if not os.path.ismount(out / "pyenv"):
            shutil.rmtree(out, ignore_errors=True)
    limited, control = runs["limited"], runs["control"]
    assert limited.report is not None and limited.returncode == 1, limited.explain()
    found = limited.findings("LIM004")
    assert len(found) == 1 and found[0]["evidence"]["nproc_soft"] == NPROC, limited.explain()
    assert found[0]["evidence"]["uid"] == NOBODY and found[0]["ranks"] == [0, 1]
    assert f"limited to {NPROC} (ulimit -u)" in found[0]["title"]
    facts = probe_section(limited.report, "limits")["facts"]
    assert {f["nproc"]["soft"] for f in facts.values()} == {NPROC}
    assert control.report is not None and not control.findings("LIM004"), control.explain()
    assert {f["uid"] for f in probe_section(control.report, "limits")["facts"].values()} == {NOBODY}
