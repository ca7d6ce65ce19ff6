"""Whose CPU load: a real busy process is seen as foreign, our own processes are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from ddpdoctor.measure.host_load import CpuSample, foreign_load, our_processes, sample


def test_a_real_busy_process_is_foreign_load_and_we_are_not():
    # Started through a shell that exits at once: another job's process, not one under us.
    out = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    busy = psutil.Process(int(out.stdout.strip()))
    try:
        time.sleep(0.3)  # past its start-up
        start = sample()
        spin_until = time.monotonic() + 0.6
        while time.monotonic() < spin_until:  # this process is busy too, but it is ours
            pass
        end = sample()
        assert start is not None and end is not None
        ours = our_processes([os.getpid()])
        assert os.getppid() in ours and busy.pid not in ours  # parents are ours; a sibling job is not
        load = foreign_load(start, end, ours, top=1000)
        top = {p["pid"]: p for p in load["top"]}
        assert busy.pid in top and top[busy.pid]["cpu_pct"] >= 15, load
        assert os.getpid() not in top
        assert 0.15 <= load["foreign_cpus_busy"] <= (os.cpu_count() or 1) + 0.5, load
    finally:
        busy.kill()
        busy.wait(5)


def test_a_reused_pid_counts_from_zero_and_ours_are_left_out():
    ours2 = frozenset({0, 1})
    start = CpuSample(10.0, ours2, 100.0, {1: ("init", 0.0, 1.0, 5.0), 50: ("old", 3.0, 1.0, 100.0),
                                           60: ("rank", 4.0, 1.0, 1.0), 80: ("kworker/0:1-events", 2.0, 1.0, 7.0),
                                           90: ("pinned-elsewhere", 1.0, 0.0, 10.0), 91: ("half", 1.0, 0.5, 0.0)})
    end = CpuSample(12.0, ours2, 103.0, {1: ("init", 0.0, 1.0, 5.0), 50: ("new", 9.0, 1.0, 1.0),
                                         60: ("rank", 4.0, 1.0, 3.0), 70: ("late", 11.0, 1.0, 0.5),
                                         80: ("kworker/0:1-mm_percpu_wq", 2.0, 1.0, 7.0),
                                         90: ("pinned-elsewhere", 1.0, 0.0, 14.0), 91: ("half", 1.0, 0.5, 1.0)})
    load = foreign_load(start, end, ours={60})
    # pid 50 is another program now (started later): its 1 s is all new; pid 70 started mid-check;
    # 60 is ours; 80 renamed itself but is the same process and was idle; 90 may only run on
    # CPUs that are not ours (counts for nothing); 91 on ours and as many others (counts half).
    assert load["foreign_cpus_busy"] == 1.0
    assert [p["pid"] for p in load["top"]] == [50, 91, 70]
    assert load["top"][0]["cpu_pct"] == 50
    assert load["cpus_busy"] == 1.5 and load["cpus"] == 2
