"""The report page's charts (render/html_report.py): busbw against message size from an allreduce probe's facts,
each rank's median step by phase from the stragglers probe or the callback's summary, and the timeline
(render/html_timeline.py); each only where its data is, and one that fails says so instead of failing the page."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Sequence

from ddpdoctor.render.html_parts import BAR_CLASSES, MAX_ROWS, Chart, figures_table, findings_of, layout, plot_text
from ddpdoctor.render.html_timeline import timeline_chart
from ddpdoctor.render.step_phases import from_stragglers, from_summary
from ddpdoctor.render.trace_check import probe_facts

def _probe_facts(sources: Iterable[Mapping[str, Any]], name: str) -> tuple[dict[str, Any], Optional[Mapping[str, Any]]]:
    """The first source's facts of probe `name` (rank -> facts), and the source they came from."""
    for source in sources:
        facts = probe_facts(source, name)
        if facts:
            return facts, source
    return {}, None


def charts(data: Mapping[str, Any], reports: Sequence[Mapping[str, Any]],
            timeline: Optional[Mapping[str, Any]], go: Any) -> list[Chart]:
    """Each chart its data allows. A chart is an extra: one that fails says so and the page is written all the
    same (the findings are what the reader came for)."""
    sources = [data, *reports]
    builders = [("busbw", lambda: _busbw_chart(sources, data, go)), ("steps", lambda: _steps_chart(sources, data, go))]
    if timeline is not None:
        builders.append(("timeline", lambda: timeline_chart(timeline, go)))
    charts = []
    for key, build in builders:
        try:
            chart = build()
        except Exception as exc:  # a malformed document or a plotly version we never met
            chart = Chart(key, f"{key} chart", note=f"not drawn: {type(exc).__name__}: {exc}")
        if chart is not None:
            charts.append(chart)
    return charts


def _expected_busbw(sources: Iterable[Mapping[str, Any]]) -> Optional[float]:
    """What the topology or the GPUs' model allows (GB/s), as the allreduce verdict's evidence says: the
    figure the verdict was judged by, not worked out again."""
    for source in sources:
        for f in findings_of(source):
            value = (f.get("evidence") or {}).get("expected_busbw_gbps") if f.get("probe") == "allreduce" else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return float(value)
    return None


def _busbw_chart(sources: Sequence[Mapping[str, Any]], data: Mapping[str, Any], go: Any) -> Optional[Chart]:
    """busbw (GB/s) against message size, log x, one line per placement, the expected busbw dashed. The sums are
    the bench's own (probes/allreduce: merge_results, judge/busbw.py): slowest rank per iteration, median."""
    from ddpdoctor.judge.busbw import format_size, series
    from ddpdoctor.probes.allreduce.probe import merge_results

    facts, source = _probe_facts(sources, "allreduce")
    if not facts or source is None:
        return None
    try:
        results = merge_results(facts)
    except (KeyError, ValueError, TypeError, IndexError):
        return Chart("busbw", "all-reduce bandwidth", note="the allreduce facts could not be read")
    if not results:
        return None
    first = results[0]
    title = f"{first.op} busbw (GB/s) by message size, {first.world_size} ranks, {first.dtype}"
    table = figures_table(["size", "placement", "median time (µs)", "algbw (GB/s)", "busbw (GB/s)", "wrong"],
                   [[format_size(r.size_bytes), "in-place" if r.in_place else "out-of-place", f"{r.median_s * 1e6:.1f}",
                     f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}", "" if r.wrong is None else r.wrong] for r in results])
    chart = Chart("busbw", title, table=table)
    if first.world_size < 2:
        chart.note = ("not drawn: on 1 rank busbw is 0 by definition (nothing crosses a link); "
                      "the figures are below")
        return chart
    if go is None:
        return chart
    expected = _expected_busbw([data, source])
    figure = go.Figure(layout=layout(go, 440))
    curves = series(results)
    for (_, in_place), group in curves.items():
        name = "job" if len(curves) == 1 else ("in-place" if in_place else "out-of-place")
        figure.add_trace(go.Scatter(
            x=[r.size_bytes for r in group], y=[r.busbw_gbps for r in group], mode="lines+markers", name=plot_text(name),
            hovertext=[plot_text(f"{format_size(r.size_bytes)}: busbw {r.busbw_gbps:.3f} GB/s, algbw {r.algbw_gbps:.3f} GB/s, "
                         f"median {r.median_s * 1e6:.1f} µs") for r in group],
            hovertemplate="%{hovertext}<extra></extra>"))
    sizes = sorted({r.size_bytes for r in results})
    if expected:
        figure.add_trace(go.Scatter(x=[sizes[0], sizes[-1]], y=[expected, expected], mode="lines",
                                    name=plot_text(f"expected {expected:.3g} GB/s"), line={"dash": "dash", "color": "#444"},
                                    hoverinfo="name"))
    ticks = [2 ** k for k in range(int(math.log2(sizes[0])), int(math.log2(sizes[-1])) + 1)]
    stride = max(1, math.ceil(len(ticks) / 10))
    ticks = ticks[::stride]
    figure.update_xaxes(type="log", title_text="message size (log scale)", tickvals=ticks,
                        ticktext=[format_size(t) for t in ticks])
    figure.update_yaxes(title_text="busbw (GB/s)", rangemode="tozero")
    chart.figure, chart.height = figure, 440
    return chart


def _steps_chart(sources: Sequence[Mapping[str, Any]], data: Mapping[str, Any], go: Any) -> Optional[Chart]:
    """Each rank's step as a stacked horizontal bar: data, compute, waiting for peers. A straggler's compute
    stands out, and so does the wait its peers spend on it."""
    facts, _ = _probe_facts(sources, "stragglers")
    rows = from_stragglers(facts) if facts else []
    origin = "the stragglers probe's steps, median of each phase"
    summary = data.get("summary")
    if not rows and isinstance(summary, Mapping):
        rows, origin = from_summary(summary), "the end-of-run summary: median step cut by each phase's share"
    if not rows:
        return None
    title = f"step time by rank (ms): {origin}"
    table = figures_table(["rank", "node", "data (ms)", "compute (ms)", "wait for peers (ms)", "median step (ms)"],
                          [[r.rank, r.node, f"{r.data_ms:.3f}", f"{r.compute_ms:.3f}", f"{r.wait_ms:.3f}",
                            f"{r.step_ms:.3f}"] for r in rows])
    chart = Chart("steps", title, table=table)
    shown = rows
    if len(rows) > MAX_ROWS:
        shown = sorted(sorted(rows, key=lambda r: -(r.data_ms + r.compute_ms))[:MAX_ROWS], key=lambda r: r.rank)
        chart.note = (f"{MAX_ROWS} of {len(rows)} ranks drawn: those with the longest data + compute; "
                      "every rank is in the table")
    if go is None:
        return chart
    nodes = len({r.node for r in rows}) > 1
    labels = [f"rank {r.rank}" + (f" ({r.node})" if nodes else "") for r in shown]
    height = 110 + 28 * len(shown)
    figure = go.Figure(layout=layout(go, height, barmode="stack"))
    for name, key, colour in (("data", "data_ms", BAR_CLASSES["data"][1]), ("compute", "compute_ms", BAR_CLASSES["compute"][1]),
                              ("wait for peers", "wait_ms", BAR_CLASSES["wait"][1])):
        values = [getattr(r, key) for r in shown]
        figure.add_trace(go.Bar(y=[plot_text(x) for x in labels], x=values, orientation="h", name=plot_text(name),
                                marker_color=colour,
                                hovertext=[plot_text(f"{label}: {name} {v:.3f} ms") for label, v in zip(labels, values)],
                                hovertemplate="%{hovertext}<extra></extra>"))
    figure.update_yaxes(autorange="reversed", type="category")
    figure.update_xaxes(title_text="ms per step (median)", rangemode="tozero")
    chart.figure, chart.height = figure, height
    return chart
