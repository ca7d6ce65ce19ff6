"""A run as a timeline users open in Perfetto or chrome://tracing: the Chrome trace-event JSON format.

Why this format: it is what torch's profiler exports and what Perfetto, chrome://tracing, HTA and
speedscope read, so a user opens ddpdoctor's timeline beside their own profile with the tools they
trust. The JSON Object Format is written ({"traceEvents": [...], "displayTimeUnit": "ms", ...}):
- one process per node (`pid` = the node's index, named "node <host>"), one thread per rank (`tid` =
  the rank, named "rank <r>"), sorted by node then rank: a job's ranks grouped as its nodes are; a rank's
  second track (its steps, beside its stages) is a thread of its own right under it, as spans on one
  thread must nest and a step measured apart need not lie inside a stage to the microsecond;
- complete events (`ph` "X") for what has a begin and an end, `ts` and `dur` in microseconds from the
  timeline's first moment (its epoch seconds are in `otherData`), whole microseconds (a phase is ~100 µs at
  least; integers keep a span that ends where the next begins from overlapping it by a rounding): a stage,
  a step, a phase of a step;
- a span still open at the end (a hung rank) is drawn to the end, named "... (stuck)", with its stack
  and why in `args`: the picture of a hang is the one bar that does not end;
- instant events (`ph` "i") for the findings, on the ranks they name (`s` "t"), or the whole trace (`s` "g").

Every span's time is rank 0's clock: the producers (render/trace_check.py, callback/trace_keep.py)
correct each host's by the offset they measured. This module only lays the timeline out: it measures
nothing, and it writes the same file for the same timeline. In core, as the report's JSON is: the callback
(which writes a timeline at its close) and the renderers both use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ddpdoctor.core.files import atomic_write_json

OPEN = " (stuck)"  # the name's suffix of a span still open at the end
SUB_TRACK_TID = 1_000_000  # a rank's other tracks: SUB_TRACK_TID + 16 * rank + the track's index


@dataclass(frozen=True)
class Span:
    """Something a rank did from `start_s` to `end_s` (epoch seconds, rank 0's clock; ends, not lengths, so
    that spans laid end to end meet exactly); `end_s` None: not finished when the timeline ended (a hang),
    drawn to the end."""

    rank: int
    name: str
    start_s: float
    end_s: Optional[float]
    cat: str
    args: Mapping[str, Any] = field(default_factory=dict)
    track: str = ""  # "": the rank's own; else a track of the rank's beside it ("steps"), drawn right under it


@dataclass(frozen=True)
class Mark:
    """A moment: a finding, on the ranks it names (none: the whole job)."""

    name: str
    at_s: float
    ranks: tuple[int, ...] = ()
    cat: str = "finding"
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Timeline:
    """Spans and marks of one run, its ranks' nodes, and when it ended (where open spans stop)."""

    hosts: dict[int, str]  # rank -> node
    ended_s: float
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    about: dict[str, Any] = field(default_factory=dict)  # what made it: the command, the clock's correction
    began_s: Optional[float] = None  # when the run began (the command's start), where it is known

    def started_s(self) -> float:
        return min([s.start_s for s in self.spans] + [m.at_s for m in self.marks] + [self.ended_s]
                   + ([self.began_s] if self.began_s else []))

    def nodes(self) -> list[str]:
        """The nodes in rank order of their first rank."""
        return list(dict.fromkeys(self.hosts[r] for r in sorted(self.hosts)))

    def to_json(self) -> dict[str, Any]:
        origin = self.started_s()
        node_index = {host: i for i, host in enumerate(self.nodes())}

        def us(seconds: float) -> int:  # whole microseconds, and a duration the difference of its rounded ends:
            return round((seconds - origin) * 1e6)  # a span inside another, or after it, stays so exactly

        def pid(rank: int) -> int:
            return node_index.get(self.hosts.get(rank, ""), len(node_index))

        events: list[dict[str, Any]] = []
        for host, index in node_index.items():
            events.append({"ph": "M", "name": "process_name", "pid": index, "tid": 0, "args": {"name": f"node {host}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": index, "tid": 0,
                           "args": {"sort_index": index}})
        tracks = sorted({(s.rank, s.track) for s in self.spans} | {(r, "") for r in self.hosts})
        extra = sorted({t for _, t in tracks if t})
        tids = {(r, t): r if not t else SUB_TRACK_TID + r * 16 + extra.index(t) for r, t in tracks}
        for order, (rank, track) in enumerate(tracks):
            tid = tids[(rank, track)]
            events.append({"ph": "M", "name": "thread_name", "pid": pid(rank), "tid": tid,
                           "args": {"name": f"rank {rank}" + (f" {track}" if track else "")}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid(rank), "tid": tid,
                           "args": {"sort_index": order}})
        # Longer first where two begin together: a viewer nests a span under the one it lies inside.
        for span in sorted(self.spans, key=lambda s: (s.rank, s.start_s, -(s.end_s if s.end_s is not None
                                                                           else self.ended_s))):
            open_ = span.end_s is None
            end = max(span.start_s, self.ended_s if span.end_s is None else span.end_s)
            events.append({"ph": "X", "name": span.name + (OPEN if open_ else ""), "cat": span.cat,
                           "pid": pid(span.rank), "tid": tids[(span.rank, span.track)], "ts": us(span.start_s),
                           "dur": us(end) - us(span.start_s), "args": dict(span.args)})
        for mark in sorted(self.marks, key=lambda m: m.at_s):
            event: dict[str, Any] = {"ph": "i", "name": mark.name, "cat": mark.cat, "ts": us(mark.at_s),
                                     "args": dict(mark.args)}
            if not mark.ranks:
                events.append({**event, "s": "g", "pid": 0, "tid": 0})
            for rank in mark.ranks:
                events.append({**event, "s": "t", "pid": pid(rank), "tid": rank})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"tool": "ddpdoctor", "started_at_epoch_s": round(origin, 6),
                              "ended_at_epoch_s": round(self.ended_s, 6), **self.about}}


def write(timeline: Timeline, path: str) -> str:
    """The timeline as a trace-event file, atomically (a viewer never opens half a file) and with secrets
    redacted (a stack's arguments may hold a token) as every JSON file ddpdoctor writes; where it went."""
    return atomic_write_json(timeline.to_json(), path, overwrite=True)
