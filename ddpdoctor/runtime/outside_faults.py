"""Faults made from outside a rank, the way the world makes them: a separate process acts on it.

- `hog`: a busy process pinned to the rank's CPUs (the rank is pinned to one first if it may run
  anywhere), as a data loader's workers or another job's process on the same cores would be;
  `pct` is the share of the time it spins (100: a full competing process).
- `quota`: a CPU quota on the rank's process: a cgroup with cgroup v2 `cpu.max` or v1
  `cpu.cfs_quota_us`/`cpu.cfs_period_us`, as a container limit or a Slurm cgroup would set it.
  Where neither is writable (no root, a read-only /sys/fs/cgroup) the fault fails, saying so.
- `preempt`: the rank's process stopped with SIGSTOP and continued with SIGCONT from outside,
  `pct` of every PERIOD_S, as a hypervisor or a preempting scheduler does it.
- `mempressure`: a process that allocates `mb` MiB and keeps touching it.

The helper is one process (`python -m ddpdoctor.runtime.outside_faults`), detached from the rank
(it is nobody's child but init's, in a process group of its own) and never orphaned: it
watches its target and undoes its fault and ends within WATCH_S of the target's end, whatever
the end was (a crash, SIGKILL, Ctrl-C); SIGTERM or SIGINT to it end it the same way. Whatever it
starts (the busy or allocating child) dies with it (PR_SET_PDEATHSIG) and is killed by it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ddpdoctor.core.exits import hard_exit

KINDS = ("hog", "quota", "preempt", "mempressure")
PERIOD_S = 0.1  # preempt's duty cycle and the cgroup quota's period
WATCH_S = 0.02  # how soon the helper sees its target gone
READY_S = 10.0  # how long a starter waits for the helper to say it acts
HOG_NAME = "ddpdoctor-hog"
MEM_NAME = "ddpdoctor-mem"
CGROUP_PREFIX = "ddpdoctor-quota-"


class OutsideFaultError(RuntimeError):
    """The fault could not be made (e.g. no writable cgroup): the helper's one line says why."""


@dataclass
class OutsideFault:
    """A running helper: `stop()` ends it (and its fault) and waits for it to be gone."""

    kind: str
    target: int
    pid: int  # the helper's
    note: str  # what it did: the CPUs, the cgroup, ...

    def stop(self, timeout_s: float = 5.0) -> None:
        _end(self.pid, timeout_s)


def start(kind: str, target: int, pct: float = 100.0, mb: float = 512.0, cpu: Optional[int] = None) -> OutsideFault:
    """Start the helper against process `target`; returns once the fault acts (or raises)."""
    if kind not in KINDS:
        raise ValueError(f"unknown outside fault {kind!r}: {', '.join(KINDS)}")
    cmd = [sys.executable, "-m", "ddpdoctor.runtime.outside_faults", kind, "--target", str(target),
           "--pct", f"{pct:g}", "--mb", f"{mb:g}"] + ([] if cpu is None else ["--cpu", str(cpu)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_S)
    line = proc.stdout.readline().strip() if ready else ""
    proc.stdout.close()
    proc.wait(timeout=READY_S)  # the first process exits once the detached helper is running
    word, _, rest = line.partition(" ")
    if word != "ready":
        raise OutsideFaultError(rest or line or f"the {kind} helper did not start within {READY_S:g} s")
    pid, _, note = rest.partition(" ")
    return OutsideFault(kind=kind, target=target, pid=int(pid), note=note)


def _end(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.02)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# -- the helper process ---------------------------------------------------------------------

def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _set_name(name: str) -> None:
    _libc().prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME: what ps and psutil show


def _pin_all_threads(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def _pin_target(target: int, cpu: Optional[int]) -> set[int]:
    """The target's CPUs; a target that may run anywhere is pinned to one first (`cpu`, else its last)."""
    cpus = set(os.sched_getaffinity(target))
    every = set(range(os.cpu_count() or 1))
    if cpus >= every and len(cpus) > 1:
        chosen = cpu % len(cpus) if cpu is not None else max(cpus)
        cpus = {sorted(cpus)[chosen] if cpu is not None else chosen}
        _pin_all_threads(target, cpus)
    return cpus


def _child(name: str, cpus: Optional[set[int]], body: Callable[[], None]) -> int:
    """A forked child running `body`, dying with this helper; returns once it is named and pinned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            _die_with_parent()
            _set_name(name)
            if cpus:
                os.sched_setaffinity(0, cpus)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            os.write(write, b"1")
            os.close(write)
            body()
        finally:
            hard_exit(0)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    return pid


def _spin(pct: float) -> None:
    busy = PERIOD_S * pct / 100.0
    while True:
        end = time.perf_counter() + busy
        while time.perf_counter() < end:
            pass
        if pct < 100:
            time.sleep(PERIOD_S - busy)


def _touch(mb: float) -> None:
    size = int(mb * 2**20)
    block = bytearray(size)
    while True:
        for i in range(0, size, 4096):
            block[i] = (block[i] + 1) & 0xFF
        time.sleep(0.2)


class _Quota:
    """The target moved into a cgroup of its own with a quota; `undo` moves it back and removes it."""

    def __init__(self, target: int, pct: float) -> None:
        from ddpdoctor.measure.contention import cpu_cgroup_dir

        self.target = target
        here = cpu_cgroup_dir(str(target))
        if here is None:
            raise OutsideFaultError("no cpu cgroup found for the rank (neither cgroup v1's cpu controller nor v2)")
        self.home = here
        self.path = os.path.join(here, f"{CGROUP_PREFIX}{target}")
        period_us = int(PERIOD_S * 1e6)
        quota_us = max(1000, int(period_us * pct / 100.0))
        try:
            os.makedirs(self.path, exist_ok=True)
            if os.path.exists(os.path.join(self.path, "cpu.max")):  # v2
                _write(os.path.join(self.path, "cpu.max"), f"{quota_us} {period_us}")
            else:  # v1
                _write(os.path.join(self.path, "cpu.cfs_period_us"), str(period_us))
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota_us))
            _write(os.path.join(self.path, "cgroup.procs"), str(target))
        except OSError as exc:
            self._remove()
            raise OutsideFaultError(f"cannot set a CPU quota in {here}: {exc.strerror or exc} (cgroup v2 cpu.max and "
                                    "v1 cpu.cfs_quota_us both need a writable cgroup: root, or a delegated one)") from None
        self.note = f"cgroup {self.path}: {quota_us} us every {period_us} us"

    def undo(self) -> None:
        if _alive(self.target):
            try:
                _write(os.path.join(self.home, "cgroup.procs"), str(self.target))
            except OSError:
                pass
        self._remove()

    def _remove(self) -> None:
        deadline = time.monotonic() + 2.0
        while os.path.isdir(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class _Helper:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.target = args.target
        self.children: list[int] = []
        self.quota: Optional[_Quota] = None
        self.stopped = False
        self.done = False

    def setup(self) -> str:
        a = self.args
        if a.kind == "hog":
            cpus = _pin_target(self.target, a.cpu)
            self.children.append(_child(HOG_NAME, cpus, lambda: _spin(a.pct)))
            return f"{HOG_NAME} pinned to CPU {','.join(map(str, sorted(cpus)))} with the rank, busy {a.pct:g}%"
        if a.kind == "mempressure":
            self.children.append(_child(MEM_NAME, None, lambda: _touch(a.mb)))
            return f"{MEM_NAME} holding and touching {a.mb:g} MiB"
        if a.kind == "quota":
            self.quota = _Quota(self.target, a.pct)
            return self.quota.note
        return f"SIGSTOP {a.pct:g}% of every {PERIOD_S * 1e3:g} ms"

    def run(self) -> None:
        a = self.args
        stop_s = PERIOD_S * a.pct / 100.0 if a.kind == "preempt" else 0.0
        while not self.done and _alive(self.target):
            if stop_s:
                self._signal(signal.SIGSTOP)
                self._sleep(stop_s)
                self._signal(signal.SIGCONT)
                self._sleep(PERIOD_S - stop_s)
            else:
                self._sleep(0.25)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.done and time.monotonic() < end:
            time.sleep(min(WATCH_S, max(0.0, end - time.monotonic())))
            if not _alive(self.target):
                self.done = True

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.target, sig)
            self.stopped = sig == signal.SIGSTOP
        except ProcessLookupError:
            self.done = True

    def undo(self) -> None:
        if self.stopped:
            self._signal(signal.SIGCONT)
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        if self.quota is not None:
            self.quota.undo()


def _detach() -> None:
    """Fork; the first process exits, the helper goes on as init's child in a process group of its own.

    It stays in the starter's session, as a rank's data loader workers do: where the kernel
    schedules sessions as groups (autogroup), the busy child then competes with the rank itself,
    not with the whole host's other sessions."""
    if os.fork() > 0:
        hard_exit(0)
    os.setpgid(0, 0)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--pct", type=float, default=100.0)
    parser.add_argument("--mb", type=float, default=512.0)
    parser.add_argument("--cpu", type=int, default=None)
    args = parser.parse_args(argv)
    _detach()
    helper = _Helper(args)

    def finish(signum: int, frame: Any) -> None:
        helper.done = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, finish)
    try:
        note = helper.setup()
    except (OutsideFaultError, OSError) as exc:
        helper.undo()
        print(f"error {exc}", flush=True)
        return 1
    print(f"ready {os.getpid()} {note}", flush=True)
    sys.stdout.close()
    try:
        helper.run()
    finally:
        helper.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
