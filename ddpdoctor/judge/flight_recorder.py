"""Flight Recorder dumps: each rank's last collectives, matched across ranks by sequence number.

torch writes one dump per rank (TORCH_NCCL_DEBUG_INFO_TEMP_FILE, default
/tmp/nccl_trace_rank_N; gloo too since torch 2.8 with TORCH_FR_BUFFER_SIZE) as a pickle,
or JSON through `_dump_fr_trace_json`. A pickle from a crashed job is still untrusted
input, so it is read by an unpickler that refuses every class and function: a dump is
plain dicts, lists, strings and numbers, and anything else is refused, never executed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class DumpFile:
    """A Flight Recorder dump (pickle or JSON), one rank's ring buffer of collectives."""

    path: str
    label: str
    kind: str  # pickle | json
    rank_hint: Optional[int] = None


MAX_DUMP_BYTES = 512 << 20


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a Flight Recorder dump holds only plain data")


@dataclass(frozen=True)
class Call:
    """One collective as one rank recorded it."""

    seq: int
    op: str
    group: str
    in_sizes: Any
    in_dtypes: Any
    out_sizes: Any
    state: str

    def signature(self) -> str:
        """What must agree across ranks: op, shapes, dtypes (state may differ: one rank is behind)."""
        return f"{self.op} in={format_shapes(self.in_sizes)} {format_dtypes(self.in_dtypes)}"


@dataclass
class Dump:
    rank: int
    label: str
    calls: dict[tuple[str, int], Call] = field(default_factory=dict)  # (group, seq) -> call
    version: str = ""


@dataclass
class DumpSet:
    dumps: dict[int, Dump] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def format_shapes(sizes: Any) -> str:
    if isinstance(sizes, list):
        return ",".join("[" + ",".join(str(d) for d in s) + "]" if isinstance(s, list) else str(s) for s in sizes)
    return str(sizes)


def format_dtypes(dtypes: Any) -> str:
    return ",".join(str(d) for d in dtypes) if isinstance(dtypes, list) else str(dtypes)


def _load(dump: DumpFile) -> Any:
    size = os.path.getsize(dump.path)
    if size > MAX_DUMP_BYTES:
        raise ValueError(f"{size >> 20} MiB is larger than a Flight Recorder dump can be ({MAX_DUMP_BYTES >> 20} MiB)")
    with open(dump.path, "rb") as handle:
        data = handle.read()
    if dump.kind == "json":
        return json.loads(data.decode("utf-8", "replace"))
    return loads_plain(data)


def _op_name(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "?")
    return name.split(":", 1)[-1]  # "nccl:all_reduce" -> all_reduce


def _group(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "0"))


def loads_plain(raw: bytes) -> Any:
    """A pickled dump as plain data; any class or function in it is refused, never run."""
    return _PlainDataUnpickler(io.BytesIO(raw)).load()


def dump_from_entries(rank: int, label: str, entries: list[Any], version: str = "") -> Dump:
    """One rank's collectives by (group, seq), from torch's entries (a file's, or a live rank's)."""
    dump = Dump(rank, label, version=version)
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue  # point-to-point ops have their own numbering; matching them is future work
        try:
            seq = int(entry["collective_seq_id"])
        except (KeyError, TypeError, ValueError):
            continue
        call = Call(seq, _op_name(entry), _group(entry), entry.get("input_sizes"), entry.get("input_dtypes"),
                    entry.get("output_sizes"), str(entry.get("state", "")))
        dump.calls[(call.group, seq)] = call
    return dump


def read_dumps(files: list[DumpFile]) -> DumpSet:
    out = DumpSet()
    for f in files:
        if f.rank_hint is None:
            out.problems.append(f"{f.label}: a Flight Recorder dump, but its name says no rank "
                                "(torch names them <prefix><rank>, e.g. nccl_trace_rank_3)")
            continue
        try:
            data = _load(f)
            entries = data["entries"]
            if not isinstance(entries, list):
                raise TypeError("entries is not a list")
        except (pickle.UnpicklingError, ValueError, KeyError, TypeError, EOFError, OSError,
                UnicodeDecodeError, AttributeError, IndexError, RecursionError) as exc:
            out.problems.append(f"{f.label}: not a readable Flight Recorder dump ({type(exc).__name__}: {exc})")
            continue
        dump = dump_from_entries(f.rank_hint, f.label, entries, str(data.get("version", "")))
        first = out.dumps.get(f.rank_hint)
        if first is None:
            out.dumps[f.rank_hint] = dump
        elif first.calls != dump.calls:  # the same dump as pickle and JSON is no news
            out.problems.append(f"{f.label}: a second, different dump for rank {f.rank_hint}, ignored "
                                f"(the first was {first.label})")
    return out


@dataclass(frozen=True)
class Mismatch:
    """The first collective where the ranks part ways."""

    group: str
    seq: int
    calls: dict[int, Optional[Call]]  # rank -> its call at seq, None when it never got there
    last_seq: dict[int, int]  # rank -> the last seq it recorded in this group

    @property
    def missing(self) -> list[int]:
        return sorted(r for r, c in self.calls.items() if c is None)


@dataclass(frozen=True)
class Agreement:
    group: str
    first_seq: int
    last_seq: int
    ranks: tuple[int, ...]


def compare(dumps: DumpSet) -> tuple[list[Mismatch], list[Agreement]]:
    """Per process group, the first sequence number where ranks differ or one is missing.

    Each rank's ring buffer may have dropped its oldest entries, so only sequence numbers
    from the latest first-recorded one onward are compared.
    """
    mismatches: list[Mismatch] = []
    agreements: list[Agreement] = []
    groups = sorted({g for d in dumps.dumps.values() for g, _ in d.calls})
    for group in groups:
        seqs = {r: sorted(s for g, s in d.calls if g == group) for r, d in dumps.dumps.items()}
        seqs = {r: s for r, s in seqs.items() if s}
        if len(seqs) < 2:
            continue
        start = max(s[0] for s in seqs.values())
        end = max(s[-1] for s in seqs.values())
        last = {r: s[-1] for r, s in seqs.items()}
        found = None
        for seq in range(start, end + 1):
            calls = {r: dumps.dumps[r].calls.get((group, seq)) for r in seqs}
            signatures = {c.signature() for c in calls.values() if c is not None}
            if len(signatures) > 1 or any(c is None for c in calls.values()):
                found = Mismatch(group, seq, calls, last)
                break
        if found:
            mismatches.append(found)
        else:
            agreements.append(Agreement(group, start, end, tuple(sorted(seqs))))
    return mismatches, agreements
