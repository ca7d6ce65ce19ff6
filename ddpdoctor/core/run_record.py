"""Everything the channel (and, standalone, the launcher) learned about a run.

Reading is separate from judging: `read_record` (runtime/channel.py) only copies what ranks published;
`run_diagnosis` turns a record into findings and is tested on hand-made records.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Optional



def signal_name(exit_code: Optional[int]) -> Optional[str]:
    """`-9` → "SIGKILL": Popen's negative exit code for a process ended by a signal."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


@dataclass
class ExitInfo:
    """How a rank process ended, as its parent saw it (standalone launcher only)."""

    code: Optional[int]  # None: still running when we gave up on it
    signal: Optional[str] = None
    t: float = 0.0
    killed_by_us: str = ""  # why the launcher ended it, if it did
    log_tail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "t": self.t,
                "killed_by_us": self.killed_by_us, "log_tail": self.log_tail}


@dataclass
class RunRecord:
    world_size: int
    mode: str
    probes: tuple[str, ...]
    started: float
    ended: float = 0.0
    hellos: dict[int, dict[str, Any]] = field(default_factory=dict)
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)
    timelines: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    timeouts: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    results: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    exits: dict[int, ExitInfo] = field(default_factory=dict)
    interrupted: str = ""  # the signal that stopped the launcher or reporter, if any
    faults: tuple[str, ...] = ()
    silent_after_s: float = 15.0
    # Ranks found gone (no process) by a reporter that shares their host, with why we looked.
    dead: dict[int, str] = field(default_factory=dict)
    default_host: str = "?"  # the standalone launcher knows every rank's host: its own
    settings: dict[str, Any] = field(default_factory=dict)  # thresholds the diagnoses honour
    # Each rank's Flight Recorder entries (fr_snapshot.take), at its end or where it failed.
    flight_recorder: dict[int, dict[str, Any]] = field(default_factory=dict)


    def host(self, rank: int) -> str:
        hello = self.hellos.get(rank)
        return str(hello["host"]) if hello else self.default_host

    def last_stage(self, rank: int) -> str:
        timeline = self.timelines.get(rank) or []
        for entry in reversed(timeline):
            if entry.get("status") != "ok":
                return str(entry["name"])
        if timeline:
            return str(timeline[-1]["name"])
        return "launch"
