"""One finding per cause (judge/one_per_cause.py), on the recorded report where it was not.

`CUDA_VISIBLE_DEVICES= ddpdoctor check` on one H100 (tests/fixtures/gpu_runs/h100x1_novisible.json,
a verbatim copy of ../shared/reference/gpu-runs/h100-x1/novisible.json; issue 37) printed GPU005
once per rank; the probe's own facts, judged again, must give it once for ranks 0-1.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.judge.one_per_cause import merge
from ddpdoctor.probes import RunView, get_probe
from ddpdoctor.probes.base import diagnose_safely

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_runs" / "h100x1_novisible.json"


def _f(rank: int, title: str, **kw) -> Finding:
    return Finding(kw.pop("code", "GPU005"), kw.pop("severity", Severity.CRITICAL), title, "gpu-count",
                   ranks=(rank,), nodes=kw.pop("nodes", ("vm",)), evidence=kw.pop("evidence", {"nvml_gpus": 1}),
                   why="w", fix="f")


def test_the_same_cause_on_two_ranks_is_one_finding_with_both():
    merged = merge([_f(0, "hides every GPU from rank 0 on a node with 1"),
                    _f(1, "hides every GPU from rank 1 on a node with 1")])
    assert [(f.ranks, f.title) for f in merged] == [((0, 1), "hides every GPU from ranks 0-1 on a node with 1")]


def test_another_value_another_severity_or_a_title_without_its_rank_stay_apart():
    merged = merge([_f(0, "Rank 0 sees 2"), _f(1, "Rank 1 sees 2", evidence={"nvml_gpus": 2}),
                    _f(2, "Rank 2 sees 2", severity=Severity.WARN), _f(3, "no rank here"), _f(4, "no rank here"),
                    _f(5, "Rank 5 and rank 5")])
    assert [f.ranks for f in merged] == [(0,), (1,), (2,), (3,), (4,), (5,)]


def test_order_is_kept_and_nodes_are_joined():
    merged = merge([_f(0, "Rank 0 x", nodes=("a",)), _f(1, "other", code="GPU001"), _f(2, "Rank 2 x", nodes=("b",))])
    assert [(f.code, f.ranks, f.nodes, f.title) for f in merged] == [
        ("GPU005", (0, 2), ("a", "b"), "Ranks 0,2 x"), ("GPU001", (1,), ("vm",), "other")]


def test_the_recorded_h100_report_gives_gpu005_once_for_both_ranks():
    report = json.loads(RECORDED.read_text())
    assert [f["ranks"] for f in report["findings"] if f["code"] == "GPU005"] == [[0], [1]]  # as it was printed
    [section] = [p for p in report["probes"] if p["name"] == "gpu-count"]
    view = RunView(world_size=2, hosts={0: "vm", 1: "vm"})
    found = [f for f in diagnose_safely(get_probe("gpu-count"), section["facts"], view) if f.code == "GPU005"]
    title = "CUDA_VISIBLE_DEVICES='' hides every GPU from ranks 0-1 on a node with 1"
    assert [(f.ranks, f.title) for f in found] == [((0, 1), title)]
