"""Run ddpdoctor as a user would, in real processes, and prove nothing is left behind.

Every run is tagged with a unique environment variable; after it, no process carrying
the tag may exist and the rendezvous port must be bindable again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil

TAG_VAR = "DDPDOCTOR_TEST_TAG"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    report: Optional[dict[str, Any]]
    tag: str
    port: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def findings(self, code: Optional[str] = None) -> list[dict[str, Any]]:
        found = (self.report or {}).get("findings", [])
        return [f for f in found if code is None or f["code"] == code]

    def severities(self) -> set[str]:
        return {f["severity"] for f in self.findings()}

    def explain(self) -> str:
        return f"rc={self.returncode} wall={self.wall_s:.1f}s\nSTDOUT:\n{self.stdout[-4000:]}\nSTDERR:\n{self.stderr[-3000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tagged_processes(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_VAR) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_nothing_left(run: Run, settle_s: float = 5.0) -> None:
    deadline = time.monotonic() + settle_s
    while True:
        left = tagged_processes(run.tag)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in left:  # clean up before failing, so one failure does not cascade
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"orphaned processes: {[(p.pid, p.cmdline()) for p in left]}\n{run.explain()}"
    if run.port is not None:
        assert port_is_free(run.port), f"port {run.port} still bound after the run\n{run.explain()}"


def _env(tag: str, extra: Optional[dict[str, Optional[str]]]) -> dict[str, str]:
    """The test's environment for a run; a None value in `extra` removes that variable."""
    env = {k: v for k, v in os.environ.items()}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_check(tmp_path: Path, *args: str, env: Optional[dict[str, str]] = None, timeout_s: float = 90,
              signal_after: Optional[tuple[float, int]] = None, use_port: bool = True) -> Run:
    """`python -m ddpdoctor check --no-live --json ... ARGS` as a user runs it."""
    tag = uuid.uuid4().hex
    report_path = tmp_path / f"report-{tag[:8]}.json"
    port = free_port() if use_port else None
    cmd = [sys.executable, "-m", "ddpdoctor", "check", "--no-live", "--json", str(report_path), *args]
    if port is not None:
        cmd += ["--port", str(port)]
    return _run(cmd, tag, env, timeout_s, signal_after, report_path, port)


def run_command(cmd: list[str], tmp_path: Path, env: Optional[dict[str, str]] = None, timeout_s: float = 90,
                report_name: Optional[str] = None) -> Run:
    tag = uuid.uuid4().hex
    report_path = tmp_path / report_name if report_name else None
    return _run(cmd, tag, env, timeout_s, None, report_path, None)


def _run(cmd: list[str], tag: str, env: Optional[dict[str, str]], timeout_s: float,
         signal_after: Optional[tuple[float, int]], report_path: Optional[Path], port: Optional[int]) -> Run:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(tag, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_after is not None:
        # Count the delay from when the launcher has spawned its ranks: before that it is
        # still importing torch, and a signal then tests Python's defaults, not ddpdoctor.
        delay, sig = signal_after
        deadline = time.monotonic() + 60
        while len(tagged_processes(tag)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(delay)
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in tagged_processes(tag):
            p.kill()
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"ddpdoctor did not finish within {timeout_s}s: {cmd}\n{out[-3000:]}\n{err[-3000:]}")
    wall = time.perf_counter() - start
    report = None
    if report_path is not None and report_path.exists():
        report = json.loads(report_path.read_text())
    return Run(proc.returncode, out, err, wall, report, tag, port)


__all__ = ["Run", "run_check", "run_command", "assert_nothing_left", "free_port", "signal"]


def run_hand_set_ranks(tmp_path: Path, world_size: int, per_rank_env: dict[int, dict[str, str]],
                       *args: str, timeout_s: float = 90, command: str = "check",
                       prefix: Optional[dict[int, list[str]]] = None,
                       ) -> tuple[list[subprocess.CompletedProcess], Optional[dict[str, Any]], str]:
    """Start ranks with RANK/WORLD_SIZE set by hand (as a job script might), each with its own env.

    `prefix`: a command to start a rank through (e.g. `taskset -c 1`, as srun --cpu-bind would).
    Returns each rank's completed process, rank 0's JSON report, and the run's tag.
    """
    tag = uuid.uuid4().hex
    port = free_port()
    report_path = tmp_path / f"hand-{tag[:8]}.json"
    procs = []
    for rank, extra in sorted(per_rank_env.items()):
        env = _env(tag, {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port), **extra})
        procs.append((subprocess.Popen([*(prefix or {}).get(rank, []), sys.executable, "-m", "ddpdoctor", command,
                                        "--json", str(report_path), *args],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), rank))
    done = []
    for proc, rank in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in tagged_processes(tag):
                p.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout_s}s")
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return done, report, tag


def probe_section(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in report["probes"] if p["name"] == name)


def run_script_ranks(script: Path, args: list[str], ports: dict[int, int], timeout_s: float = 60,
                     extra_env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None,
                     srun: bool = False, python_args: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """A user's training script started once per rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set (`ports`: each rank's MASTER_PORT), as torchrun would; (exit code, stderr) per rank. `srun`:
    as srun starts its tasks, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and no RANK (the script maps them).
    `python_args`: between the interpreter and the script (`-m ddpdoctor run --json ...`).

    Every process is gone afterwards (killed at the timeout): asserted, as for our own runs."""
    tag = uuid.uuid4().hex

    def ids(r: int) -> dict[str, Optional[str]]:
        if srun:
            return {"RANK": None, "LOCAL_RANK": None, "WORLD_SIZE": None, "SLURM_PROCID": str(r),
                    "SLURM_LOCALID": str(r), "SLURM_NTASKS": str(len(ports)), "SLURM_NODEID": "0",
                    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
        return {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(len(ports))}

    procs = [subprocess.Popen([sys.executable, *python_args, str(script), *args], cwd=cwd,
                              env=_env(tag, {**ids(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[r]),
                                             **(extra_env or {})}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in sorted(ports)]
    try:
        results = []
        for p in procs:
            _, err = p.communicate(timeout=timeout_s)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    left = tagged_processes(tag)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    return results
