"""The report: versioned JSON for machines, the same content the terminal shows.

Built from a RunRecord and the probes' diagnoses; written atomically (an unnamed or
temp file, then named in one step) so a killed run never leaves half a JSON behind, and
never over an existing file unless the user passed --force.
"""

from __future__ import annotations

import datetime
import errno
import os
import platform
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ddpdoctor import __version__
from ddpdoctor.core.findings import EXIT_UNKNOWN, Finding, Severity, exit_code_for, rank_ranges
from ddpdoctor.judge.run_diagnosis import diagnose_run, rank_fates
from ddpdoctor.core.run_record import RunRecord

SCHEMA = "ddpdoctor.report/1"
VERDICTS = {0: "ok", 1: "warning", 2: "critical", 3: "unknown"}  # by exit code (Nagios)


@dataclass
class ProbeSection:
    name: str
    status: str  # ok | incomplete | not-run
    findings: list[Finding]
    facts: dict[int, dict[str, Any]]


@dataclass
class Report:
    record: RunRecord
    run_findings: list[Finding]
    probes: list[ProbeSection]
    backend: str = ""
    device: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        """The command that made it: `check` or `allreduce-bench` (command[1], after the program)."""
        sub = self.command[1] if len(self.command) > 1 else "check"
        return sub if sub in ("check", "allreduce-bench", "scaling") else "check"

    @property
    def findings(self) -> list[Finding]:
        return self.run_findings + [f for p in self.probes for f in p.findings]

    @property
    def exit_code(self) -> int:
        # A probe cut off by the signal misses ranks (e.g. DDP005 "did not complete"): that is the
        # interruption again, not a cause. Probes that finished, and the run findings, are.
        causes = [f for f in self.run_findings if f.code != "RUN006"] + [
            f for p in self.probes if p.status == "ok" for f in p.findings]
        if self.record.interrupted and not any(f.severity == Severity.CRITICAL for f in causes):
            return EXIT_UNKNOWN  # stopped before anything was diagnosed
        return exit_code_for(f.severity for f in self.findings)

    @property
    def verdict(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)

    def nodes(self) -> list[str]:
        # In order of first appearance; dict.fromkeys keeps this linear in the ranks.
        return list(dict.fromkeys(h for h in (self.record.host(r) for r in range(self.record.world_size))
                                  if h != "?"))

    def by_node(self) -> list[dict[str, Any]]:
        """Each node with its ranks and the findings that concern it, worst first: on a cluster
        the question is which node to drain, not which rank number misbehaved."""
        rec = self.record
        ranks_of: dict[str, list[int]] = {}
        for r in range(rec.world_size):
            ranks_of.setdefault(rec.host(r), []).append(r)
        hosts = self.nodes()
        for f in self.findings:
            # A node none of whose ranks arrived is known only from the finding that names it.
            for host in f.nodes:
                if host not in ranks_of:
                    ranks_of[host], hosts = sorted(f.ranks), hosts + [host]
        concern: dict[str, list[Finding]] = {host: [] for host in ranks_of}
        # Each finding once: the nodes it names, else the nodes of its ranks (linear in the ranks).
        for f in sorted((f for f in self.findings if f.severity > Severity.OK), key=lambda f: -int(f.severity)):
            for host in dict.fromkeys(f.nodes or (rec.host(r) for r in f.ranks if 0 <= r < rec.world_size)):
                if host in concern:
                    concern[host].append(f)
        return [{"node_index": index, "host": host, "ranks": rank_ranges(ranks_of[host]),
                 "worst_severity": max((f.severity for f in concern[host]), default=Severity.OK).label,
                 "findings": list(dict.fromkeys(f.code for f in concern[host]))}
                for index, host in enumerate(hosts)]

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        fates = rank_fates(rec)
        nodes = self.nodes()
        index_of = {host: i for i, host in enumerate(nodes)}
        return {
            "schema": SCHEMA,
            "ddpdoctor_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": self.command,
            "mode": rec.mode,
            "world_size": rec.world_size,
            "nodes": nodes,
            "backend": self.backend,
            "device": self.device,
            "python": platform.python_version(),
            "injected_faults": list(rec.faults),
            "settings": rec.settings,
            "interrupted": rec.interrupted or None,
            "started_at": round(rec.started, 3),  # epoch seconds, comparable with the ranks' timelines
            "duration_s": round(max(0.0, rec.ended - rec.started), 3),
            "verdict": VERDICTS[self.exit_code],
            "worst_severity": self.verdict.label,
            "exit_code": self.exit_code,
            "ranks": [
                {
                    "rank": r,
                    "host": rec.host(r),
                    "node_index": index_of.get(rec.host(r)),
                    "local_rank": (rec.hellos.get(r) or {}).get("local_rank"),
                    "pid": (rec.hellos.get(r) or {}).get("pid"),
                    "state": fates[r].kind,
                    "last_stage": fates[r].stage,
                    "collective_in_flight": fates[r].in_collective,
                    "exit": rec.exits[r].to_json() if r in rec.exits else None,
                    "timeline": rec.timelines.get(r, []),
                }
                for r in range(rec.world_size)
            ],
            "findings": [f.to_json() for f in self.findings],
            "by_node": self.by_node(),
            "probes": [
                {"name": p.name, "status": p.status,
                 "findings": [f.code for f in p.findings],
                 "facts": {str(r): v for r, v in sorted(p.facts.items())}}
                for p in self.probes
            ],
        }


def build_report(record: RunRecord, backend: str = "", device: str = "",
                 command: Optional[list[str]] = None) -> Report:
    from ddpdoctor.probes import RunView, get_probe, with_context
    from ddpdoctor.probes.base import diagnose_safely

    view = with_context(RunView(world_size=record.world_size,
                                hosts={r: record.host(r) for r in record.hellos},
                                injected=record.faults, settings=record.settings), record.results)
    sections = []
    for name in record.probes:
        facts = record.results.get(name, {})
        findings = diagnose_safely(get_probe(name), facts, view)
        status = "ok" if len(facts) == record.world_size else ("incomplete" if facts else "not-run")
        sections.append(ProbeSection(name, status, findings, facts))
    return Report(record, diagnose_run(record), sections, backend, device, list(command or sys.argv))


def _finite(value: Any) -> Any:
    """NaN and infinities become null: strict JSON parsers (jq, Go, JS) reject bare NaN."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_outputs(report: Report, cfg: Any) -> None:
    """The report's JSON, then what the probes write besides (the bench's CSV and plot).

    A file that cannot be written costs one line on stderr, never the report itself.
    `cfg.force` (the CLI's --force) decides whether an existing file may be replaced; the
    CLI already refused existing files before any rank started, so without it a file found
    now appeared during the run, and the report goes to a free sibling name instead.
    """
    if cfg.json_path:
        write_json(report, cfg.json_path, overwrite=bool(getattr(cfg, "force", False)))
    from ddpdoctor.probes import get_probe

    for section in report.probes:
        extra = getattr(get_probe(section.name), "write_outputs", None)
        if extra is None or not section.facts:
            continue
        try:
            extra(section.facts, cfg)
        except Exception as exc:
            sys.stderr.write(f"ddpdoctor: could not write the {section.name} outputs: {type(exc).__name__}: {exc}\n")


def write_json(report: Report, path: str, *, overwrite: bool = False) -> str:
    """The report as JSON; returns where it went (see atomic_write_bytes on `overwrite`)."""
    return atomic_write_json(report.to_json(), path, overwrite=overwrite)


def atomic_write_json(data: Any, path: str, *, overwrite: bool = True) -> str:
    """Strict JSON with secrets redacted, written atomically; returns the path written.

    Every JSON file ddpdoctor writes passes here, so redaction (token shapes, URL passwords,
    secret-named variables) is applied once for all of them, whatever a fact or a log held.
    """
    import json

    from ddpdoctor.core.redact import redact_json

    text = json.dumps(redact_json(_finite(data)), indent=2, default=str, allow_nan=False) + "\n"
    return atomic_write_text(text, path, overwrite=overwrite)


def atomic_write_text(text: str, path: str, *, overwrite: bool = True) -> str:
    return atomic_write_bytes(text.encode("utf-8"), path, overwrite=overwrite)


MAX_SIBLINGS = 1000  # report.1.json ... report.999.json, then give up with an error


def sibling_names(path: str) -> Iterator[str]:
    """`path`, then report.1.json, report.2.json, ...: where a refused overwrite goes instead."""
    yield path
    root, ext = os.path.splitext(path)
    for n in range(1, MAX_SIBLINGS):
        yield f"{root}.{n}{ext}"


def atomic_write_bytes(data: bytes, path: str, *, overwrite: bool = True) -> str:
    """Write `data` to `path` so that no reader, and no killed writer, ever sees half a file.

    The data goes to a file with no name (O_TMPFILE, Linux) or a hidden temp file in the
    same folder, and is then given its name in one step: rename over the target when
    `overwrite`, else a hard link, which fails if the name exists, so a file that appeared
    since the CLI's check is never replaced: the data goes to the first free sibling name
    (report.1.json, ...) and a line on stderr says where. Returns the path written.
    Library callers that rewrite their own file (Doctor, every N steps) keep the default.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        written = _write_and_name(data, path, overwrite, directory, unnamed=True)
    except _NoUnnamedFile:
        written = _write_and_name(data, path, overwrite, directory, unnamed=False)
    if written != path:
        sys.stderr.write(f"ddpdoctor: {path} appeared while ddpdoctor ran and was not overwritten: "
                         f"wrote {written} instead (pass --force to overwrite)\n")
    return written


class _NoUnnamedFile(Exception):
    """O_TMPFILE is missing, or its file cannot be named through /proc (no /proc, a sandbox)."""


def _write_and_name(data: bytes, path: str, overwrite: bool, directory: str, unnamed: bool) -> str:
    fd, tmp = _unnamed_file(directory) if unnamed else _temp_file(directory)
    try:
        _write_all(fd, data)
        os.fsync(fd)  # the rename is atomic; without this, a crash could still name an empty file
        if tmp is not None:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        return _give_name(fd, tmp, path, overwrite)
    finally:
        os.close(fd)
        if tmp is not None:
            _unlink_quietly(tmp)  # after a link (or a failure); after a rename it is already gone


def _unnamed_file(directory: str) -> tuple[int, None]:
    """An O_TMPFILE file, which vanishes if we are killed before it is named."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        raise _NoUnnamedFile()
    try:
        return os.open(directory, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666), None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # not on this file system
            raise _NoUnnamedFile() from exc
        raise  # EACCES, ENOENT, ENOSPC, ...: a named temp file would fail the same way


def _temp_file(directory: str) -> tuple[int, str]:
    """A hidden temp file: where O_TMPFILE is missing (not Linux, some network file systems)."""
    return tempfile.mkstemp(prefix=".ddpdoctor-", suffix=".tmp", dir=directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[: 1 << 20]):]


def _link(fd: int, tmp: Optional[str], target: str) -> None:
    """Give the data the name `target`; FileExistsError if it is taken, never replaces."""
    if tmp is not None:
        os.link(tmp, target)
        return
    directory, name = os.path.split(os.path.abspath(target))
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        # dst_dir_fd makes Python call linkat(AT_SYMLINK_FOLLOW): the /proc link leads to the file.
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
    except FileExistsError:
        raise
    except OSError as exc:  # /proc without that link (hidepid, a sandbox): a named temp file will do
        raise _NoUnnamedFile() from exc
    finally:
        os.close(dir_fd)


def _give_name(fd: int, tmp: Optional[str], path: str, overwrite: bool) -> str:
    if overwrite:
        if tmp is None:  # an unnamed file needs a (hidden) name before it can be renamed over
            tmp = _hidden_name(fd, path)
            try:
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
        else:
            os.replace(tmp, path)
        return path
    for candidate in sibling_names(path):
        try:
            _link(fd, tmp, candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            if tmp is None or exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            # A file system without hard links: claim the name (O_EXCL fails if it is taken),
            # then rename the complete temp file onto our own empty claim.
            try:
                os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                continue
            os.replace(tmp, candidate)
            return candidate
    raise FileExistsError(f"{path} and its {MAX_SIBLINGS - 1} sibling names all exist: nothing was overwritten")


def _hidden_name(fd: int, path: str) -> str:
    for _ in range(100):
        candidate = os.path.join(os.path.dirname(os.path.abspath(path)), f".ddpdoctor-{uuid.uuid4().hex[:12]}.tmp")
        try:
            _link(fd, None, candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
