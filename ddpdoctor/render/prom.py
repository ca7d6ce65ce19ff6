"""A report as Prometheus metrics, for node_exporter's textfile collector (`--prom PATH`).

Fleets watch node health in Prometheus (Meta's GCM and Azure's NHC feed it); a prolog that runs
`ddpdoctor check --prom /var/lib/node_exporter/textfile/ddpdoctor.prom` puts the verdict, each
finding and the measured speeds next to the node's other metrics. The numbers are the ones the
history store keeps (history/record.py reads them from the report JSON), so a dashboard and
`ddpdoctor history` never disagree on what was measured.

prometheus_client builds the exposition text (its escaping and format are the collector's); the
file is written atomically (core/files: a nameless or hidden temp file in the same folder, then
renamed), so the collector never reads half a file, and a temp file never ends in `.prom`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddpdoctor.core.files import atomic_write_bytes
from ddpdoctor.core.findings import Severity
from ddpdoctor.history.record import from_report

SPEEDS = {"compute_speed": ("ddpdoctor_compute_speed", "Measured matmul speed of the rank's device (flop/s)"),
          "busbw_gbs": ("ddpdoctor_busbw_gbs", "All-reduce bus bandwidth at the largest size (GB/s), per node of the run")}
DEVICE_LABELS = ("node", "rank", "gpu", "model")


def exposition(report: Mapping[str, Any]) -> bytes:
    """The report (Report.to_json) in the Prometheus text format."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    rows = from_report(report)
    command = rows.run.command
    registry = CollectorRegistry()
    verdict = Gauge("ddpdoctor_verdict", "The run's verdict as its exit code: 0 ok, 1 warning, 2 critical, 3 unknown",
                    ["command"], registry=registry)
    verdict.labels(command).set(rows.run.exit_code)
    last = Gauge("ddpdoctor_last_run_timestamp_seconds", "When the run ended (unix seconds)", ["command"],
                 registry=registry)
    last.labels(command).set(float(report.get("started_at") or 0.0) + float(report.get("duration_s") or 0.0))
    found = Gauge("ddpdoctor_finding", "A finding of the run, one sample per rank (or node) it names: its "
                  "severity as a number (0 ok, 1 info, 2 warn, 3 critical)", ["code", "severity", "node", "rank"],
                  registry=registry)
    for f in rows.findings:
        found.labels(f.code, f.severity, f.node or "", "" if f.rank is None else str(f.rank)).set(
            int(Severity.parse(f.severity)))
    gauges = {metric: Gauge(name, text, list(DEVICE_LABELS), registry=registry) for metric, (name, text) in SPEEDS.items()}
    for m in rows.measurements:
        if m.metric in gauges:
            gauges[m.metric].labels(m.node, "" if m.rank is None else str(m.rank), m.gpu or "", m.model or "").set(m.value)
    return generate_latest(registry)


def write_prom(report: Mapping[str, Any], path: str) -> str:
    """Write the textfile (replacing the last run's: a prolog rewrites it every time); returns the path."""
    return atomic_write_bytes(exposition(report), path, overwrite=True)
