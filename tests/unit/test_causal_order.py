"""One verdict first (judge/causal_order.py), on the reports recorded on one H100 where it was not.

`torchrun --nproc_per_node=2 -m ddpdoctor check` on one GPU led with RUN008 ("All ranks failed
inside ddp_construct_broadcast", a fix about networks) above GPU001 (2 ranks, 1 GPU: the cause);
`explain` on NCCL's "Duplicate GPU detected" log led with the generic RUN003 above GPU003
(issue 37; ../shared/reference/gpu-runs/h100-x1/torchrun2.json and explain_samedevice.json,
copied verbatim to tests/fixtures/gpu_runs/).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.judge.causal_order import link, ordered, verdict_line
from ddpdoctor.render.console import render_findings

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_runs"


def _recorded(name: str) -> list[Finding]:
    return [Finding.from_json(f) for f in json.loads((RUNS / name).read_text())["findings"]]


def test_two_ranks_on_one_gpu_lead_with_the_gpu_not_the_failed_collective():
    found = _recorded("h100x1_torchrun2.json")
    assert [f.code for f in found if f.severity == Severity.CRITICAL] == ["RUN008", "GPU001"]  # as recorded
    first, second = ordered(found)[:2]
    assert (first.code, second.code, second.explained_by) == ("GPU001", "RUN008", "GPU001")
    assert verdict_line(found).startswith("GPU001 (ranks 0-1): 2 ranks on vm but only 1 GPU among them")
    console = Console(record=True, width=160)
    render_findings(found, console)
    rows = [line for line in console.export_text().splitlines() if "GPU001" in line or "RUN008" in line]
    assert "GPU001" in rows[0] and "└ RUN008" in rows[1] and "(explained by GPU001)" in rows[1]


def test_explain_of_the_duplicate_gpu_log_leads_with_the_shared_gpu():
    found = _recorded("h100x1_explain_samedevice.json")
    assert [f.code for f in found] == ["RUN003", "GPU003"]  # as recorded
    linked = link(found)
    assert [(f.code, f.explained_by) for f in linked] == [("RUN003", "GPU003"), ("GPU003", "")]
    assert [f.code for f in ordered(found, keep_order=True)] == ["GPU003", "RUN003"]
    assert verdict_line(found).startswith("GPU003 (ranks 0-1): Ranks share one GPU")


def _f(code: str, ranks: tuple[int, ...], severity: Severity = Severity.CRITICAL, probe: str = "run") -> Finding:
    return Finding(code, severity, f"{code} title", probe, ranks=ranks, fix="Do this. Then that.")


def test_a_cause_on_other_ranks_or_an_information_explains_nothing():
    found = [_f("RUN002", (1,)), _f("GPU005", (0,), probe="gpu-count"), _f("LIM001", (1,), Severity.INFO, "limits")]
    assert [f.explained_by for f in link(found)] == ["", "", ""]
    assert verdict_line(found) == "RUN002 (rank 1): RUN002 title. First: Do this."


def test_a_healthy_report_says_so_and_json_keeps_explained_by():
    assert verdict_line([_f("INIT000", (0, 1), Severity.OK, "init-hang")]) == "healthy: no warning or critical finding"
    [cause, effect] = link([_f("INIT001", (1,), probe="init-hang"), _f("RUN008", (0, 1))])
    assert effect.to_json()["explained_by"] == "INIT001" and "explained_by" not in cause.to_json()
    assert Finding.from_json(effect.to_json()) == effect
