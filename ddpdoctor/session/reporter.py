"""From what the run learned to the report: every probe's diagnosis on all ranks' facts, the
run's own diagnosis, and the files the report and the probes write.

The diagnose stage of the pipeline: it sits above the probes (it calls their `diagnose`) and
below the rank session and the launcher, which call it once the facts are in.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from ddpdoctor.core.report import ProbeSection, Report, write_json
from ddpdoctor.core.run_record import RunRecord
from ddpdoctor.judge.causal_order import link, ordered, verdict_line
from ddpdoctor.judge.run_diagnosis import diagnose_run, rank_fates
from ddpdoctor.probes import RunView, get_probe, with_context
from ddpdoctor.probes.base import diagnose_safely


def build_report(record: RunRecord, backend: str = "", device: str = "",
                 command: Optional[list[str]] = None) -> Report:
    view = with_context(RunView(world_size=record.world_size,
                                hosts={r: record.host(r) for r in record.hellos},
                                injected=record.faults, settings=record.settings), record.results)
    sections = []
    for name in record.probes:
        facts = record.results.get(name, {})
        findings = diagnose_safely(get_probe(name), facts, view)
        status = "ok" if len(facts) == record.world_size else ("incomplete" if facts else "not-run")
        sections.append(ProbeSection(name, status, findings, facts))
    # Each generic failure a specific cause explains is marked so (judge/causal_order.py).
    run_findings = diagnose_run(record)
    linked = iter(link(run_findings + [f for s in sections for f in s.findings]))
    run_findings = [next(linked) for _ in run_findings]
    for section in sections:
        section.findings = [next(linked) for _ in section.findings]
    every = run_findings + [f for s in sections for f in s.findings]
    return Report(record, run_findings, sections, backend, device, list(command or sys.argv),
                  fates=rank_fates(record), verdict_line=verdict_line(every), shown=ordered(every))


def _write_prom(doc: dict[str, Any], path: str) -> None:
    """--prom: a textfile the collector may be reading right now, so replaced whole, every run."""
    from ddpdoctor.render.prom import write_prom

    try:
        write_prom(doc, path)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"ddpdoctor: could not write --prom {path}: {type(exc).__name__}: {exc}\n")


def _write_trace(doc: dict[str, Any], path: str, overwrite: bool) -> None:
    """--trace: the ranks' stages, the measured steps and the findings as a timeline (render/trace_check.py)."""
    from ddpdoctor.core.files import atomic_write_json
    from ddpdoctor.render.trace_check import from_report

    try:
        atomic_write_json(from_report(doc).to_json(), path, overwrite=overwrite)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"ddpdoctor: could not write --trace {path}: {type(exc).__name__}: {exc}\n")


def _write_html(doc: dict[str, Any], cfg: Any, overwrite: bool) -> None:
    """--html: the report as one self-contained page (render/html_report.py)."""
    from ddpdoctor.render import html_report

    kind = "allreduce-bench" if getattr(cfg, "command", "check") == "allreduce-bench" else "check"
    try:
        html_report.write(cfg.html_path, kind, doc, overwrite=overwrite)
    except Exception as exc:  # the report itself is written already: one line, never a traceback
        sys.stderr.write(f"ddpdoctor: could not write --html {cfg.html_path}: {type(exc).__name__}: {exc}\n")


def write_outputs(report: Report, cfg: Any) -> None:
    """The report's JSON, then what the probes write besides (the bench's CSV and plot).

    A file that cannot be written costs one line on stderr, never the report itself.
    `cfg.force` (the CLI's --force) decides whether an existing file may be replaced; the
    CLI already refused existing files before any rank started, so without it a file found
    now appeared during the run, and the report goes to a free sibling name instead.
    """
    overwrite = bool(getattr(cfg, "force", False))
    wanted = [cfg.json_path, getattr(cfg, "prom_path", None), getattr(cfg, "trace_path", None),
              getattr(cfg, "html_path", None)]
    doc = report.to_json() if any(wanted) else {}  # once for every file made of it
    if cfg.json_path:
        write_json(report, cfg.json_path, overwrite=overwrite, doc=doc)
    if getattr(cfg, "prom_path", None):
        _write_prom(doc, cfg.prom_path)
    if getattr(cfg, "trace_path", None):
        _write_trace(doc, cfg.trace_path, overwrite=overwrite)
    if getattr(cfg, "html_path", None):
        _write_html(doc, cfg, overwrite=overwrite)
    for section in report.probes:
        extra = getattr(get_probe(section.name), "write_outputs", None)
        if extra is None or not section.facts:
            continue
        try:
            extra(section.facts, cfg)
        except Exception as exc:
            sys.stderr.write(f"ddpdoctor: could not write the {section.name} outputs: {type(exc).__name__}: {exc}\n")
