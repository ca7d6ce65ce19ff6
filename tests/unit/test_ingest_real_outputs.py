"""The real GPU-node outputs in ../shared/reference/gpu-outputs (recorded on real machines, with
what a correct reading must say in truth.json), judged the way truth.json's scoring says: each
file copied to a neutral name and run through `ddpdoctor diagnose FILE --json OUT`.

A problem file must give at least one warn or critical finding whose title names the problem
(one of its keywords); a healthy file must give none. Read in place, never copied into the
project; skipped where ../shared is absent.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest

from ddpdoctor import cli

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference" / "gpu-outputs"
TRUTH = json.loads((SHARED / "truth.json").read_text()) if (SHARED / "truth.json").exists() else {"files": []}


def _keyword_in(keyword: str, text: str) -> bool:
    """truth.json's rule: a word boundary before a leading letter or digit, and after a trailing digit."""
    pattern = re.escape(keyword)
    if keyword[:1].isalnum():
        pattern = r"\b" + pattern
    if keyword[-1:].isdigit():
        pattern += r"\b"
    return re.search(pattern, text) is not None


def diagnose_as_the_bar_does(source: pathlib.Path, tmp_path: pathlib.Path, capsys) -> tuple[int, dict]:
    neutral = tmp_path / ("output.xml" if source.suffix == ".xml" else "output.txt")
    shutil.copyfile(source, neutral)
    out = tmp_path / "diagnosis.json"
    code = cli.main(["diagnose", str(neutral), "--json", str(out)])
    capsys.readouterr()
    return code, (json.loads(out.read_text()) if out.exists() else {})


@pytest.mark.skipif(not TRUTH["files"], reason="../shared/reference/gpu-outputs is not here")
@pytest.mark.parametrize("case", TRUTH["files"], ids=[f["file"] for f in TRUTH["files"]])
def test_a_real_output_is_read_with_the_right_findings(case, tmp_path, capsys):
    code, diagnosis = diagnose_as_the_bar_does(SHARED / case["file"], tmp_path, capsys)
    assert code != 3 and diagnosis, f"{case['file']} was not read (exit {code})"
    loud = [f for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")]
    if case["healthy"]:
        assert not loud, [f["title"] for f in loud]
    else:
        said = [f["title"].lower() for f in loud]
        assert any(_keyword_in(k, t) for k in case["keywords"] for t in said), (case["keywords"], said)
