"""The Chrome trace-event format's rules, as the format's own document states them, checked on a file we wrote.

Source: "Trace Event Format" (Google, the document chrome://tracing and Perfetto's JSON importer follow:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU) and Perfetto's page on
it (https://perfetto.dev/docs/getting-started/other-formats):
- the JSON Object Format: {"traceEvents": [...]} with optional "displayTimeUnit" ("ms" or "ns") and "otherData";
- every event has "ph" (one letter), "name", "pid" and "tid"; "ts" in microseconds (a number);
- complete events "X" carry "dur" (microseconds, a number, not negative); spans on one thread must nest
  (Perfetto moves ones that overlap without nesting to an overflow track: the picture is then wrong);
- instant events "i" carry a scope "s": "g" (global), "p" (process) or "t" (thread);
- metadata events "M": process_name / thread_name with args.name, process_sort_index / thread_sort_index
  with args.sort_index;
- "args" is an object.
Used by the unit tests (tests/unit/test_trace.py) and the end-to-end ones that write a timeline.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

METADATA = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
            "thread_sort_index": "sort_index"}


def check_rules(doc: Any) -> None:
    """AssertionError naming the first event that breaks a rule."""
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN or Infinity anywhere
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list), "not the JSON Object Format"
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns"), doc.get("displayTimeUnit")
    named_pids, named_threads = set(), set()
    used_threads = set()
    spans: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for event in doc["traceEvents"]:
        assert isinstance(event, dict), event
        ph = event.get("ph")
        assert ph in ("X", "i", "M"), event
        assert isinstance(event.get("name"), str) and event["name"], event
        for key in ("pid", "tid"):
            assert isinstance(event.get(key), int) and not isinstance(event[key], bool) and event[key] >= 0, event
        assert isinstance(event.get("args", {}), dict), event
        where = (event["pid"], event["tid"])
        if ph == "M":
            arg = METADATA.get(event["name"])
            assert arg is not None, event
            value = event["args"][arg]
            assert isinstance(value, str) if arg == "name" else isinstance(value, int), event
            if event["name"] == "process_name":
                named_pids.add(event["pid"])
            if event["name"] == "thread_name":
                named_threads.add(where)
            continue
        assert isinstance(event.get("ts"), (int, float)) and math.isfinite(event["ts"]) and event["ts"] >= 0, event
        if ph == "X":
            assert isinstance(event.get("dur"), (int, float)) and event["dur"] >= 0, event
            assert isinstance(event.get("cat"), str), event
            spans[where].append((event["ts"], event["ts"] + event["dur"], event["name"]))
            used_threads.add(where)
        else:
            assert event.get("s") in ("g", "p", "t"), event
            if event["s"] == "t":
                used_threads.add(where)
    assert used_threads <= named_threads, f"threads without a name: {sorted(used_threads - named_threads)}"
    assert {p for p, _ in used_threads} <= named_pids, "a process without a name"
    for where, events in spans.items():
        open_: list[tuple[float, float, str]] = []
        for begin, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
            while open_ and open_[-1][1] <= begin:
                open_.pop()
            if open_:
                assert end <= open_[-1][1], f"{where}: {name} [{begin}, {end}] overlaps {open_[-1]} without nesting"
            open_.append((begin, end, name))


def spans_of(doc: dict, rank: int, cat: str | None = None) -> list[dict]:
    """The complete events on a rank's tracks (its own thread, and its others: core/timeline.py's SUB_TRACK_TID)."""
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    tids = {tid for tid, name in names.items() if name == f"rank {rank}" or name.startswith(f"rank {rank} ")}
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] in tids and (cat is None or e["cat"] == cat)]
