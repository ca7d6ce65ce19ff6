"""The history store: append one run in one transaction, read every run back, typed.

SQLite, because a fleet's prologs need a store with no server: one file, on a node's disk or
shared by many nodes' prologs. Concurrent writers are safe: each writer waits for the lock (busy
timeout) and retries until a deadline, and a run's rows go in one `BEGIN IMMEDIATE` transaction,
so a run is stored whole or not at all. On a local disk the store is in WAL mode (readers never
block the writer). WAL's index is shared memory, which hosts cannot share: on a network
filesystem (NFS, Lustre, GPFS, ...) the store keeps SQLite's rollback journal, whose locks are
the filesystem's own (sqlite.org/wal.html, "WAL does not work over a network filesystem").
Nothing already stored is ever lost: a store this code cannot write (a newer schema,
a corrupt file, a lock held past the deadline, a read-only path) is left exactly as it was, and
the caller gets a `HistoryError` with one line saying why.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
import urllib.parse
from dataclasses import astuple, dataclass, field
from typing import Callable, Optional, TypeVar

from ddpdoctor.history.schema import COLUMNS, MIGRATIONS, SCHEMA_VERSION, VERSION_KEY

ENV_VAR = "DDPDOCTOR_HISTORY"
DEFAULT_DEADLINE_S = 60.0  # a prolog of hundreds of nodes at once: each append is milliseconds
_BUSY_SLICE_S = 2.0  # SQLite's own wait per attempt; between attempts, a jittered back-off

T = TypeVar("T")


class HistoryError(Exception):
    """The store could not be written or read; the message is one line, naming the path and why."""


@dataclass(frozen=True)
class RunRow:
    run_id: str
    started_at: float  # unix seconds
    command: str  # check | allreduce-bench | snapshot | callback
    verdict: str  # ok | warning | critical | unknown
    exit_code: int
    world_size: int
    ddpdoctor_version: str
    label: Optional[str] = None


@dataclass(frozen=True)
class NodeRow:
    run_id: str
    node: str
    ranks: str  # '0-3,8'


@dataclass(frozen=True)
class Measurement:
    run_id: str
    node: str
    rank: Optional[int]
    gpu: Optional[str]  # the GPU's uuid, or its index where it has none; None on a CPU rank
    model: Optional[str]  # the GPU model, or the CPU model (or 'cpu') on a CPU rank
    metric: str  # compute_speed, busbw_gbs, algbw_gbs, busbw_gbs@<bytes>, ecc_*, remapped_rows_*, ...
    value: float
    unit: str


@dataclass(frozen=True)
class FindingRow:
    run_id: str
    code: str
    severity: str
    node: Optional[str]
    rank: Optional[int]
    title: str


@dataclass
class RunRows:
    """One run, as it is appended: all of it in one transaction."""

    run: RunRow
    nodes: list[NodeRow] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[FindingRow] = field(default_factory=list)


@dataclass
class History:
    """Every run in a store, oldest first; rows of the other tables in the order they were stored."""

    path: str
    schema_version: int
    runs: list[RunRow]
    nodes: list[NodeRow]
    measurements: list[Measurement]
    findings: list[FindingRow]


def append(path: str, rows: RunRows, *, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
    """Store one run (creating and migrating the store as needed), or raise HistoryError."""
    check_path(path)
    _with_retries(path, deadline_s, lambda conn: _append_once(conn, path, rows), create=True)


def read_history(path: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> History:
    """Every run in the store at `path`, typed, from one consistent snapshot (writers may go on)."""
    check_path(path, must_exist=True)
    return _with_retries(path, deadline_s, lambda conn: _read_once(conn, path), create=False)


def check_path(path: str, *, must_exist: bool = False) -> None:
    """What is wrong with `path` as a store, seen without opening it (HistoryError), so a command
    refuses a mistyped --history before it measures anything."""
    if not path.strip():
        raise HistoryError("history store path is empty: give a file path")
    if os.path.isdir(path):
        raise HistoryError(f"history store {path} is a folder: give a file path")
    if must_exist and not os.path.exists(path):
        raise HistoryError(f"no history store at {path}: record runs with --history {path} first")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise HistoryError(f"history store {path}: folder {folder} does not exist")


def _connect(path: str, create: bool, busy_s: float) -> sqlite3.Connection:
    # mode=rw never creates a file: a reader of a mistyped path gets an error, not an empty store.
    uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode={'rwc' if create else 'rw'}"
    conn = sqlite3.connect(uri, uri=True, timeout=busy_s, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_s * 1000)}")
    return conn


def _with_retries(path: str, deadline_s: float, work: Callable[[sqlite3.Connection], T], *, create: bool) -> T:
    """`work` on a fresh connection, retried while the store is busy, until the deadline."""
    deadline = time.monotonic() + deadline_s
    pause = 0.02
    while True:
        left = deadline - time.monotonic()
        try:
            conn = _connect(path, create, max(0.05, min(_BUSY_SLICE_S, left)))
            try:
                return work(conn)
            finally:
                conn.close()
        except HistoryError:
            raise
        except sqlite3.OperationalError as exc:
            if not _busy(exc):
                raise HistoryError(_why(path, exc)) from None
            if time.monotonic() >= deadline:
                raise HistoryError(f"history store {path} stayed locked for {deadline_s:g}s by other writers; "
                                   "nothing was recorded (the store is unchanged)") from None
        except sqlite3.DatabaseError as exc:
            raise HistoryError(_why(path, exc)) from None
        time.sleep(max(0.0, min(deadline - time.monotonic(), pause * random.uniform(0.5, 1.5))))
        pause = min(pause * 2, 0.5)


def _busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _why(path: str, exc: sqlite3.Error) -> str:
    text = str(exc)
    low = text.lower()
    if "not a database" in low or "malformed" in low:
        return (f"history store {path} is not a readable SQLite store ({text}): it was left as it is; "
                "move it aside and record to a new file")
    if "readonly" in low or "read-only" in low or "unable to open" in low or "disk i/o" in low:
        return f"history store {path} cannot be written or opened ({text}): give a writable path"
    return f"history store {path}: {type(exc).__name__}: {text}"


# Filesystems whose files other hosts write too (as /proc/mounts names them).
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph",
                                 "glusterfs", "fuse.glusterfs", "fuse.sshfs", "afs", "9p", "panfs", "wekafs",
                                 "fuse.juicefs", "fuse.s3fs"})


def on_network_filesystem(path: str, mounts: Optional[str] = None) -> bool:
    """Whether `path`'s folder is on a filesystem other hosts share (by the longest mount point
    above it in /proc/mounts; False where that cannot be read)."""
    if mounts is None:
        try:
            with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return False
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in NETWORK_FILESYSTEMS


def _version(conn: sqlite3.Connection, path: str) -> int:
    """The store's schema version; 0 for a new (empty) file."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (VERSION_KEY,)).fetchone()
    try:
        return int(row[0]) if row is not None else 0
    except (TypeError, ValueError):
        raise HistoryError(f"history store {path} has schema version {row[0]!r}, not a number: "
                           "it was left as it is; record to a new file") from None


def _migrate(conn: sqlite3.Connection, path: str) -> None:
    """Bring the store to SCHEMA_VERSION, inside the caller's transaction: only ever adding."""
    current = _version(conn, path)
    if current > SCHEMA_VERSION:
        raise HistoryError(f"history store {path} has schema version {current}, newer than this ddpdoctor "
                           f"knows ({SCHEMA_VERSION}): upgrade ddpdoctor, or record to another file "
                           "(the store is unchanged)")
    for version in range(current + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[version]:
            conn.execute(statement)
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (VERSION_KEY, str(version)))


def _append_once(conn: sqlite3.Connection, path: str, rows: RunRows) -> None:
    # WAL persists in the file: set on first use, a no-op after. Never switched back: on a network
    # filesystem a store simply keeps the default rollback journal.
    if not on_network_filesystem(path):
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN IMMEDIATE")
    try:
        _migrate(conn, path)
        _insert(conn, "runs", [rows.run])
        _insert(conn, "run_nodes", rows.nodes)
        _insert(conn, "measurements", rows.measurements)
        _insert(conn, "findings", rows.findings)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _insert(conn: sqlite3.Connection, table: str, rows: list) -> None:
    if not rows:
        return
    columns = COLUMNS[table]
    conn.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                     [astuple(row) for row in rows])


def _read_once(conn: sqlite3.Connection, path: str) -> History:
    conn.execute("BEGIN")  # one snapshot: a run being appended is seen whole or not at all
    try:
        version = _version(conn, path)
        if version == 0:
            raise HistoryError(f"{path} is not a ddpdoctor history store (no schema version): "
                               "record runs with --history first")

        def rows(table: str, order: str) -> list[tuple]:
            return conn.execute(f"SELECT {', '.join(COLUMNS[table])} FROM {table} ORDER BY {order}").fetchall()

        return History(path=path, schema_version=version,
                       runs=[RunRow(*r) for r in rows("runs", "started_at, rowid")],
                       nodes=[NodeRow(*r) for r in rows("run_nodes", "rowid")],
                       measurements=[Measurement(*r) for r in rows("measurements", "rowid")],
                       findings=[FindingRow(*r) for r in rows("findings", "rowid")])
    finally:
        conn.execute("COMMIT")
