"""Reading a failed job's files: logs (plain or gzip), folders, stdin, Flight Recorder dumps.

A job's output can be 100 MB from 64 ranks, so text is handed out in bounded chunks
that end on a line boundary, never read whole. What is not a log (a binary file, a
dump) is sorted out here by its first bytes, so the scanner only ever sees text.
"""

from __future__ import annotations

import gzip
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Optional

from ddpdoctor.judge.flight_recorder import DumpFile
from ddpdoctor.core.errors import UsageError

CHUNK_BYTES = 4 << 20
READ_BYTES = 256 << 10
_GZIP_MAGIC = b"\x1f\x8b"
# A pickle of protocol 2..5 starts with PROTO and its number: what torch's DebugInfoWriter writes.
_PICKLE_MAGIC = re.compile(rb"\A\x80[\x02-\x05]")
_RANK_IN_NAME = re.compile(r"(?:rank|trace_rank_|worker|proc|task)[_.-]?(\d{1,6})(?!\d)", re.IGNORECASE)


@dataclass(frozen=True)
class LogFile:
    """One text source. `rank_hint` comes from a name like `rank3.log`, `nccl_trace_rank_3`."""

    path: str
    label: str
    gzipped: bool = False
    rank_hint: Optional[int] = None


@dataclass
class Inputs:
    logs: list[LogFile] = field(default_factory=list)
    dumps: list[DumpFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "path: why"


def rank_from_name(name: str) -> Optional[int]:
    match = _RANK_IN_NAME.search(os.path.basename(name))
    return int(match.group(1)) if match else None


def _looks_like_fr_json(head: bytes) -> bool:
    return head.lstrip().startswith(b"{") and b'"entries"' in head and (b'"pg_config"' in head or b'"version"' in head)


def _classify(path: str, label: str, inputs: Inputs) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(64 << 10)
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    hint = rank_from_name(label)
    if head.startswith(_GZIP_MAGIC):
        inputs.logs.append(LogFile(path, label, gzipped=True, rank_hint=hint))
    elif _PICKLE_MAGIC.match(head):
        inputs.dumps.append(DumpFile(path, label, "pickle", hint))
    elif _looks_like_fr_json(head):
        inputs.dumps.append(DumpFile(path, label, "json", hint))
    elif b"\x00" in head[:8192]:
        inputs.skipped.append(f"{label}: binary, not a log")
    else:
        inputs.logs.append(LogFile(path, label, rank_hint=hint))


def discover(paths: list[str]) -> Inputs:
    """Files as given, folders walked (sorted, so a report is the same each time), `-` for stdin."""
    inputs = Inputs()
    if paths.count("-") > 1:
        raise UsageError("`-` (standard input) may be given once")
    for path in paths:
        if path == "-":
            inputs.logs.append(LogFile("-", "<stdin>"))
            continue
        if os.path.isdir(path):
            found = False
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(root, name)
                    if os.path.isfile(full) and not os.path.islink(full):
                        _classify(full, os.path.relpath(full, os.path.dirname(os.path.abspath(path))), inputs)
                        found = True
            if not found:
                raise UsageError(f"{path}: folder holds no files")
            continue
        if not os.path.exists(path):
            raise UsageError(f"{path}: no such file or folder")
        if not os.path.isfile(path):
            raise UsageError(f"{path}: not a regular file")
        _classify(path, os.path.basename(path), inputs)
    return inputs


def _open(log: LogFile) -> BinaryIO:
    if log.path == "-":
        raw: BinaryIO = sys.stdin.buffer
        peek = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
        return gzip.GzipFile(fileobj=raw) if peek == _GZIP_MAGIC else raw  # type: ignore[return-value]
    if log.gzipped:
        return gzip.open(log.path, "rb")  # type: ignore[return-value]
    return open(log.path, "rb")


def _read_some(handle: BinaryIO, size: int) -> bytes:
    """What the stream has ready, up to `size`: gzip's read1 returns each piece it inflates,
    where read(size) would lose them all to an error further on."""
    read1 = getattr(handle, "read1", None)
    return read1(size) if read1 is not None else handle.read(size)


def read_chunks(log: LogFile, problems: list[str], chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """Decoded text in pieces of about `chunk_bytes`, each ending at a newline (or the end).

    Undecodable bytes become U+FFFD: a log with one bad byte is still explained. A cut or
    corrupt gzip stream ends that file early with a line in `problems`: what was read
    before the damage is still explained (a job killed mid-write leaves such files), so
    reads are small enough that the damage costs at most one piece.
    """
    pending = bytearray()
    try:
        with _open(log) as handle:
            while True:
                piece = _read_some(handle, min(chunk_bytes, READ_BYTES))
                if not piece:
                    break
                pending += piece
                if len(pending) < chunk_bytes:
                    continue
                cut = pending.rfind(b"\n")
                if cut < 0 and len(pending) < 16 * chunk_bytes:
                    continue  # one long line: keep reading to its end (or give up on it at 16x)
                cut = len(pending) - 1 if cut < 0 else cut
                yield bytes(pending[: cut + 1]).decode("utf-8", "replace")
                del pending[: cut + 1]
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        problems.append(f"{log.label}: read only in part ({type(exc).__name__}: {exc})")
    if pending:
        yield bytes(pending).decode("utf-8", "replace")
