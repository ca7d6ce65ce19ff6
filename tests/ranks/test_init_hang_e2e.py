"""Probe `init-hang` end to end: ranks started by hand that reach the rendezvous late, not at all
through a port that drops packets, or with a socket interface their host does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.dropping_port import dropping_port

from .harness import free_port, run_command, run_hand_set_ranks, tagged_processes, TAG_VAR

pytestmark = pytest.mark.ranks


@pytest.mark.slow
def test_a_port_that_drops_packets_is_told_from_a_closed_one(tmp_path):
    """A listener whose accept queue is full drops SYNs as a firewall does; the rank says so in one line.

    Default twin: tests/ranks/test_launch_modes.py::test_unreachable_rendezvous_is_one_line_and_critical
    (the same hand-set rank dialling the store and failing in one critical line; there refused, here no answer)
    """
    with dropping_port() as port:
        env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        run = run_command([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "4"], tmp_path, env=env)
    assert run.returncode == 2, run.explain()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.explain()
    assert f"could not reach the rendezvous store at 127.0.0.1:{port} within 2.8s: no answer from" in lines[0]
    assert "firewall" in lines[0]
    assert run.wall_s < 20


@pytest.mark.slow
def test_a_rank_started_late_is_named_with_the_gap(tmp_path):
    """Its 14 s late start is the point, and the cost: the slow tier.

    Default twin: tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm
    (the same init-hang probe timing every rank's start and arrival, init_s asserted per rank; there they
    arrive together. INIT004's rule: tests/unit/test_init_hang.py)
    """
    tag = "late-" + str(time.time())
    port = free_port()
    procs = []
    for rank, delay in ((0, 0.0), (1, 14.0)):
        time.sleep(delay)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", **{TAG_VAR: tag})
        procs.append(subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "--timeout", "30", "--json",
                                       str(tmp_path / f"late{rank}.json"), "--probes", "init-hang"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=90) for p in procs]
    report = json.loads((tmp_path / "late0.json").read_text())
    late = [f for f in report["findings"] if f["code"] == "INIT004"]
    assert procs[0].returncode == 1, outs[0]
    assert len(late) == 1 and late[0]["ranks"] == [1], outs[0]
    gap = late[0]["evidence"]["arrival_after_first_s"]["1"]
    assert 10 <= gap <= 20, late
    # The rank's own start-up (imports) is small next to the gap: it was started late.
    assert late[0]["evidence"]["start_to_arrival_s"]["1"] < gap
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_an_interface_name_this_host_lacks_is_named_even_though_init_then_fails(tmp_path):
    """Default twin: tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm
    (the same init-hang probe reading each rank's route and interfaces, asserted per rank; there they are
    right. INIT001's rule: tests/unit/test_init_hang.py)
    """
    env = {0: {"GLOO_SOCKET_IFNAME": "lo"}, 1: {"GLOO_SOCKET_IFNAME": "ib7"}}
    procs, report, tag = run_hand_set_ranks(tmp_path, 2, env, "--timeout", "5", "--probes", "init-hang")
    assert procs[0].returncode == 2, procs[0].stdout + procs[0].stderr
    bad = [f for f in report["findings"] if f["code"] == "INIT001"]
    assert len(bad) == 1 and bad[0]["ranks"] == [1], report["findings"]
    assert bad[0]["evidence"]["variable"] == "GLOO_SOCKET_IFNAME" and bad[0]["evidence"]["value"] == "ib7"
    assert "lo" in bad[0]["evidence"]["interfaces_up"]
    # The group init really failed on that rank, with the very error the finding predicted.
    failed = [f for f in report["findings"] if f["code"] == "RUN008"]
    assert failed and failed[0]["evidence"]["collective_by_rank"]["1"].startswith("init_process_group"), report
    assert bad[0]["evidence"]["expected_error"] in failed[0]["evidence"]["errors"]["1"]
    # One verdict first (issue 37): the interface, the cause, leads; the failed init hangs under it.
    assert report["findings"][0]["code"] == "INIT001", [f["code"] for f in report["findings"]]
    assert failed[0]["explained_by"] == "INIT001", failed[0]
    assert report["verdict_line"].startswith("INIT001 (rank 1)"), report["verdict_line"]
    assert not tagged_processes(tag)
