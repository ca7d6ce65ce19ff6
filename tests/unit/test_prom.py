"""render/prom.py: a recorded report as node_exporter textfile metrics, read back with
prometheus_client's own parser."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpdoctor.render.prom import write_prom

parser = pytest.importorskip("prometheus_client.parser")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "allreduce" / "bench-2rank-gloo.json"


def _samples(path: str) -> dict[str, list]:
    families = parser.text_string_to_metric_families(Path(path).read_text())
    return {family.name: family.samples for family in families}


def test_a_recorded_report_parses_and_holds_its_values(tmp_path):
    report = json.loads(FIXTURE.read_text())
    target = str(tmp_path / "ddpdoctor.prom")
    assert write_prom(report, target) == target
    samples = _samples(target)
    (verdict,) = samples["ddpdoctor_verdict"]
    assert verdict.labels == {"command": "allreduce-bench"} and verdict.value == report["exit_code"]
    (last,) = samples["ddpdoctor_last_run_timestamp_seconds"]
    assert last.value == pytest.approx(report["started_at"] + report["duration_s"])
    found = {(s.labels["code"], s.labels["rank"]): s for s in samples["ddpdoctor_finding"]}
    assert set(found) == {(f["code"], str(r)) for f in report["findings"] for r in f["ranks"]}
    assert found[("TOP009", "1")].labels["severity"] == "info" and found[("TOP009", "1")].value == 1
    assert found[("BW000", "0")].labels["node"] == "vm"
    (busbw,) = samples["ddpdoctor_busbw_gbs"]
    bw000 = next(f for f in report["findings"] if f["code"] == "BW000")
    assert busbw.labels["node"] == "vm"
    assert busbw.value == pytest.approx(bw000["evidence"]["busbw_at_largest_gbps"], abs=0.0005)


def test_the_file_is_replaced_whole_and_no_temp_file_is_left(tmp_path):
    report = json.loads(FIXTURE.read_text())
    target = tmp_path / "ddpdoctor.prom"
    target.write_text("stale\n")
    report["exit_code"] = 2
    write_prom(report, str(target))
    assert _samples(str(target))["ddpdoctor_verdict"][0].value == 2
    assert os.listdir(tmp_path) == ["ddpdoctor.prom"]
