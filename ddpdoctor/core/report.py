"""The report: versioned JSON for machines, the same content the terminal shows.

The model only: session/reporter.py builds it from a RunRecord and the probes' diagnoses, and
core/files.py writes it atomically. Each rank's fate (ok, crash, timeout, ...) is judged by
judge/run_diagnosis.py and handed in, so the model imports nothing above core.
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddpdoctor import __version__
from ddpdoctor.core.findings import EXIT_UNKNOWN, Finding, Severity, exit_code_for, rank_ranges
from ddpdoctor.core.files import atomic_write_json
from ddpdoctor.core.run_record import RunRecord

if TYPE_CHECKING:  # the type only: fates are judged above core and handed in
    from ddpdoctor.judge.run_diagnosis import RankFate

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
    # Each rank's fate, from judge/run_diagnosis.rank_fates (session/reporter.build_report).
    fates: Mapping[int, "RankFate"] = field(default_factory=dict)
    # The report's first line, from its root cause (judge/causal_order.verdict_line), set by the reporter.
    verdict_line: str = ""
    # The findings in the order they are shown (judge/causal_order.ordered: each root cause, worst first, then
    # what it explains), set by the reporter; the JSON lists them so. Empty: run findings, then each probe's.
    shown: list[Finding] = field(default_factory=list)

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
        fates = self.fates
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
            "verdict_line": self.verdict_line,
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
            "findings": [f.to_json() for f in (self.shown or self.findings)],
            "by_node": self.by_node(),
            "probes": [
                {"name": p.name, "status": p.status,
                 "findings": [f.code for f in p.findings],
                 "facts": {str(r): v for r, v in sorted(p.facts.items())}}
                for p in self.probes
            ],
        }


def write_json(report: Report, path: str, *, overwrite: bool = False, doc: Optional[dict[str, Any]] = None) -> str:
    """The report as JSON; returns where it went (see atomic_write_bytes on `overwrite`). `doc`: its `to_json()`,
    where the caller made it already for its other outputs."""
    return atomic_write_json(doc if doc is not None else report.to_json(), path, overwrite=overwrite)


