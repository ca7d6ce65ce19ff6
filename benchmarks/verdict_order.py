"""Which finding leads each recorded report, before and after the causal order (issue 37).

Reads every log of `explain`'s corpus (tests/fixtures/explain/{public,published,real}) and every
report recorded on a real GPU (tests/fixtures/gpu_runs/*.json), and prints, as a markdown table,
the cause each leads with: before (worst first, then the run's own findings: the order the
reports had) and after (judge/causal_order.py: a specific cause above the generic failures it
explains). Rows where the lead changed are listed; the rest are counted.

    python benchmarks/verdict_order.py > /tmp/verdicts.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpdoctor.core.findings import Finding, Severity  # noqa: E402
from ddpdoctor.explain.command import explain  # noqa: E402
from ddpdoctor.judge.causal_order import ordered  # noqa: E402


def _before(findings: list[Finding], keep_order: bool) -> Finding:
    key = (lambda f: -int(f.severity)) if keep_order else (lambda f: (-int(f.severity), f.probe != "run", f.code))
    return sorted(findings, key=key)[0]


def _rows() -> list[tuple[str, str, str]]:
    out = []
    for folder in ("public", "published", "real"):
        for log in sorted((ROOT / "tests" / "fixtures" / "explain" / folder).rglob("*")):
            if not log.is_file() or log.suffix in (".md", ".py", ".json"):
                continue
            found = explain([str(log)]).explanation.findings
            if not found or max(f.severity for f in found) < Severity.WARN:
                continue
            out.append((str(log.relative_to(ROOT)), _before(found, True).code, ordered(found, keep_order=True)[0].code))
    for report in sorted((ROOT / "tests" / "fixtures" / "gpu_runs").glob("*.json")):
        found = [Finding.from_json({**f, "explained_by": ""}) for f in json.loads(report.read_text())["findings"]]
        if found and max(f.severity for f in found) >= Severity.WARN:
            keep = "inputs" in json.loads(report.read_text())  # explain's report keeps its cause-first order
            out.append((str(report.relative_to(ROOT)), _before(found, keep).code, ordered(found, keep)[0].code))
    return out


def main() -> None:
    rows = _rows()
    changed = [r for r in rows if r[1] != r[2]]
    print(f"{len(rows)} recorded reports with a warning or worse; the lead changed in {len(changed)}:\n")
    print("| recorded | led with before | leads with now |\n|---|---|---|")
    for name, before, after in changed:
        print(f"| `{name}` | {before} | {after} |")


if __name__ == "__main__":
    main()
