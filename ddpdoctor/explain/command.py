"""`ddpdoctor explain`: a failed job's logs and dumps in, the same kind of report out.

read (log_reader) → events (log_scan) and collectives (flight_recorder) → findings
(explain_diagnosis) → terminal and JSON (render_explain, to_json). Nothing here exits;
the CLI picks the exit code from the findings, as for `check`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor import __version__
from ddpdoctor.explain.diagnosis import Explanation, diagnose
from ddpdoctor.core.findings import Severity, exit_code_for
from ddpdoctor.judge.flight_recorder import DumpSet, compare, read_dumps
from ddpdoctor.explain.read import DumpFile, discover
from ddpdoctor.explain.requeue import Requeue, requeue_verdict
from ddpdoctor.explain.scan import ScanResult, scan

SCHEMA = "ddpdoctor.explain/1"
TIMELINE_JSON_MAX = 500


@dataclass
class ExplainRun:
    explanation: Explanation
    scan: ScanResult
    dumps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # skipped files, partial reads, unreadable dumps
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return exit_code_for(f.severity for f in self.explanation.findings)

    @property
    def requeue(self) -> Requeue:
        """Whether running the job again would help, and the exit code `--exit-code requeue` gives."""
        return requeue_verdict(self.explanation)

    def to_json(self) -> dict[str, Any]:
        from ddpdoctor.core.redact import redact_json
        from ddpdoctor.core.report import VERDICTS

        ex = self.explanation
        # Quoted log lines can hold whatever a job printed: tokens, URLs with passwords.
        return redact_json({
            "schema": SCHEMA, "ddpdoctor_version": __version__,
            "inputs": {"logs": self.scan.files, "dumps": self.dumps, "lines": self.scan.lines,
                       "bytes": self.scan.bytes, "seconds": round(self.seconds, 3), "notes": self.notes},
            "world_size": ex.world_size, "hosts": {str(r): h for r, h in sorted(ex.hosts.items())},
            "verdict": VERDICTS[self.exit_code],
            "worst_severity": max((f.severity for f in ex.findings), default=Severity.OK).label,
            "exit_code": self.exit_code,
            "requeue": self.requeue.to_json(),
            "findings": [f.to_json() for f in ex.findings],
            "ranks": [{"rank": s.rank, "host": s.host, "first_error": s.first.to_json() if s.first else None,
                       "more_errors": s.more} for s in ex.ranks],
            "nodes": [{"node": n.node, "ranks": n.ranks, "first_error": n.first.to_json() if n.first else None}
                      for n in ex.nodes],
            "timeline": [e.to_json() for e in ex.timeline[:TIMELINE_JSON_MAX]],
            "timeline_truncated": max(0, len(ex.timeline) - TIMELINE_JSON_MAX),
        })


def explain(paths: list[str], world_size: Optional[int] = None) -> ExplainRun:
    started = time.monotonic()
    inputs = discover(paths)
    result = scan(inputs.logs)
    dumps = _read_dumps(inputs.dumps)
    mismatches, agreements = compare(dumps)
    explanation = diagnose(result.events, world_size, mismatches, agreements, dumps.dumps)
    notes = list(inputs.skipped) + result.problems + dumps.problems
    if result.dropped:
        notes.append(f"{result.dropped} further distinct error lines were counted but not kept")
    return ExplainRun(explanation, result, [d.label for d in dumps.dumps.values()], notes,
                      time.monotonic() - started)


def _read_dumps(files: list[DumpFile]) -> DumpSet:
    """read_dumps, except that a dump it fails on in a way it does not expect costs a note, not
    the run: the files are hostile input, so they are read one by one to find the culprit."""
    try:
        return read_dumps(files)
    except Exception:
        pass
    readable, problems = [], []
    for f in files:
        try:
            read_dumps([f])
            readable.append(f)
        except RecursionError:
            problems.append(f"{f.label}: not a readable Flight Recorder dump (nested deeper than JSON can be read)")
        except Exception as exc:
            problems.append(f"{f.label}: not a readable Flight Recorder dump ({type(exc).__name__}: {str(exc)[:200]})")
    out = read_dumps(readable)
    out.problems[:0] = problems
    return out
