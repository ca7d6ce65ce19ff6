"""What a rank is doing right now, shared by its main thread and its helper threads.

Plain attributes: the main thread writes them, the heartbeat and watchdog threads only
read them, and a torn read at worst shows the previous stage for half a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


class Terminated(BaseException):
    """The rank was asked to stop (SIGTERM from its launcher): BaseException, so no
    `except Exception` on the way turns the stop into a failure of the stage it was in."""


@dataclass
class StageRecord:
    name: str
    started: float  # wall-clock seconds, comparable across the ranks of one host
    ended: Optional[float] = None
    status: str = "running"  # running | ok | error | timeout
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "started": self.started, "ended": self.ended,
                "status": self.status, "detail": self.detail}


@dataclass
class RankState:
    stage: str = "launch"
    stage_started: float = field(default_factory=time.time)
    collective: Optional[dict[str, Any]] = None
    collectives_entered: int = 0
    failed_collective: Optional[dict[str, Any]] = None  # the collective an exception came out of
    store_lost: bool = False  # a write to the out-of-band store failed: its host is gone
    # Set by the SIGTERM handler before it raises: an exception seen after this is the stop
    # mangled on its way out (e.g. "release unlocked lock" from a `with lock:` it cut), not a fault.
    terminating: bool = False
    timeline: list[StageRecord] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {"t": time.time(), "stage": self.stage, "stage_started": self.stage_started,
                "collective": self.collective, "seq": self.collectives_entered}
