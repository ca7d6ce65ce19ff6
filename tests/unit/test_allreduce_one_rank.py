"""One rank has no link to measure (BW008), judged on the H100 record where the report said
"OK ... peak busbw 0 GB/s" beside an algbw of 209,715 GB/s (issue 41;
tests/fixtures/gpu_runs/h100x1_check_all.json, a verbatim copy of
../shared/reference/gpu-runs/h100-x1/check_all.json)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ddpdoctor.probes import RunView, get_probe
from ddpdoctor.probes.base import diagnose_safely

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_runs" / "h100x1_check_all.json"


def _facts() -> dict:
    report = json.loads(RECORDED.read_text())
    [section] = [p for p in report["probes"] if p["name"] == "allreduce"]
    assert [f["code"] for f in report["findings"] if f["probe"] == "allreduce"] == ["BW000"]  # as it was printed
    return section["facts"]


def test_one_rank_is_told_there_is_no_link_not_ok_at_zero_busbw():
    found = diagnose_safely(get_probe("allreduce"), _facts(), RunView(world_size=1, hosts={0: "vm"}))
    assert [f.code for f in found] == ["BW008"]
    [one] = found
    assert one.title.startswith("all_reduce on 1 rank: no link to measure")
    assert one.evidence["device"].startswith("cuda") and one.evidence["fastest_local_algbw_gbps"] > 100_000
    gated = diagnose_safely(get_probe("allreduce"), _facts(),
                            RunView(world_size=1, hosts={0: "vm"}, settings={"min_busbw_gbps": 100.0}))
    assert [f.code for f in gated] == ["BW008"] and "not judged" in gated[0].evidence["min_busbw_gbps"]


def test_no_bandwidth_table_is_printed_at_one_rank():
    console = Console(record=True, width=140)
    get_probe("allreduce").render_details(_facts(), console)
    text = console.export_text()
    assert "no link to measure" in text and "algbw" not in text and "209715" not in text.replace(",", "")
