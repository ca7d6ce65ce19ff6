"""The end of the run: every rank's last window, traded through the job's store, bounded in time.

Why the store and not one more all_gather: at the end a collective is the one thing that may not
be there. A script calls `dist.destroy_process_group()` and never closes the Doctor (the close at
interpreter exit then has no process group); a rank that crashed, or is still stuck, never joins
(a gather would wait for it until the process group's timeout, 10 to 30 minutes, and fail the
job's exit). The store outlives the process group (the Doctor holds its handle; torchrun's agent,
or rank 0 under `env://`, serves it), every wait on it has a deadline, and a rank that never
comes is known by its fate: a process on this host that is gone or stopped is known at once
(`hang.process_state`), one elsewhere is waited for FINAL_WAIT_CAP_S at most.

Every rank publishes its row (callback/row.py's packed floats, as a check would gather them);
only rank 0 collects and judges, and no rank waits for rank 0: a rank's exit is delayed by one
store write, rank 0's by the slowest arrival up to the cap.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ddpdoctor.callback.hang import absent_rank
from ddpdoctor.core import keys

# Ranks leave their last step together (its gradient all-reduce holds them), so a healthy rank
# arrives within an optimizer step and a little Python of rank 0; a rank that does not come by
# then is waited for this long at most, and the exit is delayed no longer (issue 53: 5 s).
FINAL_WAIT_CAP_S = 5.0
FINAL_WAIT_MIN_S = 2.0
POLL_S = 0.02


def final_wait_s(step_s: Optional[float]) -> float:
    """How long rank 0 waits for a peer's last row: three of the job's slowest steps, within [2 s, 5 s]."""
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return FINAL_WAIT_CAP_S
    return min(FINAL_WAIT_CAP_S, max(FINAL_WAIT_MIN_S, 3.0 * step_s))


@dataclass
class Missing:
    """A rank whose last row did not come: its fate as seen from rank 0."""

    rank: int
    how: str  # dead | frozen | silent (alive, or on another host, and not answering)
    host: str = ""
    pid: Optional[int] = None
    last_step: Optional[int] = None  # the steps it had done at the last check it joined


@dataclass
class Collected:
    """What rank 0 has at the end: each arrived rank's packed row, the missing ones, and how long it waited."""

    rows: dict[int, list[float]] = field(default_factory=dict)
    missing: dict[int, Missing] = field(default_factory=dict)
    waited_s: float = 0.0


class FinalExchange:
    """One Doctor's end-of-run keys on the job's store. `instance` tells apart the Doctors a process made one
    after another (a second fit): every rank makes them in the same order, so they agree on it."""

    def __init__(self, store: Any, rank: int, world: int, instance: int, host: str,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.store, self.rank, self.world, self.instance, self.host = store, rank, world, instance, host
        self.clock, self.sleep = clock, sleep

    def publish(self, values: list[float], replica: Optional[tuple[str, str]] = None) -> None:
        """This rank's last row (NaN stands for unknown, as in the gather: JSON carries it as NaN), and before
        it its replica's fingerprint and detail where it has them: the row is the sign a rank arrived, so
        whatever rank 0 reads after it is already there."""
        if replica is not None:
            fingerprint, detail = replica
            self.store.set(keys.callback_final_replica(self.instance, self.rank, "detail"), detail)
            self.store.set(keys.callback_final_replica(self.instance, self.rank, "fingerprint"), fingerprint)
        self.store.set(keys.callback_final(self.instance, self.rank), json.dumps(values))

    def replica_parts(self, ranks: list[int], part: str) -> dict[int, str]:
        """The ranks' replica `part` ("fingerprint" or "detail"), for those that published one."""
        out: dict[int, str] = {}
        for r in ranks:
            key = keys.callback_final_replica(self.instance, r, part)
            if self.store.check([key]):
                out[r] = self.store.get(key).decode()
        return out

    def collect(self, wait_s: float, last_steps: Optional[dict[int, int]] = None) -> Collected:
        """Every rank's row, or, for one that sent none by the deadline, its fate. Returns at once when
        every rank not yet arrived is known dead or frozen on this host: nothing is gained by waiting."""
        began = self.clock()
        end = began + wait_s
        out = Collected()
        while True:
            pending: dict[int, Missing] = {}
            for r in range(self.world):
                if r in out.rows:
                    continue
                key = keys.callback_final(self.instance, r)
                if self.store.check([key]):
                    out.rows[r] = [float(v) for v in json.loads(self.store.get(key))]
                else:
                    pending[r] = self._fate(r, (last_steps or {}).get(r))
            if not [m for m in pending.values() if m.how == "silent"] or self.clock() >= end:
                out.missing = pending
                out.waited_s = self.clock() - began
                return out
            self.sleep(POLL_S)

    def _fate(self, rank: int, last_step: Optional[int]) -> Missing:
        """Its fate as the hang's exchange reads it (hang.absent_rank); unknown, so silent, where its keys are not."""
        try:
            seen = absent_rank(self.store, rank, self.host)
        except Exception:  # a malformed or vanished key: the rank's fate is not known
            return Missing(rank, "silent", last_step=last_step)
        return Missing(rank, seen.how, seen.host, seen.pid, last_step)
