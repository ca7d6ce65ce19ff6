"""The learned step deadline in a real DDP loop under torchrun (tests/ranks/clock_loop.py), no
`step_deadline_s` set: a hang in a loop of 5 ms steps is named within 30 s of its start, and a
healthy run with irregular steps (slow every 50, a marked checkpoint pause, an unmarked 1 s
pause) is never called hung."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .harness import _env, free_port, tagged_processes

pytestmark = pytest.mark.ranks
LOOP = Path(__file__).with_name("clock_loop.py")
TARGET_S = 30.0


def torchrun(tmp_path: Path, tag: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(LOOP), "--json", str(tmp_path / "doctor.json"), *args]
    return subprocess.Popen(cmd, env=_env(tag, None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def hangs_reported(tmp_path: Path) -> list[tuple[float, dict]]:
    """Every DOC007 in the ranks' findings files, with the time its file was written."""
    found = []
    for path in tmp_path.glob("doctor.json*"):
        try:
            written, report = path.stat().st_mtime, json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now: read at the next poll
            continue
        found += [(written, f) for f in report["findings"] if f["code"] == "DOC007"]
    return found


def end(proc: subprocess.Popen, tag: str) -> None:
    """Our run's processes killed (found by their tag), and none left."""
    for p in tagged_processes(tag):
        p.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged_processes(tag)


@pytest.mark.slow
def test_a_hang_in_a_5_ms_loop_is_named_within_30_s_with_no_deadline_set(tmp_path):
    """No step_deadline_s: the learned allowance (its 10 s floor) names a hang in a 5 ms loop within 30 s.

    Default twin: tests/ranks/test_callback_hang_e2e.py::test_a_rank_stuck_in_its_own_code_is_named_and_leaves_first
    (the same hang watcher and DOC007 verdict in a real loop under torchrun, with the deadline set;
    the learned clock watches every default Doctor run with no deadline set, test_divergence_e2e.py's,
    and its allowance is simulated step by step in tests/unit/test_step_clock.py)."""
    tag, started = uuid.uuid4().hex, tmp_path / "hang_started"
    proc = torchrun(tmp_path, tag, "--case", "hang", "--steps", "200", "--started", str(started))
    try:
        deadline = time.monotonic() + 60 + TARGET_S  # two ranks' start-up on a busy machine, then the target
        while not hangs_reported(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        reported = hangs_reported(tmp_path)
    finally:
        end(proc, tag)
    assert reported, proc.stderr.read() if proc.stderr else ""
    first, finding = min(reported, key=lambda r: r[0])
    took = first - float(started.read_text())
    print(f"hang named {took:.1f} s after it began: {finding['title']}")
    assert took < TARGET_S, took
    # The report says how the allowance was learned: the floor, not the 600 s ceiling.
    evidence = finding["evidence"]
    said = [evidence["deadline"]] if "deadline" in evidence else list(evidence["deadline_by_rank"].values())
    assert any(d["allowance_s"] == 10.0 and "typical step" in d["rule"] for d in said), evidence


# The slow tier (18.6 s of the default suite's budget); the healthy irregular runs are simulated step
# by step in tests/unit/test_step_clock.py.
@pytest.mark.slow
def test_a_healthy_run_with_irregular_steps_is_never_called_hung(tmp_path):
    """A healthy loop with irregular steps and pauses is never called hung by the learned deadline.

    Default twin: tests/ranks/test_divergence_e2e.py::test_a_healthy_loop_raises_nothing
    (the same learned step clock, no step_deadline_s set, watching healthy DDP loops on 2 ranks:
    no DOC007 allowed there either)."""
    tag = uuid.uuid4().hex
    proc = torchrun(tmp_path, tag, "--case", "healthy", "--steps", "1500")
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        end(proc, tag)
    assert proc.returncode == 0, err[-12000:]
    assert hangs_reported(tmp_path) == [], err[-12000:]
    for rank in range(2):  # every step and the checkpoint were seen, and the allowance is still the floor's
        clock = json.loads((tmp_path / f"clock{rank}.json").read_text())
        print(f"rank {rank}: {clock['steps_seen']} steps, typical {clock['typical_step_s'] * 1e3:.1f} ms, "
              f"allowance {clock['allowance_s']} s ({clock['rule']})")
        assert clock["steps_seen"] == 1501 and clock["allowance_s"] == 10.0, clock
