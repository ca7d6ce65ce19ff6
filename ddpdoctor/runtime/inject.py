"""Fault injection: make a chosen rank really misbehave, as a test and a fire drill.

The grammar is parsed in core/faults.py; here the faults are carried out on the rank (crash,
hang, kill, out of memory, slow, no-show, ...). Faults are always recorded in the report.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Optional

from ddpdoctor.core.exits import INJECTED_CRASH_EXIT, hard_exit
from ddpdoctor.core.faults import BAD_ADDR, LAUNCHER_SIGNALS, OUTSIDE, SLOW_LINK_BYTES_PER_S, Fault


class Injector:
    """The per-rank hooks. Each stage calls `at_stage`; the workload asks `slow_factor`."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = tuple(f for f in faults if rank in (f.rank, f.peer))
        self.run_faults = faults  # every rank's: peers of a faulty rank must take part in its collective
        self.rank = rank
        self._blipped: set[Fault] = set()  # blips already spent

    def at_stage(self, stage: str) -> None:
        if stage == "launch":
            self._start_outside()
        for fault in self.faults:
            if fault.stage != stage:
                continue
            if fault.kind == "crash":
                _say(f"injected crash on rank {self.rank} in stage {stage}")
                hard_exit(INJECTED_CRASH_EXIT)
            if fault.kind == "hang":
                _hang_forever()
            if fault.kind == "kill":
                _say(f"injected SIGKILL on rank {self.rank} in stage {stage}")
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "oom":
                _say(f"injected out-of-memory on rank {self.rank} in stage {stage}")
                run_out_of_memory()
            if fault.kind in LAUNCHER_SIGNALS:
                _signal_launcher(self.rank, stage, LAUNCHER_SIGNALS[fault.kind])

    def _start_outside(self) -> None:
        """The faults a separate process makes on this rank, from now to the rank's end (the
        helper watches this process and undoes its fault when it is gone, however it ends)."""
        from ddpdoctor.runtime import outside_faults

        for fault in self.faults:
            if fault.kind not in OUTSIDE:
                continue
            try:
                made = outside_faults.start(fault.kind, os.getpid(), pct=fault.pct or 100.0,
                                            mb=fault.mb or 512.0, cpu=self.rank)
            except (outside_faults.OutsideFaultError, OSError) as exc:
                _say(f"injected {fault.describe()} could not be made: {exc}")
                continue
            _say(f"injected {fault.describe()} from outside (helper pid {made.pid}): {made.note}")

    def slow_factor(self) -> float:
        factors = [f.factor for f in self.faults if f.kind == "slow" and f.factor]
        return max(factors, default=1.0)

    def data_delay_s(self) -> float:
        """How long this rank's data loader stalls per batch (slowdata), in seconds."""
        return max((f.ms for f in self.faults if f.kind == "slowdata" and f.ms), default=0.0) / 1000.0

    def batch_factor(self) -> float:
        return max((f.factor for f in self.faults if f.kind == "bigbatch" and f.factor), default=1.0)

    def diverges(self) -> bool:
        return any(f.kind == "diverge" for f in self.faults)

    def desyncs(self) -> bool:
        return any(f.kind == "desync" for f in self.faults)

    def no_show(self) -> bool:
        return any(f.kind == "noshow" for f in self.faults)

    def rendezvous_target(self, addr: str, port: int) -> tuple[str, int]:
        """Where this rank dials the store: the real address, or the injected wrong one."""
        if any(f.kind == "badaddr" for f in self.faults):
            addr = BAD_ADDR
        if any(f.kind == "badport" for f in self.faults):
            port = _closed_port(port)
        return addr, port

    def metrics_dtype(self) -> Optional[str]:
        """The dtype of the one-off metrics all-reduce, when a dtype fault is in the run; else None."""
        if not any(f.kind == "dtype" for f in self.run_faults):
            return None
        return "float64" if any(f.kind == "dtype" for f in self.faults) else "float32"

    def corrupts(self) -> bool:
        return any(f.kind == "corrupt" for f in self.faults)

    def link_delay_s(self, group_ranks: Any, size_bytes: int) -> float:
        """Extra time a collective of `size_bytes` over `group_ranks` spends on an injected slow link."""
        members = set(group_ranks)
        slow = [f.link_bytes_per_s() for f in self.faults if f.kind == "slowlink" and {f.rank, f.peer} <= members]
        if slow:
            return size_bytes / min(slow)
        for f in self.faults:
            if f.kind == "blip" and {f.rank, f.peer} == members and f not in self._blipped:
                self._blipped.add(f)
                return size_bytes / SLOW_LINK_BYTES_PER_S
        return 0.0


def _say(line: str) -> None:
    sys.stderr.write(f"ddpdoctor: {line}\n")
    sys.stderr.flush()


def _signal_launcher(rank: int, stage: str, name: str) -> None:
    from ddpdoctor.runtime.launch_env import LAUNCHER_PID_VAR

    pid = os.environ.get(LAUNCHER_PID_VAR, "")
    if pid.isdigit():
        _say(f"injected {name} to the launcher (pid {pid}) from rank {rank} in stage {stage}")
        os.kill(int(pid), getattr(signal, name))


# Address space left to a rank that must run out of memory: enough for its threads to go on.
_OOM_HEADROOM_BYTES = 256 << 20


def run_out_of_memory() -> None:
    """Allocate until an allocation really fails, then free it all and let the error propagate.

    On a GPU rank: CUDA memory until torch raises OutOfMemoryError. On a CPU rank: the
    address space is capped (RLIMIT_AS) a little above what the process uses, and one
    allocation larger than the rest fails; the cap is lifted again before the MemoryError
    leaves, so the rank can still report it.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        held = []
        try:
            while True:
                held.append(torch.empty(1 << 30, dtype=torch.uint8, device=torch.cuda.current_device()))
        finally:
            del held
            torch.cuda.empty_cache()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = used + _OOM_HEADROOM_BYTES
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        # One allocation larger than what is left, as a real batch that does not fit: it fails at
        # once, and the headroom stays there for the rank's other threads (heartbeat, gloo).
        bytearray(2 * _OOM_HEADROOM_BYTES)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _closed_port(avoid: int) -> int:
    """A port nothing listens on right now: the kernel's pick for a socket we then close."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port


def no_show() -> None:
    sys.stderr.write("ddpdoctor: injected no-show: this rank will not join\n")
    sys.stderr.flush()
    _hang_forever()


def _hang_forever() -> None:
    # A real hang in Python code: only a deadline or a signal ends it.
    while True:
        time.sleep(3600)
