"""The same check under torchrun and under hand-set rank variables, and bad input end to end."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from .harness import assert_nothing_left, free_port, run_command, run_hand_set_ranks, tagged_processes, TAG_VAR
from tests.trace_format import check_rules, spans_of

pytestmark = pytest.mark.ranks


def _torchrun(tmp_path, *args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ddpdoctor", "check", "--json", str(tmp_path / "tr.json"), *args]
    return run_command(cmd, tmp_path, env=env, report_name="tr.json")


@pytest.mark.slow
def test_torchrun_standalone_gives_the_same_healthy_report(tmp_path):
    """torchrun --standalone, healthy: the torchrun mode and rank 0 alone reporting.

    Default twin: tests/ranks/test_launch_modes.py::test_torchrun_names_the_crashed_rank_even_when_it_is_the_reporter
    (the same torchrun launch: workers read torchrun's variables, mode "torchrun", rank 0's report; with a crash)
    """
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.explain()
    assert run.report["mode"] == "torchrun" and run.report["world_size"] == 2
    assert sorted(f["code"] for f in run.findings()) == ["DDP001", "GPU000", "HOM000", "INIT000", "LIM000",
                                                          "TOP009"], run.explain()
    assert all(r["state"] == "ok" for r in run.report["ranks"])
    assert run.stdout.count("ddpdoctor check") == 1, "exactly one rank (rank 0) prints the report"
    assert_nothing_left(run)


# Case 0 (the reporter crashes: its report must still come, from the survivors) is the point and stays
# default; case 1 (a non-reporting rank crashes) is the slow tier: the same torchrun path, and a crash of
# rank 1 is also the fault matrix's crash cells (tests/ranks/test_fault_matrix.py).
@pytest.mark.parametrize("crashed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_torchrun_names_the_crashed_rank_even_when_it_is_the_reporter(tmp_path, crashed):
    """Case 0 stays default (the reporter itself crashes, the harder path); case 1 is the slow tier:
    the same torchrun launch and RUN002 path, with the crash on a rank that does not report."""
    # Workers started by torchrun take their faults from the environment, as a fire drill would.
    run = _torchrun(tmp_path, "--timeout", "4", env={"DDPDOCTOR_INJECT": f"crash:rank={crashed}:stage=ddp"})
    assert run.returncode != 0, run.explain()  # torchrun turns any failed worker into exit 1
    crash = run.findings("RUN002")
    assert len(crash) == 1 and crash[0]["ranks"] == [crashed], run.explain()
    assert crash[0]["evidence"]["stage"] == "ddp"
    assert run.report["exit_code"] == 2
    assert_nothing_left(run)


def _start_ranks(tmp_path, world_size, started, tag, timeout=4, args=(), extra_env=None):
    port = free_port()
    procs = []
    for rank in started:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **{TAG_VAR: tag}, **(extra_env or {}))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddpdoctor", "check", "--timeout", str(timeout), "--json",
             str(tmp_path / f"r{rank}.json"), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return port, procs


@pytest.mark.slow
def test_a_rank_stuck_in_the_report_stage_is_named_alone_and_a_late_sigterm_keeps_the_report(tmp_path):
    """Default twin: tests/ranks/test_fault_matrix.py::test_fault_cell (the ("report", "sigint") cell: a
    signal in the report stage, the written report kept with its exit code; here under hand-set ranks,
    rank 0 hosting the store, with a hang and then SIGTERM to rank 0)
    """
    # Ranks started as srun starts them (rank 0 serves the store). Rank 1 hangs on entering the
    # report stage: it is named within --timeout, not after the whole run's deadline with rank 0
    # (who only waited for it) named too. Rank 0 then holds the store up to 3 s for goodbyes that
    # rank 1 never says; srun --kill-on-bad-exit ends such a step with SIGTERM, which must leave
    # the written report and rank 0's exit code (the verdict) as they are.
    #
    # The stage deadline is 10 s, not 4: under load (the full suite on 2 cores) starting a rank and
    # importing torch takes over 3 s, and with --timeout 4 rank 1 then "never arrived" (RUN001) at the
    # rendezvous, a true verdict about another fault. The run's own deadline is 7 stages, 70 s.
    tag = "report-stage-" + str(time.time())
    start = time.monotonic()
    _, procs = _start_ranks(tmp_path, 2, [0, 1], tag, timeout=10, args=("--probes", "init-hang"),
                            extra_env={"DDPDOCTOR_INJECT": "hang:rank=1:stage=report"})
    try:
        report = tmp_path / "r0.json"
        while not report.exists() and time.monotonic() - start < 60:
            time.sleep(0.05)
        assert report.exists(), [p.poll() for p in procs]
        written = time.monotonic() - start
        time.sleep(0.5)  # rank 0 is in its goodbye wait now
        assert procs[0].poll() is None, "rank 0 should still wait for rank 1's goodbye"
        procs[0].terminate()
        out0 = procs[0].communicate(timeout=30)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    import json

    data = json.loads(report.read_text())
    hung = [f for f in data["findings"] if f["code"] == "RUN004"]
    assert [f["ranks"] for f in hung] == [[1]], data["findings"]
    assert data["interrupted"] is None and data["exit_code"] == 2
    # One stage deadline after the ranks started (and their start-up), far from the run's 70 s.
    assert written < 30, f"the report took {written:.1f}s with --timeout 10"
    assert procs[0].returncode == 2, out0
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == ["r0.json"]  # no second report
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_world_size_larger_than_the_ranks_launched_names_the_missing_rank(tmp_path):
    """Default twin: tests/ranks/test_check_e2e.py::test_a_rank_that_cannot_reach_the_rendezvous_is_named_with_why
    (the same rendezvous deadline and RUN001 naming the rank that never arrived, with the arrived ranks;
    there the rank starts and cannot connect, here it is never started)
    """
    tag = "missing-" + str(time.time())
    start = time.monotonic()
    port, procs = _start_ranks(tmp_path, 3, [0, 1], tag)
    outs = [p.communicate(timeout=60) for p in procs]
    wall = time.monotonic() - start
    assert procs[0].returncode == 2, outs
    import json

    report = json.loads((tmp_path / "r0.json").read_text())
    missing = [f for f in report["findings"] if f["code"] == "RUN001"]
    assert missing and missing[0]["ranks"] == [2]
    assert missing[0]["evidence"]["arrived_ranks"] == "0-1"
    assert set(missing[0]["evidence"]["affected_ranks"]) == {"0", "1"}
    assert wall < 30
    assert not tagged_processes(tag)


def test_unreachable_rendezvous_is_one_line_and_critical(tmp_path):
    port = free_port()  # nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "2"], tmp_path, env=env)
    assert run.returncode == 2, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not reach the rendezvous store" in lines[0] and str(port) in lines[0]
    assert run.wall_s < 20


def test_a_rank_stopped_while_it_dials_the_store_still_says_why(tmp_path):
    """Issue 40: the launcher stops a rank still dialling the store when rank 0's own wait ends
    first (seen once in a suite run: RUN001 with no reason). Stopped with SIGTERM well before its
    own dial deadline (0.7 x 60 s), it still prints the one line that says why, with how long it
    tried. It is stopped once its imports are over: its CPU time stops growing while it dials."""
    port = free_port()  # nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "60"],
                            env={**os.environ, **env, TAG_VAR: tag, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        me, end, last = psutil.Process(proc.pid), time.monotonic() + 60, -1.0
        while time.monotonic() < end:
            used = sum(me.cpu_times()[:2])
            if used > 1.0 and used - last < 0.02:
                break
            last = used
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = re.search(r"could not reach the rendezvous store at 127.0.0.1:(\d+) within ([\d.]+)s: connection refused",
                  lines[0])
    assert m and int(m.group(1)) == port and float(m.group(2)) < 42, lines[0]
    assert not tagged_processes(tag)


def test_unresolvable_master_addr_is_one_line(tmp_path):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}
    run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "2"], tmp_path, env=env)
    assert run.returncode == 3, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not resolve" in lines[0] and "Traceback" not in run.stderr


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
])
def test_bad_rank_variables_are_one_line(tmp_path, env, needle):
    run = run_command([sys.executable, "-m", "ddpdoctor", "check"], tmp_path, env=env, timeout_s=30)
    assert run.returncode == 3, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("ddpdoctor: error:"), run.explain()


def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--port", str(port)], tmp_path)
    assert run.returncode == 3, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "--port" in lines[0]
    assert not tagged_processes(run.tag)


def test_missing_nccl_backend_is_one_line(tmp_path):
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL; the error path needs a CPU-only build")
    run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--backend", "nccl"], tmp_path)
    assert run.returncode == 3, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "nccl" in lines[0].lower() and "--backend gloo" in lines[0]


def test_killing_the_launcher_leaves_no_rank_behind(tmp_path):
    """SIGKILL cannot be handled: the ranks must notice their parent died and exit by themselves."""
    tag = "sigkill-" + str(time.time())
    env = dict(os.environ, OMP_NUM_THREADS="1", **{TAG_VAR: tag})
    proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--no-live", "--timeout", "60",
                             "--inject", "hang:rank=1:stage=train"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and len(tagged_processes(tag)) < 3:
        time.sleep(0.2)
    assert len(tagged_processes(tag)) >= 3, "the ranks never started"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and tagged_processes(tag):
        time.sleep(0.2)
    left = tagged_processes(tag)
    for p in left:
        p.kill()
    assert not left, [p.cmdline() for p in left]


@pytest.mark.slow
def test_slurm_task_variables_are_enough(tmp_path):
    """What `srun --ntasks=2 python -m ddpdoctor check` gives each task, without Slurm itself.

    Default twin: tests/ranks/test_slurm_scripts.py::test_the_multinode_preflight_runs_as_srun_runs_it
    (the same srun-style start from SLURM_* variables, port from the job id, rank 0 alone reporting)
    """
    tag = "slurm-" + str(time.time())
    job_id = str(40000 + free_port() % 20000)  # the port is derived from the job id
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                   SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", SLURM_NTASKS_PER_NODE="2",
                   OMP_NUM_THREADS="1", **{TAG_VAR: tag})
        procs.append(subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--json",
                                       str(tmp_path / f"s{rank}.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    import json

    report = json.loads((tmp_path / "s0.json").read_text())
    assert report["mode"] == "slurm" and report["verdict"] == "ok"
    assert not (tmp_path / "s1.json").exists(), "only rank 0 writes the report"
    assert "ddpdoctor check" in outs[0][0] and "ddpdoctor check" not in outs[1][0]
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_rank_zero_cannot_host_on_a_busy_port(tmp_path):
    """Default twin: tests/ranks/test_launch_modes.py::test_port_in_use_is_one_line
    (a busy rendezvous port refused in one line with exit 3; there found by the launcher, here by rank 0
    when it comes to host the store)
    """
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "3"], tmp_path, env=env)
    assert run.returncode == 3, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "MASTER_PORT" in lines[0]


def test_frozen_rank_is_named_as_stopped_answering(tmp_path):
    """SIGSTOP freezes a rank whole (no watchdog, no heartbeat): only the launcher can tell; `--trace` draws it."""
    import json

    tag = "frozen-" + str(time.time())
    report = tmp_path / "frozen.json"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{TAG_VAR: tag})
    timeline = tmp_path / "frozen.trace.json"
    proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--no-live", "--timeout", "10",
                             "--steps", "400", "--port", str(port), "--json", str(report), "--trace", str(timeline)],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    deadline = time.monotonic() + 40
    while victim is None and time.monotonic() < deadline:
        for p in tagged_processes(tag):
            try:
                # Connected to the store: its imports are done and it is at work.
                if p.environ().get("RANK") == "1" and any(
                        c.raddr and c.raddr.port == port for c in p.net_connections("tcp")):
                    victim = p
            except psutil.Error:
                pass
        time.sleep(0.2)
    assert victim is not None, "rank 1 never connected"
    time.sleep(1.0)
    victim.suspend()
    out, err = proc.communicate(timeout=60)
    data = json.loads(report.read_text())
    frozen = [f for f in data["findings"] if f["code"] == "RUN005"]
    assert proc.returncode == 2, out + err
    assert frozen and frozen[0]["ranks"] == [1], out
    assert "no heartbeat" in frozen[0]["evidence"]["reason"]
    assert not tagged_processes(tag)
    # The timeline shows it at a glance: rank 1's stage is the bar that does not end, named by RUN005.
    doc = json.loads(timeline.read_text())
    check_rules(doc)
    stuck = [e for e in spans_of(doc, 1) if e["name"].endswith(" (stuck)")]
    assert stuck and any(e["args"].get("finding", "").startswith("RUN005") for e in stuck), spans_of(doc, 1)


def test_rank_zero_hosting_the_store_dies_and_the_others_say_so(tmp_path):
    """Under srun or hand-set variables rank 0 hosts the store; when it dies nobody hangs."""
    tag = "store-gone-" + str(time.time())
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DDPDOCTOR_INJECT="crash:rank=0:stage=train", **{TAG_VAR: tag})
        procs.append(subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "6"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    outs = [p.communicate(timeout=60) for p in procs]
    assert procs[0].returncode == 86
    assert procs[1].returncode == 2, outs[1]
    lines = outs[1][1].strip().splitlines()
    assert len(lines) == 1 and "lost the rendezvous store" in lines[0] and "Traceback" not in outs[1][1]
    assert time.monotonic() - start < 30
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_ranks_started_with_different_world_sizes_are_named(tmp_path):
    """One rank launched with another WORLD_SIZE: RUN007 names it, and nothing else is blamed.

    Default twin: tests/ranks/test_check_e2e.py::test_a_rank_that_cannot_reach_the_rendezvous_is_named_with_why
    (the same rendezvous, where each rank's hello is gathered and judged against the launch; there a rank
    that never says hello, here one whose hello gives another WORLD_SIZE. RUN007 itself: test_run_diagnosis.py)
    """
    env = {0: {"LOCAL_RANK": "0"}, 1: {"LOCAL_RANK": "1", "WORLD_SIZE": "3"}}
    procs, report, tag = run_hand_set_ranks(tmp_path, 2, env, "--timeout", "6")
    assert procs[0].returncode == 2, procs[0].stdout + procs[0].stderr
    odd = [f for f in report["findings"] if f["code"] == "RUN007"]
    assert len(odd) == 1 and odd[0]["ranks"] == [1]
    assert odd[0]["evidence"]["world_size_by_rank"] == {"0": 2, "1": 3}
    assert not [f for f in report["findings"] if f["code"] in ("RUN008", "RUN009")], report["findings"]
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_backend_missing_on_the_ranks_is_an_error_on_each(tmp_path):
    """--backend nccl on a CPU-only torch under hand-set ranks: each rank's init fails on its own.

    Default twin: tests/ranks/test_launch_modes.py::test_missing_nccl_backend_is_one_line
    (the same missing NCCL backend on a CPU-only torch; there refused by the launcher up front)
    """
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL; the error path needs a CPU-only build")
    env = {r: {"LOCAL_RANK": str(r)} for r in (0, 1)}
    procs, report, tag = run_hand_set_ranks(tmp_path, 2, env, "--timeout", "6", "--backend", "nccl")
    assert procs[0].returncode == 2, procs[0].stdout + procs[0].stderr
    errors = [f for f in report["findings"] if f["code"] == "RUN003"]
    assert sorted(r for f in errors for r in f["ranks"]) == [0, 1]
    assert all(f["evidence"]["stage"] == "init" and "NCCL backend is not available" in f["evidence"]["error"]
               for f in errors)
    assert not tagged_processes(tag)
