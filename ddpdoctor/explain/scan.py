"""From log text to events: which known message, on which rank and host, where, when.

Bounded memory and about a second per 100 MB: the chunk is searched once for every
signature's trigger words in C (one regex alternation), and only the lines that hold one
are split into prefix and message and matched in Python. Repeats of the same message on
the same rank (a watchdog printing every step, 64 ranks printing one error) collapse
into one event with a count and the place of the last one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ddpdoctor.explain.collectors import LineStyle, redacted
from ddpdoctor.explain.launchers import HOST_FIELD, LAUNCHER_LINES, RANK_FIELD, command_rank, read_block
from ddpdoctor.explain.prefixes import Origin, detect_style, line_time, split_prefixes
from ddpdoctor.explain.read import LogFile, read_chunks
from ddpdoctor.explain.signatures import BY_ID, REPORTING_EXCEPTIONS, match_line, trigger_words

TEXT_CHARS = 400
MAX_EVENTS = 20000  # distinct events kept; beyond, only counted (a log of a million unique errors)
_DIGITS = re.compile(r"\d+")
_VOLATILE = ("ran_ms", "pid", "port", "peer", "pids", "seconds", "ms")  # differ between repeats of one fact
_FREE_TEXT = ("msg", "err", "what", "other", "names")  # messages whose numbers (pids, addresses) vary
_ELASTIC_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
# Messages that say which rank printed them ("... on rank: 3, for key ..."): the rank when no prefix says it.
SELF_NAMED = ("store_barrier_timeout",)
_SIGNAL_TRACE = re.compile(r"Signal \d+ \((SIG\w+)\) received")
_EXITCODE = re.compile(r"(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)(?:\s*\((?P<signal>SIG\w+)\))?")


@dataclass
class Event:
    sig: str
    rank: Optional[int]
    local_rank: Optional[int]
    host: Optional[str]
    task: Optional[int]  # srun task id when srun started one launcher per node
    pid: Optional[int]  # from NCCL's `host:pid:tid` lines
    t: Optional[float]  # the line's own timestamp, or the last one seen before it in that file
    order: int  # position in reading order: files as given, lines within a file
    where: str  # file:line
    text: str
    fields: dict[str, Any]
    count: int = 1
    last_where: str = ""

    @property
    def role(self) -> str:
        return BY_ID[self.sig].role

    @property
    def label(self) -> str:
        if self.sig == "python_exception":
            msg = str(self.fields.get("msg") or "").strip()
            return f"{self.fields.get('type')}: {msg[:120]}" if msg else str(self.fields.get("type"))
        return BY_ID[self.sig].describe(self.fields)

    def to_json(self) -> dict[str, Any]:
        return {"signature": self.sig, "role": self.role, "label": self.label, "rank": self.rank,
                "local_rank": self.local_rank, "host": self.host, "srun_task": self.task, "where": self.where, "text": self.text,
                "fields": self.fields, "count": self.count, "last_where": self.last_where or self.where}


@dataclass
class ScanResult:
    events: list[Event] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    bytes: int = 0
    dropped: int = 0  # distinct events past MAX_EVENTS, counted only
    problems: list[str] = field(default_factory=list)


class _Scanner:
    def __init__(self) -> None:
        self.words = trigger_words()
        self.result = ScanResult()
        self.index: dict[tuple[Any, ...], Event] = {}
        self.order = 0

    def scan(self, log: LogFile) -> None:
        self.result.files.append(log.label)
        lineno = 1
        last_t: Optional[float] = None
        self.style: Optional[LineStyle] = None
        for chunk in read_chunks(log, self.result.problems):
            if self.style is None:
                self.style = detect_style(chunk)
            self.result.bytes += len(chunk)
            pos = 0  # lineno is the number of the line that starts at pos
            for start in _hit_lines(chunk, self.words):
                end = chunk.find("\n", start)
                end = len(chunk) if end < 0 else end
                lineno += chunk.count("\n", pos, start)
                pos = start
                t = self._line(log, chunk, start, end, lineno, last_t)
                if t is not None:
                    last_t = t
            lineno += chunk.count("\n", pos)
        self.result.lines += lineno - 1

    def _line(self, log: LogFile, chunk: str, start: int, end: int, lineno: int,
              last_t: Optional[float]) -> Optional[float]:
        line = chunk[start:end].rstrip("\r")
        assert self.style is not None  # set by scan() before any line
        origin, message = split_prefixes(line, self.style)
        t = line_time(message, line)
        matched = match_line(message)
        if matched is None:
            return t
        sig, said = matched
        if sig.id == "called_process" and "cmd=process.args" in chunk[max(0, start - 200):start]:
            said = {**said, "failed_args": "yes"}  # the launcher's source line, printed in its traceback
        if sig.id == "gloo_peer_closed" and _raised_in_init(chunk, start):
            sig, said = BY_ID["store_reset_at_init"], {"err": "Connection reset by peer"}
        fields = {k: v for k, v in said.items() if v is not None}
        if sig.id == "python_exception" and fields.get("type", "").rsplit(".", 1)[-1] in REPORTING_EXCEPTIONS:
            return t
        if sig.id == "elastic_block":
            fields.update(_elastic_block(chunk, start, end, self.style))
            origin = Origin(int(fields["rank"]), int(fields["local_rank"]), fields.get("host"), origin.pid, origin.task)
            signal = f" ({fields['signal']})" if fields.get("signal") else ""
            message = (f"torchrun {'root cause' if fields.get('root_cause') else 'failure'}: rank {fields['rank']} "
                       f"(local_rank {fields['local_rank']}) on {fields.get('host', '?')} exited with "
                       f"{fields.get('exitcode', '?')}{signal}, pid {fields.get('pid', '?')}")
        elif sig.id == "srun_task" and origin.host is None:
            origin = Origin(origin.rank, origin.local_rank, fields.get("host"), origin.pid, origin.task)
        else:
            origin = self._launcher_origin(sig.id, fields, chunk, end, origin)
        if sig.id in SELF_NAMED and origin.rank is None and fields.get("on_rank"):
            origin = Origin(int(fields["on_rank"]), origin.local_rank, origin.host, origin.pid, origin.task)
        if origin.rank is None and log.rank_hint is not None and origin.local_rank is None \
                and sig.id not in LAUNCHER_LINES:  # a launcher's line in a rank's file is not that rank's
            origin = Origin(log.rank_hint, None, origin.host, origin.pid, origin.task)
        self._add(sig.id, origin, t if t is not None else last_t, f"{log.label}:{lineno}", message, fields)
        return t

    @staticmethod
    def _launcher_origin(sig: str, fields: dict[str, Any], chunk: str, end: int, origin: Origin) -> Origin:
        """Another launcher's exit report: the rank and host it names, not the prefix's."""
        if sig in ("mpi_exit", "hydra_exit"):
            fields.update(read_block(sig, chunk, end))
        rank = int(fields["rank"]) if sig in RANK_FIELD and fields.get("rank") else origin.rank
        host = fields.get("host") if sig in HOST_FIELD and fields.get("host") else origin.host
        if rank is None and (sig == "deepspeed_exit" or (sig == "called_process" and fields.get("failed_args"))):
            rank = command_rank(fields, host)
        return Origin(rank, origin.local_rank, host, origin.pid, origin.task)

    def _add(self, sig: str, origin: Origin, t: Optional[float], where: str, message: str,
             fields: dict[str, Any]) -> None:
        text = message.strip()[:TEXT_CHARS]
        if origin.host is not None and redacted(origin.host):
            origin = Origin(origin.rank, origin.local_rank, None, origin.pid, origin.task)
        if redacted(str(fields.get("host", "x"))):
            fields.pop("host", None)
        # The same fact printed again in another wording (NCCL's watchdog line, then the same words inside
        # `what():` and `terminate called ...`) is one event: keyed by what it says, not how.
        said = sorted((k, _DIGITS.sub("#", str(v))[:120] if k in _FREE_TEXT else str(v)[:120])
                      for k, v in fields.items() if k not in _VOLATILE)
        # The pid is part of who said it: NCCL lines are tied to ranks by pid only after the scan.
        key = (sig, origin.rank, origin.local_rank, origin.host, origin.task, origin.pid,
               tuple(said) if said else _DIGITS.sub("#", text[:200]))
        event = self.index.get(key)
        if event is not None:
            event.count += 1
            event.last_where = where
            return
        if len(self.index) >= MAX_EVENTS:
            self.result.dropped += 1
            return
        self.order += 1
        event = Event(sig, origin.rank, origin.local_rank, origin.host, origin.task, origin.pid, t, self.order, where,
                      text, fields)
        self.index[key] = event
        self.result.events.append(event)


_INIT_FRAMES = ("in init_process_group", "in _env_rendezvous_handler", "in _create_c10d_store")


def _raised_in_init(chunk: str, start: int) -> bool:
    """Whether the traceback right above this exception line is init_process_group's rendezvous:
    a connection reset there is the store's (MASTER_ADDR), not a training peer's."""
    above = chunk[max(0, start - 800):start].splitlines()[-4:]
    return any(frame in line for line in above for frame in _INIT_FRAMES)


def _hit_lines(chunk: str, words: tuple[str, ...]) -> list[int]:
    """The start of every line holding a trigger word, in order, each once."""
    starts: set[int] = set()
    for word in words:
        i = chunk.find(word)
        while i >= 0:
            start = chunk.rfind("\n", 0, i) + 1
            starts.add(start)
            end = chunk.find("\n", i)
            if end < 0:
                break
            i = chunk.find(word, end)
    return sorted(starts)


def _elastic_block(chunk: str, start: int, end: int, style: LineStyle) -> dict[str, Any]:
    """The agent's failure block: `time`/`host` above the rank line, `exitcode`/`traceback` below."""
    before = chunk[max(0, chunk.rfind("\n", 0, max(0, start - 400)) + 1):start].splitlines()[-3:]
    after = chunk[end + 1:end + 1200].splitlines()[:4]
    out: dict[str, Any] = {}
    for line in before + after:
        _, message = split_prefixes(line, style)
        m = _ELASTIC_FIELD.match(message)
        if not m or m.group(1) == "rank":
            continue
        out[m.group(1)] = m.group(2).strip()
    signal = _SIGNAL_TRACE.search(out.get("traceback", ""))
    if signal:
        out["signal"] = signal.group(1)  # older torch names the signal only here
    code = _EXITCODE.match(out.get("exitcode", ""))
    if code:
        out["exitcode"] = int(code.group("code"))
        out["pid"] = int(code.group("pid"))
        if code.group("signal"):
            out["signal"] = code.group("signal")
    header = chunk[max(0, start - 600):start]
    root, failures = header.rfind("Root Cause"), header.rfind("Failures:")
    out["root_cause"] = root > failures
    return out


def scan(logs: Iterable[LogFile]) -> ScanResult:
    scanner = _Scanner()
    for log in logs:
        scanner.scan(log)
    return scanner.result
