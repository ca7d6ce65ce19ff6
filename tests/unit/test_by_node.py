"""Findings grouped by node: in the JSON (`by_node`) and as one line in the terminal."""

from __future__ import annotations

import io

from rich.console import Console

from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.probes import RunView
from ddpdoctor.render.console import render_report
from ddpdoctor.core.report import Report
from ddpdoctor.core.run_record import ExitInfo, RunRecord


def _report(findings: list[Finding]) -> Report:
    record = RunRecord(world_size=4, mode="torchrun", probes=(), started=100.0, ended=110.0)
    record.hellos = {r: {"rank": r, "host": f"n{r // 2}", "local_rank": r % 2, "local_world_size": 2}
                     for r in range(4)}
    record.done = set(range(4))
    record.exits = {r: ExitInfo(0, t=109.0) for r in range(4)}
    return Report(record=record, run_findings=findings, probes=[], backend="gloo", device="cpu", command=[])


def _finding(code: str, severity: Severity, ranks: tuple[int, ...], nodes: tuple[str, ...] = ()) -> Finding:
    return Finding(code=code, severity=severity, probe="x", title=code, ranks=ranks, nodes=nodes)


def test_each_node_lists_the_findings_that_concern_it_worst_first():
    report = _report([_finding("HOM006", Severity.WARN, (2, 3), ("n1",)), _finding("RUN004", Severity.CRITICAL, (3,)),
                      _finding("INIT000", Severity.OK, (0, 1, 2, 3), ("n0", "n1")),
                      _finding("TOP009", Severity.INFO, (0, 1, 2, 3), ("n0", "n1"))])
    assert report.by_node() == [
        {"node_index": 0, "host": "n0", "ranks": "0-1", "worst_severity": "info", "findings": ["TOP009"]},
        {"node_index": 1, "host": "n1", "ranks": "2-3", "worst_severity": "critical",
         "findings": ["RUN004", "HOM006", "TOP009"]}]
    out = io.StringIO()
    render_report(report, Console(file=out, width=200, color_system=None))
    assert "by node:  n0 (ranks 0-1): TOP009; n1 (ranks 2-3): RUN004, HOM006, TOP009;" in out.getvalue()


def test_a_whole_node_is_recognised_only_when_it_is_every_rank_of_it():
    run = RunView(world_size=6, hosts={r: f"n{r // 2}" for r in range(6)})
    assert run.whole_nodes([2, 3]) == ("n1",) and run.whole_nodes([2, 3, 4, 5]) == ("n1", "n2")
    assert run.whole_nodes([2]) == () and run.whole_nodes([1, 2]) == () and run.whole_nodes(range(6)) == ()


def test_a_node_none_of_whose_ranks_arrived_has_its_own_entry():
    report = _report([_finding("RUN001", Severity.CRITICAL, (4, 5), ("n2",))])
    report.record.world_size = 6
    assert report.by_node()[-1] == {"node_index": 2, "host": "n2", "ranks": "4-5", "worst_severity": "critical",
                                    "findings": ["RUN001"]}
