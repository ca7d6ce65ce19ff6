"""`ddpdoctor explain` scored on real logs users pasted in public issues.

tests/fixtures/explain/public/<launcher>/ holds them verbatim, each with its source and the
truth (truth.json: launcher, healthy, culprit_ranks, culprit_nodes, cause_codes). A failure
log is right when the headline (the first finding of the highest severity) has one of the
truth's codes and at least the truth's culprit nodes, and, where the truth names culprit
ranks, the ranks the explanation blames are exactly those: the union of the ranks of its
critical findings, the headline's among them (a CUDA OOM on rank 2 and rank 1 ending on its
own with no error pasted are both ranks a user must look at). False blame is a critical
finding naming a rank or node outside the culprits, or any warn/critical finding on a
healthy log. The score is printed in docs/explain.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.explain.command import explain

PUBLIC = Path(__file__).resolve().parents[1] / "fixtures" / "explain" / "public"


@dataclass
class Score:
    name: str
    launcher: str
    right: bool
    false_blame: str
    got: str


def _corpus() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for truth_file in sorted(PUBLIC.glob("*/truth.json")):
        for name, truth in sorted(json.loads(truth_file.read_text()).items()):
            out.append((truth_file.parent / name, truth))
    return out


def headline(findings: list[Finding]) -> Finding:
    worst = max(f.severity for f in findings)
    return next(f for f in findings if f.severity == worst)


def _false_blame(findings: list[Finding], truth: dict[str, Any]) -> str:
    if truth["healthy"]:
        loud = [f for f in findings if f.severity >= Severity.WARN]
        return f"{loud[0].code} on a healthy log" if loud else ""
    ranks, nodes = set(truth["culprit_ranks"]), set(truth.get("culprit_nodes") or [])
    for f in findings:
        if f.severity != Severity.CRITICAL:
            continue
        if set(f.ranks) - ranks:
            return f"{f.code} blames rank {sorted(set(f.ranks) - ranks)}"
        if set(f.nodes) - nodes:
            return f"{f.code} blames node {sorted(set(f.nodes) - nodes)}"
    return ""


def score(path: Path, truth: dict[str, Any]) -> Score:
    findings = explain([str(path)]).explanation.findings
    top = headline(findings)
    blamed = {r for f in findings if f.severity == Severity.CRITICAL for r in f.ranks}
    got = f"{top.code} {top.severity.label} ranks={list(top.ranks)} nodes={list(top.nodes)}: {top.title[:90]}"
    if truth["healthy"]:
        right = top.severity < Severity.WARN
    else:
        right = (top.code in truth["cause_codes"]
                 and (not truth["culprit_ranks"] or (blamed == set(truth["culprit_ranks"])
                                                     and set(top.ranks) <= blamed and bool(top.ranks)))
                 and set(truth.get("culprit_nodes") or []) <= set(top.nodes))
    return Score(path.parent.name + "/" + path.name, truth["launcher"], right, _false_blame(findings, truth), got)


def table(scores: list[Score]) -> str:
    rows = [f"{'ok ' if s.right and not s.false_blame else 'BAD'} {s.name}: {s.got}"
            + (f"  FALSE BLAME: {s.false_blame}" if s.false_blame else "") for s in scores]
    right = sum(s.right for s in scores)
    return "\n".join(rows + [f"right {right}/{len(scores)}, false blame {sum(bool(s.false_blame) for s in scores)}"])


def test_public_corpus_score() -> None:
    corpus = _corpus()
    scores = [score(path, truth) for path, truth in corpus]
    report = table(scores)
    assert len(corpus) >= 40, report
    assert len({t["launcher"] for _, t in corpus}) >= 6, report
    assert sum(t["healthy"] for _, t in corpus) >= 3, report
    assert sum(s.right for s in scores) >= 0.95 * len(scores), report
    assert not [s for s in scores if s.false_blame], report


def test_every_truth_names_an_existing_log() -> None:
    missing = [str(path) for path, _ in _corpus() if not path.is_file()]
    assert missing == []
