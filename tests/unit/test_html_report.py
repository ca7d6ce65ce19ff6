"""The HTML report page (ddpdoctor/render/html_report.py), on real reports.

The inputs are real: ddpdoctor's own `check --probes all` and `allreduce-bench --nproc 2` on an H100
(tests/fixtures/gpu_runs), a CPU check whose rank 1 was frozen by SIGSTOP, one whose rank 1 was stopped from
outside (STR001) and a three-node bench with a throttled node (tests/fixtures/trace), `explain` of NCCL's real
"Duplicate GPU detected", and a Doctor's JSON as tests/ranks/doctor_loop.py --case straggler wrote it.

The page must stand alone (it is opened on air-gapped clusters and attached to tickets): no resource is
referenced, only inlined; the browser test loads it in headless Chromium and reads what the scripts built.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.core.timeline import Span, Timeline
from ddpdoctor.render import html_parts, html_report
from tests.page_parts import FIXTURES, block, load, outside_scripts

# The Doctor's JSON (callback/doctor.py `_write_json`) of `tests/ranks/doctor_loop.py --spawn 2 --case straggler
# --epochs 8`, recorded on the 2-core VM, 2026-11-29; its summary's ranks trimmed to the keys the page reads.
DOCTOR_JSON: dict[str, Any] = {
    "rank": 0, "world_size": 2, "steps": 64,
    "findings": [{"code": "DOC010", "severity": "info", "probe": "doctor", "ranks": [0, 1], "nodes": ["vm"],
                  "title": "Effective batch 64 (2 ranks x 32) at learning rate 0.01: tuned for one process's batch, "
                           "the linear rule gives 0.02 and the square-root rule 0.01414",
                  "evidence": {"world_size": 2, "batch_per_rank": 32, "lr": 0.01}, "why": "", "fix": ""}],
    "summary": {
        "verdict": "healthy: 64 steps on 2 ranks, no warning or critical finding", "severity": "ok", "code": None,
        "world_size": 2, "steps": 64, "wall_s": 0.68, "step_ms_median": 8.433, "samples_per_s": 6619.8,
        "lost_to_slowest": {"rank": 1, "ms_per_step": 6.025, "share_pct": 62.3, "seconds": 0.39, "straggler": False},
        "ranks": [
            {"rank": 0, "node": "vm", "steps": 64, "step_ms_median": 8.433, "step_ms_p90": 12.285, "data_pct": 4.7,
             "wait_pct": 79.6, "compute_pct": 15.7, "samples_per_s": 3211.9, "sampled_steps": 64, "arrived": True},
            {"rank": 1, "node": "vm", "steps": 64, "step_ms_median": 8.433, "step_ms_p90": 12.044, "data_pct": 4.5,
             "wait_pct": 14.2, "compute_pct": 81.3, "samples_per_s": 3407.9, "sampled_steps": 64, "arrived": True}],
        "findings": [], "more_findings": 0}}



@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """Each real input's page, made once for the module (plotly, where installed, is in each)."""
    return {
        "check": html_report.page("check", load("gpu_runs/h100x1_check_all.json")),
        "bench": html_report.page("allreduce-bench", load("gpu_runs/h100x1_bench2.json")),
        "frozen": html_report.page("check", load("trace/check_frozen_rank1.json")),
        "preempt": html_report.page("check", load("trace/check_preempt_rank1.json")),
        "nodes": html_report.page("allreduce-bench", load("trace/bench_tbf_node3.json")),
        "explain": html_report.page("explain", load("gpu_runs/h100x1_explain_samedevice.json")),
        "doctor": html_report.page("doctor", DOCTOR_JSON),
    }




# -- the order and the verdict -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["check", "bench", "frozen", "preempt", "nodes", "explain", "doctor"])
def test_the_verdict_comes_first_then_the_findings_the_charts_and_the_timeline(pages: dict[str, str], name: str) -> None:
    text = pages[name]
    places = [text.index(f'<section id="{section}"') for section in ("verdict", "findings", "charts", "timeline")]
    assert places == sorted(places)


@pytest.mark.parametrize("name, fixture", [("frozen", "trace/check_frozen_rank1.json"),
                                           ("preempt", "trace/check_preempt_rank1.json"),
                                           ("nodes", "trace/bench_tbf_node3.json")])
def test_the_verdict_is_the_reports_first_line_and_its_exit_code_said(pages: dict[str, str], name: str,
                                                                       fixture: str) -> None:
    report = load(fixture)
    verdict = pages[name][pages[name].index('<section id="verdict"'):pages[name].index('<section id="findings"')]
    assert html_report.e(report["verdict_line"]) in verdict
    assert f"exit code <b>{report['exit_code']}</b>: {html_report.EXIT_MEANINGS[report['exit_code']]}" in verdict


def test_an_old_report_without_a_first_line_gets_the_consoles_own() -> None:
    """h100x1_check_all.json predates `verdict_line`: judge/causal_order.py's line, not one of ours."""
    text = html_report.page("check", load("gpu_runs/h100x1_check_all.json"))
    verdict = text[text.index('<section id="verdict"'):text.index('<section id="findings"')]
    assert "healthy: no warning or critical finding" in verdict and "exit code <b>0</b>" in verdict


@pytest.mark.parametrize("name, fixture", [("check", "gpu_runs/h100x1_check_all.json"),
                                           ("frozen", "trace/check_frozen_rank1.json"),
                                           ("nodes", "trace/bench_tbf_node3.json"),
                                           ("explain", "gpu_runs/h100x1_explain_samedevice.json")])
def test_every_finding_is_on_the_page_with_its_fix_and_evidence(pages: dict[str, str], name: str, fixture: str) -> None:
    text = pages[name]
    findings = load(fixture)["findings"]
    for f in findings:
        assert f'data-code="{f["code"]}"' in text
        assert html_report.e(f["title"]) in text
        if f.get("fix"):
            assert html_report.e(f["fix"]) in text
    assert text.count('class="finding') == len(findings)
    first = text.index('<section id="findings"')
    place = {f["code"]: text.index(f'data-code="{f["code"]}"', first) for f in findings}
    order = ["critical", "warn", "info", "ok"]
    causes = sorted((f for f in findings if not f.get("explained_by")), key=lambda f: place[f["code"]])
    assert [order.index(f["severity"]) for f in causes] == sorted(order.index(f["severity"]) for f in causes)


def test_evidence_is_a_table_and_a_stack_is_preformatted() -> None:
    report = load("trace/check_frozen_rank1.json")
    report["findings"][0]["evidence"]["python_stack"] = ["  File \"train.py\", line 12, in step", "    loss.backward()",
                                                        "  File \"torch/autograd.py\", line 3", "    run()", "x"]
    text = html_report.page("check", report)
    assert "<th>reason</th><td>silent: no heartbeat for 5.1s</td>" in text
    assert "<pre>  File &quot;train.py&quot;, line 12, in step\n    loss.backward()" in text


def test_the_explanation_says_its_requeue_verdict_and_lists_the_logs_events(pages: dict[str, str]) -> None:
    text = pages["explain"]
    assert "requeue: no_retry" in text and "the exit code is 93" in text
    assert "samedevice.log:36" in text[text.index('<section id="timeline"'):]
    # GPU003 is the cause, RUN003 what it explains (judge/causal_order.py), as the console shows them.
    assert text.index('data-code="GPU003"') < text.index('data-code="RUN003"')
    assert "explained by GPU003" in text


def test_the_doctors_page_has_its_summary_verdict_and_the_ranks_steps(pages: dict[str, str]) -> None:
    text = pages["doctor"]
    assert "healthy: 64 steps on 2 ranks, no warning or critical finding" in text
    assert "no exit code: the callback leaves the job&#x27;s own" in text
    steps = block(text, "steps")
    # rank 1's median step cut by its shares: compute 81.3% of 8.433 ms
    assert f"{8.433 * 81.3 / 100:.3f}" in steps and f"{8.433 * 79.6 / 100:.3f}" in steps


def test_a_doctors_trace_file_is_drawn_with_its_hang(tmp_path: Path) -> None:
    """The Doctor's `trace_path` as core/timeline.py writes it: a hang is an open span, named "... (stuck)"."""
    timeline = Timeline(hosts={0: "vm", 1: "vm"}, ended_s=110.0)
    for rank in (0, 1):
        for i in range(10):
            timeline.spans.append(Span(rank, f"step {i}", 100 + i * 0.1, 100.08 + i * 0.1, "step", track="steps"))
    timeline.spans.append(Span(1, "all_reduce", 101.0, None, "hang", {"stack": "File \"x.py\", line 1\n  f()"}))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(timeline.to_json()))
    text = html_report.page("doctor", DOCTOR_JSON, html_report.read_timeline(str(path)))
    assert "all_reduce (stuck)" in text[text.index("Still running when the run ended"):]
    assert 'data-bars="21"' in text
    assert html_report.read_timeline(str(tmp_path / "missing.json")) is None


# -- self-contained and escaped ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["check", "bench", "frozen", "preempt", "nodes", "explain", "doctor"])
def test_the_page_references_nothing_outside_itself(pages: dict[str, str], name: str) -> None:
    text = pages[name]
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", text, re.IGNORECASE)
    outside = outside_scripts(text)
    assert "http://" not in outside and "https://" not in outside
    assert not re.search(r"<(link|iframe|object|embed|img)\b", outside, re.IGNORECASE)
    assert "@import" not in outside and "url(" not in outside
    # and what a script might still ask for, the browser refuses (checked live by the browser test)
    assert "default-src &#x27;none&#x27;" in text and "connect-src &#x27;none&#x27;" in text
    assert text.count("</script>") == len(re.findall(r"<script\b", text, re.IGNORECASE))


def test_plotly_is_inlined_once_for_the_whole_page(pages: dict[str, str]) -> None:
    plotly_offline = pytest.importorskip("plotly.offline", reason="the charts need plotly (pip install ddpdoctor[html])")
    signature = plotly_offline.get_plotlyjs()[:200]
    text = pages["preempt"]  # two charts: the steps and the timeline
    assert text.count('class="plotly-graph-div') == 2
    assert text.count(signature) == 1
    assert pages["explain"].count(signature) == 0  # nothing to draw: no library either


def test_markup_in_the_data_is_shown_as_text_never_run() -> None:
    report = load("trace/check_frozen_rank1.json")
    report["findings"][0]["title"] = "<script>alert(1)</script> stopped"
    report["findings"][0]["fix"] = 'Run "kill -CONT" </section><b>now</b>'
    report["findings"][0]["evidence"]["stage"] = "<img src=x onerror=alert(2)>"
    report["ranks"][1]["timeline"][-1]["name"] = "train</script><script>alert(3)</script>"
    report["ranks"][1]["host"] = "<i>vm</i>"
    text = html_report.page("check", report)
    assert "<script>alert(" not in text and "<img src=x" not in text and "<b>now</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; stopped" in text
    assert "&lt;img src=x onerror=alert(2)&gt;" in text
    assert "<i>vm</i>" not in text
    assert text.count("</script>") == len(re.findall(r"<script\b", text, re.IGNORECASE))


def test_secrets_are_redacted_as_in_every_json_file(tmp_path: Path) -> None:
    report = load("trace/check_frozen_rank1.json")
    report["findings"][0]["evidence"]["env"] = {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123"}
    report["command"] = ["ddpdoctor", "check", "--token", "sk-abcdefghijklmnopqrstuvwxyz012345"]
    path = tmp_path / "report.html"
    written = html_report.write(str(path), "check", report)
    text = Path(written).read_text()
    assert written == str(path)
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in text and "sk-abcdefghijklmnopqrstuvwxyz012345" not in text
    assert "&lt;redacted&gt;" in text


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        html_report.page("snapshot", {})


# -- the charts ----------------------------------------------------------------------------------------

def test_busbw_uses_the_benchs_own_sums_and_draws_the_expected_line() -> None:
    pytest.importorskip("plotly", reason="the charts need plotly (pip install ddpdoctor[html])")
    from ddpdoctor.probes.allreduce.probe import merge_results

    report = load("gpu_runs/h100x1_bench2.json")
    facts = next(p["facts"] for p in report["probes"] if p["name"] == "allreduce")
    results = merge_results(facts)
    text = html_report.page("allreduce-bench", report)
    busbw = block(text, "busbw")
    for r in results:  # the figures are nccl-tests' busbw of the slowest rank's median, as the bench prints
        assert f"<td>{r.busbw_gbps:.3f}</td>" in busbw
    assert '"type":"log"' in busbw and '"dash":"dash"' not in busbw
    bw000 = next(f for f in report["findings"] if f["code"] == "BW000")
    bw000["evidence"]["expected_busbw_gbps"] = 40.0
    busbw = block(html_report.page("allreduce-bench", report), "busbw")
    assert '"dash":"dash"' in busbw and "expected 40 GB" in busbw  # plotly's JSON escapes the "/"


def test_busbw_at_one_rank_is_not_drawn_and_says_why(pages: dict[str, str]) -> None:
    busbw = block(pages["check"], "busbw")
    assert "on 1 rank busbw is 0 by definition" in busbw and 'class="plotly-graph-div' not in busbw
    assert "<td>25M</td>" in busbw  # the figures stay, as a table


def test_the_step_chart_takes_each_ranks_median_phases_from_the_stragglers_probe(pages: dict[str, str]) -> None:
    from ddpdoctor.core.medians import median

    report = load("trace/check_preempt_rank1.json")
    facts = next(p["facts"] for p in report["probes"] if p["name"] == "stragglers")
    steps = block(pages["preempt"], "steps")
    for key, fact in facts.items():
        columns = fact["steps"]
        compute = [f + b + o for f, b, o in zip(columns["forward_ms"], columns["backward_ms"], columns["optimizer_ms"])]
        row = (f"<tr><td>{key}</td><td>vm</td><td>{median(columns['data_ms']):.3f}</td><td>{median(compute):.3f}</td>"
               f"<td>{median(columns['comm_wait_ms']):.3f}</td><td>{median(columns['step_ms']):.3f}</td></tr>")
        assert row in steps


def test_the_timeline_is_capped_keeping_the_latest_bars_and_every_stuck_one() -> None:
    timeline = Timeline(hosts={0: "a", 1: "b"}, ended_s=1000.0)
    for i in range(4000):
        timeline.spans.append(Span(i % 2, f"step {i}", 100 + i * 0.2, 100.1 + i * 0.2, "step"))
    timeline.spans.append(Span(1, "train", 100.0, None, "stage"))
    text = html_report.page("doctor", DOCTOR_JSON, timeline.to_json())
    drawn = block(text, "timeline")
    assert f'data-bars="{html_parts.MAX_BARS}"' in drawn
    assert f"the latest {html_parts.MAX_BARS - 1} of 4001 spans drawn, and every stuck one" in drawn
    assert "train (stuck)" in drawn
    if "Plotly.newPlot" in drawn:  # the bars' names are in the chart's data
        assert '"step 3999\\u003cbr' in drawn and '"step 1001\\u003cbr' in drawn and '"step 1000\\u003cbr' not in drawn


def test_without_plotly_the_page_keeps_the_findings_and_figures_and_says_what_charts_need(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")] + ["plotly"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import plotly...` now raises ImportError
    report = load("trace/check_preempt_rank1.json")
    text = html_report.page("check", report)
    assert text.count(html_report.NO_PLOTLY.replace("'", "&#x27;")) == 1
    assert "Plotly.newPlot" not in text and "plotly-graph-div" not in text
    assert len(text) < 300_000  # no library inlined
    for f in report["findings"]:
        assert f'data-code="{f["code"]}"' in text
    assert "<th>median step (ms)</th>" in block(text, "steps")  # the chart's figures, as a table
    places = [text.index(f'<section id="{section}"') for section in ("verdict", "findings", "charts", "timeline")]
    assert places == sorted(places)
    frozen = html_report.page("check", load("trace/check_frozen_rank1.json"))
    assert "train (stuck)" in frozen[frozen.index("Still running when the run ended"):]


def test_a_diagnosis_draws_the_charts_and_timeline_of_the_check_report_it_read() -> None:
    from ddpdoctor.snapshot import diagnose_inputs, read_inputs

    path = FIXTURES / "trace/check_preempt_rank1.json"
    diagnosis = diagnose_inputs(read_inputs([str(path)])).to_json()
    text = html_report.page("diagnose", diagnosis, reports=[load("trace/check_preempt_rank1.json")])
    for f in diagnosis["findings"]:
        assert f'data-code="{f["code"]}"' in text
    assert 'id="block-steps"' in text and 'id="block-timeline"' in text


def test_diagnose_and_explain_write_their_page_from_the_command_line(tmp_path: Path, capsys) -> None:
    from ddpdoctor import cli

    page = tmp_path / "d.html"
    cli.main(["diagnose", str(FIXTURES / "trace/check_preempt_rank1.json"), "--html", str(page)])
    text = page.read_text()
    assert text.index('id="verdict"') < text.index('data-code="STR001"') < text.index('id="block-timeline"')
    page = tmp_path / "e.html"
    cli.main(["explain", str(FIXTURES / "explain/real/hang_rank1_timeout.log"), "--html", str(page)])
    text = page.read_text()
    assert text.index('id="verdict"') < text.index('data-code="RUN004"')
    capsys.readouterr()
    assert cli.main(["explain", str(FIXTURES / "explain/real/hang_rank1_timeout.log"), "--html", str(page)]) == 3
    assert "already exists" in capsys.readouterr().err  # an existing page is refused before anything is read
