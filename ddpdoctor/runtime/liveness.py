"""A rank's two helper threads: the heartbeat and the stage-deadline watchdog.

Both write through their own store connection (the main thread may be blocked inside
the store or a collective), guarded by one lock. The watchdog is what turns a hang into
a finding: at a stage's deadline it publishes where this rank is (stage, collective in
flight, every thread's Python stack) and ends the process, because a thread blocked in
a C++ collective cannot be interrupted from Python. faulthandler backs it up for the
case where the main thread holds the GIL and no Python thread can run at all.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Callable, Optional

from ddpdoctor.core import keys
from ddpdoctor.core.exits import ORPHANED_EXIT, STAGE_TIMEOUT_EXIT, hard_exit
from ddpdoctor.runtime.channel import Channel
from ddpdoctor.runtime.rank_state import RankState



def main_thread_frame() -> Optional[FrameType]:
    """The main thread's innermost frame (None if it has none): where training is, seen from a helper thread."""
    main = threading.main_thread().ident
    return sys._current_frames().get(main) if main is not None else None


def python_stacks(skip_current: bool = True) -> str:
    """Every thread's stack, main thread first: where this rank is stuck."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: (ident != main, ident))
    chunks = []
    for ident in order:
        if skip_current and ident == me:
            continue
        if str(names.get(ident, "")).startswith("ddpdoctor-"):
            continue  # our own heartbeat and watchdog threads: never the culprit
        stack = "".join(traceback.format_stack(frames[ident]))
        chunks.append(f"Thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(chunks)


class SideChannel:
    """A second store connection for helper threads, serialised by a lock."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()

    def set(self, key: str, value: Any) -> bool:
        try:
            with self.lock:
                self.channel.set(key, value)
            return True
        except Exception:  # the store may be gone: the caller decides what silence means
            return False


class Heartbeat(threading.Thread):
    def __init__(self, side: SideChannel, rank: int, state: RankState, period_s: float,
                 lost_after_s: float, parent_pid: Optional[int]) -> None:
        super().__init__(name="ddpdoctor-heartbeat", daemon=True)
        self.side, self.rank, self.state = side, rank, state
        self.period_s, self.lost_after_s, self.parent_pid = period_s, lost_after_s, parent_pid
        self.stopped = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self.stopped.wait(self.period_s):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                # Our launcher died (even SIGKILL): never outlive it.
                hard_exit(ORPHANED_EXIT)
            if self.side.set(keys.heartbeat(self.rank), self.state.snapshot()):
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > self.lost_after_s:
                sys.stderr.write(f"ddpdoctor: rank {self.rank} lost the out-of-band store; exiting\n")
                sys.stderr.flush()
                hard_exit(ORPHANED_EXIT)

    def stop(self) -> None:
        self.stopped.set()


class Watchdog(threading.Thread):
    """Fires once, at the deadline of the stage that is armed; never returns from firing."""

    def __init__(self, side: SideChannel, rank: int, state: RankState,
                 on_fire: Optional[Callable[[], Optional[int]]] = None) -> None:
        super().__init__(name="ddpdoctor-watchdog", daemon=True)
        self.side, self.rank, self.state = side, rank, state
        self.on_fire = on_fire
        self.cond = threading.Condition()
        self.deadline: Optional[float] = None
        self.armed_stage = ""
        self.armed_for_s = 0.0
        self.closed = False

    def arm(self, stage: str, seconds: float) -> None:
        with self.cond:
            self.deadline = time.monotonic() + seconds
            self.armed_stage, self.armed_for_s = stage, seconds
            self.cond.notify()
        # Backstop if the GIL is never released: dump the stack and exit from C.
        faulthandler.dump_traceback_later(seconds + 5.0, exit=True)

    def disarm(self) -> None:
        with self.cond:
            self.deadline = None
            self.cond.notify()
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.deadline = None
            self.cond.notify()
        faulthandler.cancel_dump_traceback_later()

    def run(self) -> None:
        with self.cond:
            while not self.closed:
                if self.deadline is None:
                    self.cond.wait()
                    continue
                remaining = self.deadline - time.monotonic()
                if remaining > 0:
                    self.cond.wait(remaining)
                    continue
                self._fire()

    def record(self, now: float) -> dict[str, Any]:
        """Where this rank is at the deadline.

        A collective that has just raised (gloo's own timeout, a peer's closed connection) has
        left `collective` empty while the stage's handler formats the error, which can take
        seconds on a loaded machine (linecache reads each file of the traceback): the collective
        it came out of is where the rank was, not "outside any collective".
        """
        return {
            "stage": self.armed_stage,
            "deadline_s": self.armed_for_s,
            "t": now,
            "collective": self.state.collective or self.state.failed_collective,
            "seq": self.state.collectives_entered,
            "stack": python_stacks(),
        }

    def _fire(self) -> None:
        now = time.time()
        record = self.record(now)
        for entry in reversed(self.state.timeline):
            if entry.ended is None:
                entry.ended, entry.status = now, "timeout"
        self.side.set(keys.timeout(self.rank), record)
        self.side.set(keys.timeline(self.rank), [s.to_json() for s in self.state.timeline])
        if record["collective"]:
            from ddpdoctor.measure import fr_snapshot

            self.side.set(keys.flight_recorder(self.rank), fr_snapshot.take())  # torch's view of the stuck collective
        sys.stderr.write(
            f"ddpdoctor: rank {self.rank} passed the {self.armed_for_s:g}s deadline of stage "
            f"{self.armed_stage!r}; giving up\n")
        sys.stderr.flush()
        code = None
        if self.on_fire is not None:
            try:
                code = self.on_fire()
            except Exception:
                pass
        sys.stdout.flush()
        hard_exit(code if isinstance(code, int) else STAGE_TIMEOUT_EXIT)
