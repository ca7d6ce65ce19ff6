"""The watch on `Doctor`'s steps: a step that outlives its allowance is a hang, judged across ranks.

Its own module because it runs on threads of its own (the step watchdog, and after the loop the
left-watch), beside the training loop rather than in it, and because the hang's exchange and
leaving (on_hang="exit") are a protocol between ranks that the step flow only starts and ends.
The verdict itself is pure and lives in callback/hang.py; this class gathers this rank's record,
trades it through the job's store, reports the verdict and, when asked, leaves in order.

It reads the doctor's live step state (when the running step began, its allowance, the store,
this rank), so it keeps a reference to its `Doctor` rather than copies of those values.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Optional

from ddpdoctor.callback import hang
from ddpdoctor.callback.online_checks import PROBE
from ddpdoctor.core import codes, keys
from ddpdoctor.core.exits import PEER_HUNG_EXIT, STAGE_TIMEOUT_EXIT, hard_exit
from ddpdoctor.runtime.liveness import main_thread_frame

if TYPE_CHECKING:
    from ddpdoctor.callback.doctor import Doctor

# The watchdog looks this often: a hang is named within half a second of its allowance, for a
# wake-up of a few microseconds twice a second in the user's process.
WATCH_TICK_S = 0.5


class HangWatch:
    """One rank's hang watching: the watchdog thread and the hang episodes it takes part in."""

    def __init__(self, doctor: Doctor) -> None:
        self._doctor = doctor
        self.deadline: dict[str, Any] = {}  # how the allowance of the step called hung was set
        self._hangs = 0  # hang episodes this rank took part in (each has its own store keys)
        self._hanging = False  # a hang's exchange runs: the main thread's error is part of it
        self._hang_over = threading.Event()  # set when it is over (on_hang="report")
        self._hang_lock = threading.Lock()  # one thread judges: the watchdog, the loop's, or the left one
        self._watchdog = threading.Thread(target=self._watch, name="ddpdoctor-step-watchdog", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    def _describe_deadline(self) -> None:
        d = self._doctor
        self.deadline = dict(d._clock.describe(slow=bool(d._slow)), marked_slow_as=d._slow)

    def _watch(self) -> None:
        d = self._doctor
        reported = 0.0
        while not self._stop.wait(min(WATCH_TICK_S, d.deadline_s / 4)):
            began = d._began
            allowance = d.allowance_s()
            if not began or began == reported or time.perf_counter() - began < allowance:
                self._answer_peers(began, allowance)
                continue
            reported = began
            # Read while the main thread is stuck in the step, so the clock is not being fed.
            self._describe_deadline()
            self._emit_hang(time.perf_counter() - began)

    def _answer_peers(self, began: float, allowance: float) -> None:
        """A peer's step hung: answer its exchange from here, between steps (a data loader stuck)
        or inside a step not yet past its allowance. The store is read only once this rank has
        itself gone half its allowance without finishing a step: a healthy job never reads it here."""
        d = self._doctor
        since = began or d._last_end
        if (d._store is None or d.world_size < 2 or not since or self._hanging
                or time.perf_counter() - since < allowance / 2):
            return
        try:
            started = hang.Exchange(d._store, d.rank, d.world_size, self._hangs + 1, d.host).started()
        except Exception:  # the store went away with its host
            return
        if started:
            self._describe_deadline()
            self._emit_hang(time.perf_counter() - since)

    def _emit_hang(self, elapsed_s: float, error: Optional[BaseException] = None) -> None:
        d = self._doctor
        if d._store is not None and d.world_size > 1:
            self.cross_rank_hang(error)
            return
        main = main_thread_frame()
        stack = traceback.format_stack(main) if main is not None else []
        where = stack[-1].strip().splitlines()[0] if stack else "unknown"
        finding = codes.finding(
            "DOC007", PROBE,
            f"Step {d._steps + 1} on rank {d.rank} has run for {elapsed_s:.0f} s "
            f"(allowance {self.deadline.get('allowance_s', d.deadline_s):g} s = "
            f"{self.deadline.get('rule', 'step_deadline_s')}): stuck at {where}",
            ranks=(d.rank,), nodes=(d.host,),
            evidence={"python_stack": [line.rstrip() for line in "".join(stack[-12:]).splitlines()],
                      "deadline": self.deadline,
                      "flight_recorder": ("set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                                          "to have NCCL's Flight Recorder dump what every rank was in; then "
                                          "`ddpdoctor explain` the dumps")})
        sys.stderr.write(f"ddpdoctor: rank {d.rank}: {finding.title}\n" + "".join(stack[-12:]))
        sys.stderr.flush()
        d._emit(finding, may_raise=False)  # the watchdog thread cannot raise into the loop
        if d.on_hang == "exit":
            # The first peer to leave resets this rank's connections, and its main thread may die of
            # that error before this thread exits: the exit status stays "hung", not the error's 1.
            atexit.register(hard_exit, STAGE_TIMEOUT_EXIT)
            hard_exit(STAGE_TIMEOUT_EXIT)

    def cross_rank_hang(self, error: Optional[BaseException]) -> None:
        """One verdict on every rank (callback/hang.py): trade records through the job's store,
        the lowest answering rank judges, every rank reports the same finding; with
        on_hang="exit", the culprit leaves first."""
        d = self._doctor
        if not self._hang_lock.acquire(blocking=False):  # another thread of this rank is judging it
            self._hang_over.wait(hang.leave_within_s() + 2.0)
            return
        self._hanging = True
        self._hang_over.clear()
        self._hangs += 1
        try:
            self._judge_hang(hang.Exchange(d._store, d.rank, d.world_size, self._hangs, d.host), error)
        finally:
            self._hanging = False
            self._hang_over.set()
            self._hang_lock.release()

    def _judge_hang(self, exchange: hang.Exchange, error: Optional[BaseException]) -> None:
        d = self._doctor
        if d.on_hang == "exit":
            # A store call can block past every wait (TCPStore serialises its clients): the exit
            # must not wait on it. This timer ends the process if the calls below do not return.
            backstop = threading.Timer(hang.leave_within_s() + 2.0, hard_exit, (STAGE_TIMEOUT_EXIT,))
            backstop.daemon = True
            backstop.start()
        record = self._hang_record(error)
        try:
            exchange.publish(record)
            verdict = exchange.decide(*exchange.collect())
        except Exception:  # the store went away with its host: judged on what this rank knows
            verdict = hang.judge({d.rank: record}, {r: hang.Absent(r, "silent") for r in range(d.world_size)
                                                    if r != d.rank}, d.rank)
        finding = hang.verdict_finding(verdict)
        sys.stderr.write(f"ddpdoctor: rank {d.rank}: {finding.code} {finding.title}\n")
        sys.stderr.flush()
        d._emit(finding, may_raise=False)  # the watchdog thread cannot raise into the loop
        with contextlib.suppress(Exception):
            exchange.reported()
        if d.on_hang == "exit":
            self._leave_after_hang(exchange, verdict)

    def _hang_record(self, error: Optional[BaseException]) -> hang.RankRecord:
        """Where this rank is: in which collective (DDP's gradient all-reduce when the main thread is
        inside a DDP model's backward, or one the main thread called), at which line of the user's
        code, and its stack. `error`: the
        collective's failure, whose traceback holds the user's line (this is the main thread)."""
        d = self._doctor
        pairs = [(f, f.f_lineno) for f in hang.frames_of(main_thread_frame() if error is None else sys._getframe())]
        if error is not None:
            pairs += list(traceback.walk_tb(error.__traceback__))
        frames = [f for f, _ in pairs]
        collective = hang.user_collective(frames)
        if not collective and hang.untimed_backward(frames):
            # Inside torch's backward past the step's allowance (ten times its typical length at least):
            # a DDP model's backward is then waiting in its gradient all-reduce, for a peer. FSDP's
            # collectives are not DDP's: said as what is known.
            collective = (hang.DDP_ALLREDUCE if d.wait_measured or d._is_ddp
                          else "backward (its gradient collectives, not timed)")
        where, stack = hang.describe(pairs)
        in_step = (bool(d._began) or error is not None) and not d._closed
        return hang.RankRecord(d.rank, d._steps + int(in_step), os.getpid(), d.host, collective, where, stack,
                               error=f"{type(error).__name__}: {error}"[:300] if error is not None else "",
                               left=d._closed, deadline=self.deadline)

    def _leave_after_hang(self, exchange: hang.Exchange, verdict: hang.Verdict) -> None:
        """The culprit leaves first, once its victims have written the verdict down, so the launcher's
        first failure (torchrun's "Root Cause") is it; a victim leaves after it, or after a grace
        where the culprit cannot leave (dead, frozen). Exit codes: core/exits.py."""
        d = self._doctor
        culprit = d.rank in verdict.culprits
        code = STAGE_TIMEOUT_EXIT if culprit else PEER_HUNG_EXIT
        # The culprit's leaving resets this rank's connections, and its main thread may die of that
        # error before this thread exits: the exit status stays this one, not the error's 1.
        atexit.register(hard_exit, code)
        try:
            if culprit:
                exchange.wait_reported([r for r in verdict.records if r != d.rank], hang.COLLECT_S)
                exchange.leaving()
            else:
                exchange.wait_gone(verdict)
        except Exception:  # the store went away with its host: nobody is left to wait for
            pass
        hard_exit(code)

    def after_collective_failure(self, exc: BaseException, began: float) -> None:
        """A step's collective failed because a peer went away (gloo closes a dead or departed
        rank's connections at once, where NCCL would hang): the hang's verdict, from this thread."""
        d = self._doctor
        if self._hanging:
            # The watchdog is judging (the culprit's leaving caused this error): wait for it, so
            # the culprit stays the first to exit; with on_hang="exit" the watchdog ends the process.
            self._hang_over.wait(hang.leave_within_s() + 2.0)
        elif began and d._store is not None and d.world_size > 1 and hang.peer_gone(exc):
            self._emit_hang(time.perf_counter() - began, error=exc)

    def publish_left(self) -> None:
        """Tell the peers this rank's loop is over (a hang that follows is blamed on its leaving)
        and, with on_hang="exit", keep answering their hang so that, named, it leaves first."""
        d = self._doctor
        if d._store is None or d.world_size < 2:
            return
        try:
            d._store.set(keys.callback_left(d.rank), str(d._steps))
        except Exception:  # the store went away with its host: the job is over
            return
        if d.on_hang == "exit":
            with contextlib.suppress(RuntimeError):  # close() at interpreter exit: no new thread then
                threading.Thread(target=self._answer_after_leaving, name="ddpdoctor-left-watch", daemon=True).start()

    def _answer_after_leaving(self) -> None:
        d = self._doctor
        exchange = hang.Exchange(d._store, d.rank, d.world_size, self._hangs + 1, d.host)
        try:
            while not exchange.started():
                time.sleep(2 * WATCH_TICK_S)
        except Exception:  # the store went away with the job: nothing left to answer
            return
        self._emit_hang(0.0)
