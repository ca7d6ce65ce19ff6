"""The report: versioned JSON for machines, the same content the terminal shows.

Built from a RunRecord and the probes' diagnoses; written atomically (temp file +
rename) so a killed run never leaves half a JSON behind.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor import __version__
from ddpdoctor.findings import EXIT_UNKNOWN, Finding, Severity, exit_code_for
from ddpdoctor.run_diagnosis import diagnose_run, rank_fates
from ddpdoctor.run_record import RunRecord

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
        causes = [f for f in self.findings if f.code != "RUN006"]
        if self.record.interrupted and not any(f.severity == Severity.CRITICAL for f in causes):
            return EXIT_UNKNOWN  # stopped before anything was diagnosed
        return exit_code_for(f.severity for f in self.findings)

    @property
    def verdict(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)

    def nodes(self) -> list[str]:
        hosts = [self.record.host(r) for r in range(self.record.world_size)]
        return sorted({h for h in hosts if h != "?"}, key=hosts.index)

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        fates = rank_fates(rec)
        nodes = self.nodes()
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
                    "node_index": nodes.index(rec.host(r)) if rec.host(r) in nodes else None,
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
            "probes": [
                {"name": p.name, "status": p.status,
                 "findings": [f.code for f in p.findings],
                 "facts": {str(r): v for r, v in sorted(p.facts.items())}}
                for p in self.probes
            ],
        }


def build_report(record: RunRecord, backend: str = "", device: str = "",
                 command: Optional[list[str]] = None) -> Report:
    from ddpdoctor.probes import RunView, get_probe
    from ddpdoctor.probes.base import diagnose_safely

    view = RunView(world_size=record.world_size,
                   hosts={r: record.host(r) for r in record.hellos},
                   injected=record.faults, settings=record.settings)
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
    """
    if cfg.json_path:
        write_json(report, cfg.json_path)
    from ddpdoctor.probes import get_probe

    for section in report.probes:
        extra = getattr(get_probe(section.name), "write_outputs", None)
        if extra is None or not section.facts:
            continue
        try:
            extra(section.facts, cfg)
        except Exception as exc:
            sys.stderr.write(f"ddpdoctor: could not write the {section.name} outputs: {type(exc).__name__}: {exc}\n")


def write_json(report: Report, path: str) -> None:
    atomic_write_json(report.to_json(), path)


def atomic_write_json(data: Any, path: str) -> None:
    """Strict JSON via a temp file and rename: a killed run never leaves half a file."""
    import json

    atomic_write_text(json.dumps(_finite(data), indent=2, default=str, allow_nan=False) + "\n", path)


def atomic_write_text(text: str, path: str) -> None:
    atomic_write_bytes(text.encode("utf-8"), path)


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Temp file in the same folder, then rename: a killed run never leaves half a file."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".ddpdoctor-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
