"""A step that hangs in a real DDP loop (tests/ranks/hang_loop.py, 2 CPU ranks on gloo): one
verdict on every rank naming the rank that caused it, and, with on_hang="exit", that rank
leaving first so torchrun's "Root Cause (first observed failure)" names it.

Launched as users do: torchrun (python -m torch.distributed.run), mp.spawn, and one process per
rank with the variables set by hand (srun, or ranks on other nodes: no local agent that stops
the others when one dies). The hang's start is when rank 1 begins to misbehave (it writes the
time); the verdict's time is when the last rank's findings file was written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

from tests.trace_format import check_rules, spans_of

from .harness import _env, free_port, tagged_processes

pytestmark = pytest.mark.ranks
LOOP = Path(__file__).with_name("hang_loop.py")
DEADLINE_S = 3.0
VERDICT_WITHIN_S = DEADLINE_S + 5.0
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", re.DOTALL)


def _commands(how: str, report: Path, case: str, port: int) -> list[tuple[list[str], dict[str, Optional[str]]]]:
    args = [str(LOOP), "--case", case, "--json", str(report), "--deadline", str(DEADLINE_S),
            "--trace", f"{report}.trace.json"]
    if how == "torchrun":
        return [([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                  *args], {})]
    if how == "spawn":
        return [([sys.executable, *args, "--spawn", "2", "--port", str(port)], {})]
    return [([sys.executable, *args], {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]


def _culprit(report: Path, until: float) -> Optional[dict[str, Any]]:
    path = Path(f"{report}.culprit")
    while time.monotonic() < until:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.05)
    return None


def _doc007(path: Path) -> Optional[dict[str, Any]]:
    try:
        found = json.loads(path.read_text())["findings"]
    except (OSError, ValueError):
        return None
    return next((f for f in found if f["code"] == "DOC007"), None)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _misbehave_from_outside(report: Path, case: str, until: float) -> None:
    """dead: SIGKILL rank 1 once it is inside its step; frozen: SIGSTOP it, then, once rank 0 has
    given its verdict and left (or the run's time is up), SIGKILL it (a stopped process outlives
    everything else otherwise)."""
    culprit = _culprit(report, until)
    if culprit is None:
        return
    pid = int(culprit["pid"])
    os.kill(pid, signal.SIGKILL if case == "dead" else signal.SIGSTOP)
    if case == "frozen":
        verdict = None
        while time.monotonic() < until and verdict is None:
            verdict = _doc007(report)
            time.sleep(0.1)
        victim = (verdict or {}).get("evidence", {}).get("pid_by_rank", {}).get("0")
        while victim is not None and time.monotonic() < until and _running(int(victim)):
            time.sleep(0.1)  # rank 0 leaves first, as it would with nobody to wake rank 1
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def run_hang(tmp_path: Path, how: str, case: str, timeout_s: float = 60) -> dict[str, Any]:
    tag, port = uuid.uuid4().hex, free_port()
    report = tmp_path / f"{how}-{case}.json"
    procs = [subprocess.Popen(cmd, env=_env(tag, extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, extra in _commands(how, report, case, port)]
    until = time.monotonic() + timeout_s
    outside = threading.Thread(target=_misbehave_from_outside, args=(report, case, until), daemon=True)
    if case in ("dead", "frozen"):
        outside.start()
    try:
        outputs = [p.communicate(timeout=max(1.0, until - time.monotonic())) for p in procs]
    finally:
        for p in tagged_processes(tag):  # whatever is left fails the test below; never left running
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    left = tagged_processes(tag)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    files = {0: report, 1: Path(f"{report}.rank1")}
    verdicts = {r: _doc007(p) for r, p in files.items() if _doc007(p) is not None}
    stderr = "\n".join(err for _, err in outputs)
    culprit = json.loads(Path(f"{report}.culprit").read_text())
    written = max(p.stat().st_mtime for r, p in files.items() if r in verdicts) if verdicts else None
    return {"exit": [p.returncode for p in procs], "stderr": stderr, "verdicts": verdicts, "port": port,
            "latency_s": written - culprit["t"] if written is not None else None,
            "root_cause": (lambda m: int(m.group(1)) if m else None)(ROOT_CAUSE.search(stderr))}


def assert_verdict(result: dict[str, Any], cause: str, ranks: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """Rank 1 named as the cause, rank 0 as its victim, the same finding in every rank's file, in time."""
    assert set(result["verdicts"]) == set(ranks), result["stderr"][-4000:]
    first = result["verdicts"][ranks[0]]
    for r in ranks:
        assert result["verdicts"][r] == first  # one verdict, word for word, on every rank
    assert first["ranks"] == [1] and first["evidence"]["cause_by_rank"] == {"1": cause}, first
    assert list(first["evidence"]["affected_ranks"]) == ["0"], first
    assert "waiting in DDP's gradient all-reduce" in first["evidence"]["affected_ranks"]["0"], first
    assert "hang_loop.py" in first["evidence"]["user_frame_by_rank"]["0"]
    assert "rank 0 waited for it" in first["title"] and "rank 0 (" not in first["title"], first["title"]
    assert result["latency_s"] is not None and result["latency_s"] <= VERDICT_WITHIN_S, result["latency_s"]
    print(f"verdict {result['latency_s']:.1f} s after the hang began (deadline {DEADLINE_S:g} s)")
    return first


@pytest.mark.parametrize("how", ["torchrun", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_rank_stuck_in_its_own_code_is_named_and_leaves_first(tmp_path, how):
    """The torchrun case stays in the default tier: it also checks torchrun's Root Cause and the culprit's 124;
    mp.spawn's launch is test_a_rank_killed_under_mp_spawn_is_named_by_the_launcher's."""
    result = run_hang(tmp_path, how, "own")
    first = assert_verdict(result, "own code")
    assert re.search(r"hang_loop\.py:\d+ in misbehave", first["evidence"]["user_frame_by_rank"]["1"])
    assert "lock.acquire()" in "\n".join(first["evidence"]["python_stack_rank_1"])
    # The timeline rank 0 wrote as the verdict came: rank 1's step the bar that does not end, with its stack,
    # and rank 0 waiting beside it.
    doc = json.loads((tmp_path / f"{how}-own.json.trace.json").read_text())
    check_rules(doc)
    [stuck] = [e for e in spans_of(doc, 1, "hang")]
    assert stuck["name"].endswith(" (stuck)") and "lock.acquire()" in stuck["args"]["stack"], stuck
    [waiting] = [e for e in spans_of(doc, 0, "hang")]
    assert waiting["name"].startswith("waiting in DDP's gradient all-reduce"), waiting
    assert spans_of(doc, 1, "step") and spans_of(doc, 0, "step")  # the steps kept before it
    if how == "torchrun":
        assert result["root_cause"] == 1 and result["exit"] == [1], result["stderr"][-3000:]
        # The culprit's own code; the victim left after it with 123, or torchrun stopped it first (SIGTERM).
        assert "exitcode  : 124" in result["stderr"].split("Root Cause")[1], result["stderr"][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "spawn"])
def test_a_rank_that_left_the_loop_early_is_named(tmp_path, how):
    """Rank 1 leaves the loop after step 5: named as the cause, rank 0 as its victim.

    Default twin: tests/ranks/test_callback_hang_e2e.py::test_a_rank_stuck_in_its_own_code_is_named_and_leaves_first
    (the same hang verdict, hang_loop.py's, one cause by rank read by callback/hang.py: a rank in its
    own code there, a rank that left the loop here; mp.spawn's launch is
    test_a_rank_killed_under_mp_spawn_is_named_by_the_launcher's)."""
    result = run_hang(tmp_path, how, "uneven")
    first = assert_verdict(result, "left")
    assert "left the training loop after step 5" in first["title"]
    if how == "torchrun":
        assert result["root_cause"] == 1, result["stderr"][-3000:]


def assert_launcher_named_it(tmp_path: Path, result: dict[str, Any], signal_name: str) -> None:
    """mp.spawn ends the job the moment a rank's process dies, SIGTERMing the others at once: the
    victim has no time for a verdict. Its own error names the culprit; no file of ours may blame
    the victim, nothing is left running and the store's port is free again."""
    assert f"process 1 terminated with signal {signal_name}" in result["stderr"], result["stderr"][-3000:]
    assert result["exit"] == [1], result["exit"]
    for path in tmp_path.glob("*.json*"):
        finding = _doc007(path) if not path.name.endswith(".culprit") else None
        assert finding is None or finding["ranks"] == [1], (path.name, finding)
    # The killed store's accepted connections linger in TIME_WAIT (a plain bind fails for 60 s):
    # what matters to the next job is that nothing listens there any more.
    listening = [c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == result["port"]]
    assert not listening, f"port {result['port']} still listened on after the run: {listening}"
    print(f"mp.spawn: process 1 terminated with signal {signal_name}; verdicts written: {sorted(result['verdicts'])}")


@pytest.mark.parametrize("how", [pytest.param("torchrun", marks=pytest.mark.slow), "hand"])
def test_a_rank_killed_from_outside_is_named_dead(tmp_path, how):
    """The hand-set case stays in the default tier: the one default launch of ranks by hand (no agent to stop
    the victim, so its verdict is always written); torchrun is the default tier's own-code case's launch."""
    result = run_hang(tmp_path, how, "dead")
    first = assert_verdict(result, "dead", ranks=(0,))
    assert "died (process" in first["title"]


def test_a_rank_killed_under_mp_spawn_is_named_by_the_launcher(tmp_path):
    assert_launcher_named_it(tmp_path, run_hang(tmp_path, "spawn", "dead"), "SIGKILL")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "hand", "spawn"])
def test_a_frozen_rank_is_named_frozen(tmp_path, how):
    """Rank 1 stopped (SIGSTOP) inside its step: named frozen, rank 0 as its victim.

    Default twin: tests/ranks/test_callback_hang_e2e.py::test_a_rank_killed_from_outside_is_named_dead
    (its hand-set case: the same verdict for a silent peer whose process state callback/hang.py reads
    from /proc, gone there, stopped here; the dead/frozen/left causes are tests/unit/test_callback_hang.py's)."""
    result = run_hang(tmp_path, how, "frozen")
    first = assert_verdict(result, "frozen", ranks=(0,))
    assert "is frozen" in first["title"]
    if how == "spawn":
        # A frozen rank cannot exit: the victim leaves first (123) and mp.spawn names it; its 123
        # says "a victim", the verdict in its file names the culprit.
        assert "process 0 terminated with exit code 123" in result["stderr"], result["stderr"][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "hand"])
def test_a_desync_names_the_rank_in_the_other_collective(tmp_path, how):
    """Rank 1 calls another collective: gloo aborts it and rank 0's verdict names it dead.

    Default twin: tests/ranks/test_callback_hang_e2e.py::test_a_rank_killed_from_outside_is_named_dead
    (its hand-set case: the same verdict, cause "dead", for a rank whose process is gone, killed
    there, aborted by gloo here; torchrun's Root Cause is the own-code case's)."""
    # gloo checks sizes: rank 1's extra 3-float all_reduce receives rank 0's gradient bucket and
    # gloo aborts it ("Received data size doesn't match expected size"); rank 0's all-reduce then fails.
    # (Under mp.spawn the launcher stops rank 0 the moment rank 1 dies, before any verdict: its own
    # "process 1 terminated with signal SIGABRT" names the cause there: the test below.)
    result = run_hang(tmp_path, how, "desync")
    if how == "torchrun" and not result["verdicts"]:
        # torchrun polls every 0.1 s and SIGTERMs rank 0 when rank 1 aborts: on a busy host that
        # can come before rank 0's verdict (0.0 to 0.2 s): then torchrun's Root Cause names rank 1.
        assert result["root_cause"] == 1 and "(SIGABRT)" in result["stderr"], result["stderr"][-3000:]
        return
    first = assert_verdict(result, "dead", ranks=(0,))
    assert "Connection closed by peer" in first["evidence"]["affected_ranks"]["0"] or \
        "failed" in first["evidence"]["affected_ranks"]["0"]
    if how == "torchrun":
        assert result["root_cause"] == 1, result["stderr"][-3000:]


@pytest.mark.slow
def test_a_desync_under_mp_spawn_is_named_by_the_launcher(tmp_path):
    """mp.spawn names rank 1, aborted by gloo for a desync, and nothing of ours blames rank 0.

    Default twin: tests/ranks/test_callback_hang_e2e.py::test_a_rank_killed_under_mp_spawn_is_named_by_the_launcher
    (the same mp.spawn launch and assert_launcher_named_it: SIGKILL there, SIGABRT here)."""
    result = run_hang(tmp_path, "spawn", "desync")
    assert "Received data size doesn't match expected size" in result["stderr"], result["stderr"][-3000:]
    assert_launcher_named_it(tmp_path, result, "SIGABRT")
