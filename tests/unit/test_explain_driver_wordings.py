"""`explain` names a driver too old for the job's CUDA in every wording it has had, from lines users
pasted in public issues (verbatim, each with its source), and a kernel's PTX newer than the driver.

Issue 37: "every wording torch and the driver have used for the same cause (a driver too old for the
build, from old assertion text to today's errors)". Before, only torch's "The NVIDIA driver on your
system is too old" was known; the CUDA runtime's cudaErrorInsufficientDriver (35), as old torch's
THCudaCheck and "cuda runtime error (35)", today's "CUDA error: ...", and NCCL's WARN printed it, fell
to the generic CUDA error (LOG009) or to nothing.
"""

from __future__ import annotations

import pytest

from ddpdoctor.core.findings import Severity
from ddpdoctor.explain.command import explain

from pathlib import Path

WORDINGS = Path(__file__).resolve().parents[1] / "fixtures" / "explain" / "wordings"

# (the pasted log, verbatim: its source is in the README there; the code; a word the title must have)
CASES = [
    ("mlcommons_inference54_thcudacheck_error35.log", "GPU008", "too old"),  # torch 1.0-era THCudaCheck, then RuntimeError
    ("cuml5961_nccl_warn_insufficient.log", "GPU008", "too old"),  # NCCL WARN through RAFT
    ("nunif702_cuda_error_insufficient.log", "GPU008", "too old"),  # today's torch, CUDA 13 wheels
    ("nccl_tests12_cuda_failure_insufficient.log", "GPU008", "too old"),  # nccl-tests on driver 384.81
    ("cuda_memtest31_ptx_toolchain.log", "GPU008", "newer CUDA toolkit"),  # toolkit 11.3, driver 460.80
    ("ios4_cuda_failure_222_ptx.log", "GPU008", "newer CUDA toolkit"),
]


def test_every_wording_has_its_source_recorded():
    readme = (WORDINGS / "README.md").read_text()
    assert sorted(p.name for p in WORDINGS.glob("*.log")) == sorted(name for name, _, _ in CASES)
    assert all(f"`{name}` | https://github.com/" in readme for name, _, _ in CASES)


@pytest.mark.parametrize("name, code, words", CASES, ids=[c[0] for c in CASES])
def test_each_wording_leads_with_the_driver(name, code, words):
    findings = explain([str(WORDINGS / name)]).explanation.findings
    top = max(findings, key=lambda f: f.severity)  # the first of the worst, as the report leads
    top = next(f for f in findings if f.severity == top.severity)
    assert top.code == code and top.severity == Severity.CRITICAL, (name, [(f.code, f.title) for f in findings])
    assert words in top.title, top.title
    assert "{" not in top.why + top.title, "a placeholder left unfilled"


def test_torch_found_version_is_read_as_the_drivers_cuda(tmp_path):
    """torch's own wording (tests/fixtures/explain/published/driver_too_old.log): "found version 12080" is
    the driver's newest CUDA, 12.8; the finding says it, and no "{found}" is left in its text."""
    log = Path(__file__).resolve().parents[1] / "fixtures" / "explain" / "published" / "driver_too_old.log"
    [top] = [f for f in explain([str(log)]).explanation.findings if f.code == "GPU008"]
    assert top.title.endswith("its driver supports up to CUDA 12.8"), top.title
    assert "{" not in top.why
