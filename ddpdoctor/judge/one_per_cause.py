"""One finding per cause: the same code and cause on several ranks is one finding with those ranks.

Why here and not in each probe: a rule written rank by rank (GPU005 reads one rank's
CUDA_VISIBLE_DEVICES) is simplest to write and to test per rank, but a report that says it
once per rank buries the next cause under copies (`CUDA_VISIBLE_DEVICES= ddpdoctor check` on a
one-GPU machine printed GPU005 twice, issue 37). Every command that builds findings from the
probes' rules (check, diagnose, snapshot, the callback) passes them through `merge`.

Two findings are one cause when they agree in everything but the rank they name: code,
severity, probe, why, fix, evidence, and the title once the rank is written as a placeholder.
Findings naming several ranks, or whose title does not name its one rank, are left alone: the
rule never guesses what a title means.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterable, Optional

from ddpdoctor.core.findings import Finding, rank_ranges

_SLOT = "\x00RANK\x00"


def _rank_pattern(rank: int) -> re.Pattern[str]:
    return re.compile(rf"\b([Rr])ank {rank}\b")


def _template(f: Finding) -> Optional[str]:
    """The title with its one rank as a placeholder, if it names exactly that rank exactly once."""
    if len(f.ranks) != 1:
        return None
    found = _rank_pattern(f.ranks[0]).findall(f.title)
    if len(found) != 1:
        return None
    return _rank_pattern(f.ranks[0]).sub(lambda m: m.group(1) + _SLOT, f.title)


def _key(f: Finding, template: str) -> tuple[str, ...]:
    evidence = json.dumps(f.evidence, sort_keys=True, default=str)
    return (f.code, f.severity.label, f.probe, f.why, f.fix, template, evidence)


def merge(findings: Iterable[Finding]) -> list[Finding]:
    """The findings in their order, copies of one cause on other ranks folded into its first."""
    out: list[Finding] = []
    groups: dict[tuple[str, ...], int] = {}
    templates: dict[int, str] = {}
    for f in findings:
        template = _template(f)
        if template is None:
            out.append(f)
            continue
        key = _key(f, template)
        if key not in groups:
            groups[key] = len(out)
            templates[len(out)] = template
            out.append(f)
            continue
        first = out[groups[key]]
        ranks = tuple(sorted(set(first.ranks) | set(f.ranks)))
        out[groups[key]] = dataclasses.replace(
            first, ranks=ranks, nodes=tuple(dict.fromkeys(first.nodes + f.nodes)),
            title=templates[groups[key]].replace(_SLOT, f"anks {rank_ranges(ranks)}"))  # "r"/"R" kept
    return out
