"""`check --prom --history` end to end: a real run's measured speeds and findings in node_exporter's
textfile format, read back with prometheus_client's own parser against the run's JSON report, and
the same run appended to a history store (the 20-run fleet scenario is the slow tier's)."""

from __future__ import annotations

import pytest

from ddpdoctor.history.store import read_history

from .harness import probe_section, run_check

pytestmark = pytest.mark.ranks
parser = pytest.importorskip("prometheus_client.parser")


def test_check_writes_a_textfile_that_holds_the_reports_values(tmp_path):
    prom = tmp_path / "ddpdoctor.prom"
    prom.write_text("# the last run's file: replaced, never refused\n")
    store = tmp_path / "history.db"
    run = run_check(tmp_path, "--nproc", "2", "--probes", "homogeneity", "--prom", str(prom), "--history", str(store))
    assert run.returncode == 0, run.explain()
    samples = {f.name: f.samples for f in parser.text_string_to_metric_families(prom.read_text())}
    assert samples["ddpdoctor_verdict"][0].value == 0 and samples["ddpdoctor_verdict"][0].labels == {"command": "check"}
    facts = probe_section(run.report, "homogeneity")["facts"]
    speeds = {s.labels["rank"]: s for s in samples["ddpdoctor_compute_speed"]}
    assert sorted(speeds) == ["0", "1"]
    for rank, sample in speeds.items():
        assert sample.labels["node"] == run.report["ranks"][int(rank)]["host"]
        assert sample.value == max(facts[rank]["measured"]["matmul"]["round_flops_per_s"]) > 1e8
    assert {(s.labels["code"], s.labels["rank"]) for s in samples["ddpdoctor_finding"]} == {("HOM000", "0"),
                                                                                            ("HOM000", "1")}
    history = read_history(str(store))
    assert [(r.command, r.verdict, r.world_size) for r in history.runs] == [("check", "ok", 2)]
    stored = {m.rank: m.value for m in history.measurements if m.metric == "compute_speed"}
    assert stored == {int(rank): sample.value for rank, sample in speeds.items()}
