"""Findings: what a diagnosis tells the user, with the evidence and the fix."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

# Nagios plugin convention, as cluster health checkers use it.
from ddpdoctor.core.exits import EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING  # noqa: F401 (re-exported)


class Severity(enum.IntEnum):
    """Ordered so that the worst finding decides the run's verdict."""

    OK = 0
    INFO = 1
    WARN = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Severity":
        return cls[text.upper()]


def exit_code_for(severities: Iterable[Severity]) -> int:
    worst = max(severities, default=Severity.OK)
    if worst == Severity.CRITICAL:
        return EXIT_CRITICAL
    if worst == Severity.WARN:
        return EXIT_WARNING
    return EXIT_OK


@dataclass(frozen=True)
class Finding:
    """One diagnosis. `code` is stable and documented in docs/; users search for it."""

    code: str
    severity: Severity
    title: str
    probe: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    why: str = ""
    # The code of the finding that explains this one (judge/causal_order.py): shown under it.
    explained_by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity.label,
            "title": self.title,
            "probe": self.probe,
            "ranks": list(self.ranks),
            "nodes": list(self.nodes),
            "evidence": self.evidence,
            "why": self.why,
            "fix": self.fix,
        } | ({"explained_by": self.explained_by} if self.explained_by else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Finding":
        return cls(
            code=data["code"],
            severity=Severity.parse(data["severity"]),
            title=data["title"],
            probe=data["probe"],
            ranks=tuple(data.get("ranks", ())),
            nodes=tuple(data.get("nodes", ())),
            evidence=dict(data.get("evidence", {})),
            fix=data.get("fix", ""),
            why=data.get("why", ""),
            explained_by=str(data.get("explained_by") or ""),
        )


def rank_ranges(ranks: Iterable[int]) -> str:
    """`0-3,6`: compact enough for a one-screen report of 1000 ranks."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
