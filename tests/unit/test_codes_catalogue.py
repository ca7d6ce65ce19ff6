"""The catalogue of finding codes (ddpdoctor/core/codes.py) against the code and the docs.

Users search for a code: it must be documented where the catalogue says, every code the
package builds must be in the catalogue with a severity it allows, every finding is built
through the catalogue (`codes.finding`), and a code must not be worded again at a call site
once the catalogue holds its words.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import pytest

from ddpdoctor.core.codes import CODES, DOC_PAGES, finding
from ddpdoctor.core.findings import Severity

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("ddpdoctor", "probes") for p in (ROOT / folder).rglob("*.py")
                 if p != ROOT / "ddpdoctor" / "core" / "codes.py")
CODE = re.compile(r"^[A-Z]{2,6}\d{3}$")
# Strings that look like a code and are not one.
NOT_CODES = {"LL128": "an NCCL protocol (measure/nccl_tuning.py)"}
# The modules outside the core that still call `Finding(...)` themselves, and why that keeps the catalogue's words.
BUILDS_FINDINGS = {
    "ddpdoctor/explain/causes.py": ("builds from a CauseText, whose severity, why and fix explain/texts.py "
                                    "takes from CODES (or, for a code worded per case, gets from its caller)"),
}


def _trees() -> Iterator[tuple[Path, ast.Module]]:
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), str(path))


def _is_code(node: Optional[ast.expr]) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(CODE.match(node.value))
            and node.value not in NOT_CODES)


def _emitted() -> dict[str, list[str]]:
    """Every literal code string in the package, with where it is."""
    out: dict[str, list[str]] = defaultdict(list)
    for path, tree in _trees():
        for node in ast.walk(tree):
            if _is_code(node):
                out[node.value].append(f"{path.relative_to(ROOT)}:{node.lineno}")  # type: ignore[attr-defined]
    return out


def _code_calls() -> Iterator[tuple[str, ast.Call, str]]:
    """Calls that build a finding (or a finding's text) for a literal code: `Finding(code="X", ...)`,
    `finding("X", ...)`, `CauseText("X", ...)`, a probe's helper `_finding("X", Severity.WARN, ...)`."""
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            given = [k.value for k in node.keywords if k.arg == "code"] + [a for a in node.args if _is_code(a)]
            for code in given:
                if _is_code(code):
                    yield code.value, node, f"{path.relative_to(ROOT)}:{node.lineno}"  # type: ignore[attr-defined]


def _severities(call: ast.Call) -> set[str]:
    """The `Severity.X` a call passes (either branch of a conditional), as names."""
    passed = [a for a in call.args] + [k.value for k in call.keywords if k.arg == "severity"]
    names: set[str] = set()
    for arg in passed:
        for node in ast.walk(arg) if isinstance(arg, ast.IfExp) else [arg]:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Severity":
                names.add(node.attr)
    return names


def _heading_or_row_codes(page: Path) -> set[str]:
    found: set[str] = set()
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("#", "|")):
            found |= set(re.findall(r"\b[A-Z]{2,6}\d{3}\b", line))
    return found


def test_the_catalogue_holds_every_code_ddpdoctor_emits_and_the_scan_finds_them() -> None:
    emitted = _emitted()
    assert len(emitted) >= 76 and {"RUN004", "LOG001", "WATCH002", "TOP007", "HOM015"} <= set(emitted)
    unknown = {code: where for code, where in emitted.items() if code not in CODES}
    assert not unknown, f"codes built but not in ddpdoctor/core/codes.py: {unknown}"


def test_no_code_in_the_catalogue_is_emitted_by_nothing_unless_reserved() -> None:
    emitted = _emitted()
    idle = sorted(c for c, entry in CODES.items() if c not in emitted and not entry.reserved)
    assert not idle, f"in the catalogue, built nowhere, not marked reserved: {idle}"


def test_every_code_is_built_with_a_severity_the_catalogue_allows() -> None:
    checked = 0
    for code, call, where in _code_calls():
        for name in _severities(call):
            checked += 1
            assert Severity[name] in CODES[code].severities, (where, code, name, CODES[code].severities)
    assert checked >= 10  # BW000, GPU000, GPU005, INIT002, ... choose among their severities


def test_a_call_site_chooses_a_severity_only_for_a_code_that_has_several() -> None:
    """A code with one severity takes it from the catalogue; passing it again could only drift."""
    calls = list(_code_calls())
    assert len(calls) >= 130
    for code, call, where in calls:
        if len(CODES[code].severities) == 1:
            assert not _severities(call) and "severity" not in {k.arg for k in call.keywords}, (where, code)


def test_a_call_site_words_only_what_the_catalogue_leaves_to_it() -> None:
    """The catalogue holds a code's why and fix; a call site passes one only where the case builds
    it at run time (the catalogue's `per_case`, or a command that names the case's GPU, port or rank)."""
    worded = 0
    for code, call, where in _code_calls():
        for keyword in call.keywords:
            if keyword.arg in ("why", "fix"):
                worded += 1
                assert not getattr(CODES[code], keyword.arg), (where, code, keyword.arg, "worded in the catalogue")
    assert worded >= 40  # the per-case words are still found by the scan


def _finding_calls() -> Iterator[tuple[str, ast.Call]]:
    """Direct `Finding(...)` calls (a finding built without the catalogue), by module."""
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "Finding"
                                               or getattr(node.func, "attr", None) == "Finding"):
                yield str(path.relative_to(ROOT)), node


def test_every_finding_outside_the_core_is_built_through_the_catalogue() -> None:
    direct = [(where, call) for where, call in _finding_calls() if not where.startswith("ddpdoctor/core/")]
    # An exact match: a new direct call fails here, and so does an exception that no longer applies.
    assert {where for where, _ in direct} == set(BUILDS_FINDINGS), sorted(f"{w}:{c.lineno}" for w, c in direct)
    for where, call in direct:
        assert not any(_is_code(k.value) for k in call.keywords if k.arg == "code"), (where, call.lineno)


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_has_its_section_on_the_page_the_catalogue_names(code: str) -> None:
    entry = CODES[code]
    page = ROOT / entry.doc
    assert entry.doc == DOC_PAGES[entry.family] and page.is_file(), entry
    assert code in _heading_or_row_codes(page), f"{code}: no heading or table row on {entry.doc}"


def test_each_entry_says_how_its_severity_and_words_are_chosen() -> None:
    for code, entry in CODES.items():
        assert entry.code == code and entry.severities, code
        # Several severities: the rule that picks one is written down; one: none is needed.
        assert bool(entry.severity_rule) == (len(entry.severities) > 1), code
        # Worded per case: the catalogue holds no why/fix that call sites would contradict.
        assert not (entry.per_case and (entry.why or entry.fix)), code


def test_finding_takes_severity_and_words_from_the_catalogue_and_refuses_a_second_wording() -> None:
    built = finding("RUN004", "run", "rank 1 hung", ranks=(1,))
    assert (built.severity, built.why, built.fix) == (Severity.CRITICAL, CODES["RUN004"].why, CODES["RUN004"].fix)
    assert built.ranks == (1,) and built.probe == "run"
    with pytest.raises(ValueError, match="RUN004 has its why"):
        finding("RUN004", "run", "rank 1 hung", why="another wording")
    with pytest.raises(ValueError, match="never info"):
        finding("RUN004", "run", "rank 1 hung", severity=Severity.INFO)
    assert finding("TOP002", "topology", "t", severity=Severity.INFO).severity == Severity.INFO
    with pytest.raises(ValueError, match="several severities"):
        finding("TOP002", "topology", "t")
    per_case = finding("RUN009", "explain", "desync", why="w", fix="f")
    assert (per_case.why, per_case.fix) == ("w", "f")
