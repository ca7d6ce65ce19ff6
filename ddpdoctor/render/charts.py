"""Charts in the terminal: the bandwidth sweep, the ranks' step phases, the nodes' speed over their runs.

Why charts beside the tables: a table gives the figures, a chart the shape. Bandwidth that levels off
far under the expected line, one rank's bar longer than the others', a node's speed that falls away
from the fleet's: each is read at a glance where nine rows of numbers must be read one by one.

plotext draws them (a kept library, nothing of our own that draws), each on a private figure: the
end-of-run summary prints inside the user's training process, whose own plotext figure is not ours
to clear, and a private figure is not limited to the size of whatever terminal the process has.

The functions that draw are pure: each takes the facts, the summary rows or the verdicts (as the
JSON has them) and a width, and returns the chart as text, "" when there is nothing to draw (one
size, one rank, no node named), so they are tested without a terminal. `show` prints one on a rich
console only when that console is a real terminal: a pipe, a log, a file and the JSON never get one.
"""

from __future__ import annotations

import datetime
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from ddpdoctor.core.findings import Finding
    from ddpdoctor.history.verdicts import NodeSummary, Verdicts

log = logging.getLogger(__name__)

MAX_WIDTH = 120  # wider terminals get this: a chart's shape reads no better across 200 columns
MIN_WIDTH = 40  # narrower, the axes' labels leave no room to draw in: no chart
BUSBW_HEIGHT = 20
HISTORY_HEIGHT = 16
POINTS_SHOWN = 6  # links and nodes of a localised sweep, each a point of its own
NODES_CHARTED = 4  # `ddpdoctor history`: the nodes a verdict names, at most
# Line and point markers, one per series in turn, so series stay apart where there is no colour.
_CURVES = ("hd", "braille")
_POINTS = ("●", "◆", "▲", "■", "○", "◇")
_PHASES = (("data", "data_pct", "▒"), ("compute", "compute_pct", "█"), ("wait", "wait_pct", "░"))
_NODE_MARKERS = ("•", "+", "x", "o")
_FLEET = "·"
_KIB = 1024


# -- printing ------------------------------------------------------------------------------------------

def wanted(console: Console) -> bool:
    """A chart only where a person looks: a terminal (rich's judgement: FORCE_COLOR and TTY_COMPATIBLE=1
    say yes, TTY_COMPATIBLE=0 says no), and not a dumb one, which may not draw the block characters."""
    return console.is_terminal and not console.is_dumb_terminal


def show(console: Console, draw: Callable[[int, bool], str], enabled: bool = True) -> bool:
    """Print the chart `draw(width, color)` returns, where `wanted`; True when one was printed.

    A chart is an extra: if plotext is missing or fails, the report is printed all the same, without it."""
    if not enabled or not wanted(console) or console.width < MIN_WIDTH:
        return False
    color = console.color_system is not None and not console.no_color
    try:
        chart = draw(min(console.width, MAX_WIDTH), color)
    except Exception:
        log.debug("ddpdoctor: a chart could not be drawn", exc_info=True)
        return False
    if not chart:
        return False
    console.print(Text.from_ansi(chart) if color else Text(chart), no_wrap=True, crop=True)
    return True


def _figure(width: int, height: int) -> Any:
    """A private plotext figure of exactly width x height cells, colours only in the signals."""
    import plotext

    terminal = type(plotext.terminal)()  # not the module's shared figure: see the module's docstring
    terminal.limit(False, False)  # our width, not the one shutil finds (80 in a pipe, the test's)
    figure = terminal._master
    figure.plot_size(width, height)
    figure.theme("simple")  # no colour on the frame and text; each signal its own colour
    return figure


def _text(figure: Any, color: bool) -> str:
    text: str = figure.build().string(colorless=not color)
    if not color:
        text = "\n".join(line.rstrip() for line in text.splitlines())
    return text.rstrip("\n")


# -- allreduce-bench: busbw against message size ------------------------------------------------------

def size_label(size: int) -> str:
    """1 KiB, 64 KiB, 25 MiB, 1 GiB: the unit nccl-tests' users read sizes in."""
    for unit, scale in (("GiB", _KIB ** 3), ("MiB", _KIB ** 2), ("KiB", _KIB)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def _size_ticks(low: float, high: float, room: int) -> list[int]:
    """Powers of two to label on a log2 axis, thinned to `room` labels, on round sizes (1K, 1M, 1G first)."""
    first, last = math.floor(low), math.ceil(high)
    for stride in (1, 2, 5, 10, 20):
        ticks = [k for k in range(first, last + 1) if k % stride == 0 and low - 0.5 <= k <= high + 0.5]
        if len(ticks) <= room:
            return ticks or [first]
    return [first, last]


def expected_busbw(findings: Iterable[Finding]) -> Optional[float]:
    """What the topology or the GPUs' model allows, GB/s, as the allreduce verdict's evidence says (None: not
    modelled). From the findings, not worked out again: the chart shows the figure the verdict was judged by."""
    for f in findings:
        value = f.evidence.get("expected_busbw_gbps") if f.probe == "allreduce" else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _link_points(facts: Mapping[Any, Any]) -> list[tuple[str, int, float]]:
    """(label, size, GB/s) for what a localising run timed link by link: node pairs and each node's own ranks
    (across nodes), and the rank ring's pairs; each kind's slowest and its fastest, POINTS_SHOWN in all."""
    from ddpdoctor.core.facts import facts_by_rank
    from ddpdoctor.probes.allreduce.facts import AllReduceFacts
    from ddpdoctor.probes.allreduce.localise import (
        intra_node_busbw, leader_pair_busbw, node_pair_busbw, ring_pair_busbw)

    typed = facts_by_rank(AllReduceFacts, facts)
    parts = {r: f.pairs for r, f in typed.items() if f.pairs is not None}
    ring, ring_size = ring_pair_busbw(parts) if parts else ({}, 0)
    kinds: list[list[tuple[str, int, float]]] = []
    nodes = next((f.nodes for f in typed.values() if f.nodes is not None and f.nodes.node_of_rank), None)
    if nodes is not None:
        hosts, size = nodes.node_of_rank, int(nodes.size_bytes)
        leaders = leader_pair_busbw({r: f.nodes for r, f in typed.items() if f.nodes is not None})
        pairs = node_pair_busbw([leaders, ring], hosts)
        kinds.append([(f"nodes {a}-{b}", size, v) for (a, b), v in pairs.items()])
        kinds.append([(f"inside {h}", size, v) for h, v in intra_node_busbw(typed, hosts, size).items()])
    kinds.append([(f"ranks {a}-{b}", ring_size, v) for (a, b), v in ring.items()])
    kinds = [[p for p in k if p[1] > 0] for k in kinds]  # a size of 0: facts that do not say, no place on the axis
    kinds = [k for k in kinds if k]
    if not kinds:
        return []
    room = max(2, POINTS_SHOWN // len(kinds))
    out: list[tuple[str, int, float]] = []
    for kind in kinds:
        ordered = sorted(kind, key=lambda p: p[2])
        out += ordered if len(ordered) <= room else ordered[: room - 1] + ordered[-1:]
    return out[:POINTS_SHOWN]


def busbw_chart(facts: Mapping[Any, Any], width: int, *, expected_gbps: Optional[float] = None,
                color: bool = False, height: int = BUSBW_HEIGHT) -> str:
    """busbw (GB/s) against message size on a log axis: a line for the whole job (one per placement measured),
    a point for each link or node a localising run timed, and the expected busbw as a horizontal line.
    "" below 2 sizes or at one rank (whose busbw is 0: no link was crossed, BW008)."""
    from ddpdoctor.judge.busbw import series
    from ddpdoctor.probes.allreduce.probe import merge_results

    if not facts:
        return ""
    results = merge_results(facts)
    if len({r.size_bytes for r in results}) < 2 or results[0].world_size < 2:
        return ""
    curves = series(results)
    points = _link_points(facts)
    figure = _figure(width, height)
    for i, ((_, in_place), group) in enumerate(curves.items()):
        label = "job" if len(curves) == 1 else f"job, {'in-place' if in_place else 'out-of-place'}"
        line = figure.signal([math.log2(r.size_bytes) for r in group], [r.busbw_gbps for r in group],
                             marker=_CURVES[i % len(_CURVES)])
        figure.draw(line.lines().label(label))
    for i, (label, size, gbps) in enumerate(points):
        point = figure.signal([math.log2(size)], [gbps], marker=_POINTS[i % len(_POINTS)])
        figure.draw(point.label(f"{label} ({size_label(size)})"))
    if expected_gbps:
        figure.line(expected_gbps, label=f"expected {expected_gbps:.3g} GB/s")
    sizes = [r.size_bytes for r in results] + [size for _, size, _ in points]
    low, high = math.log2(min(sizes)), math.log2(max(sizes))
    ticks = _size_ticks(low, high, max(2, (width - 8) // 10))
    figure.ruler("x").lim(min(low, ticks[0]), max(high, ticks[-1]))
    figure.ruler("x").ticks(ticks, [size_label(2 ** k) for k in ticks])
    top = max([r.busbw_gbps for r in results] + [gbps for _, _, gbps in points] + [expected_gbps or 0.0])
    figure.ruler("y").lim(0, top * 1.08 if top > 0 else 1.0)
    first = results[0]
    figure.title(f"{first.op} busbw (GB/s), {first.world_size} ranks, {first.dtype}")
    figure.label("message size (log scale)", "x")
    return _text(figure, color)


# -- the end-of-run summary: each rank's step by phase ------------------------------------------------

def _nice_ticks(top: float, room: int) -> list[float]:
    """0 and steps of 1, 2 or 5 x 10^k up to `top`: tick labels a reader adds up at a glance."""
    if top <= 0:
        return [0.0]
    magnitude = 10 ** math.floor(math.log10(top / max(1, room)))
    step = next(m * magnitude for m in (1, 2, 5, 10, 20, 50) if top / (m * magnitude) <= max(1, room))
    return [i * step for i in range(int(top / step) + 1)]


def step_phases_chart(ranks: Sequence[Mapping[str, Any]], width: int, *, color: bool = False) -> str:
    """Each rank's median step (ms) as a bar, cut into data, compute and wait by their shares of its time:
    a straggler's compute stands out, and so does the wait its peers spend on it. `ranks`: the summary's
    rows the table shows. "" with fewer than two ranks that have timings."""
    rows = [r for r in ranks if r.get("arrived", True) and r.get("step_ms_median") is not None
            and all(r.get(key) is not None for _, key, _ in _PHASES)]
    if len(rows) < 2:
        return ""
    rows = sorted(rows, key=lambda r: -int(r["rank"]))  # plotext stacks from the bottom: rank 0 on top
    figure = _figure(width, 4 + 2 * len(rows))  # title, frame, ticks, and two rows a rank: its bar and a gap
    low = [0.0] * len(rows)
    for _, key, marker in _PHASES:
        high = [lo + float(r["step_ms_median"]) * float(r[key]) / 100.0 for lo, r in zip(low, rows)]
        figure.draw(figure.bar([f"rank {r['rank']}" for r in rows], low, high, orientation="h", marker=marker,
                               width=0.4))
        low = high
    # A rank is 2 rows: with its centre half a row off a row's edge, its 0.4-wide bar fills exactly one row.
    figure.ruler("y").lim(0.75, len(rows) + 0.75)
    figure.ruler("y").alignment(lim="edge")
    top = max(low)
    ticks = _nice_ticks(top, max(2, (width - 10) // 10))
    figure.ruler("x").lim(0, max(top, ticks[-1]) * 1.02)
    figure.ruler("x").ticks(ticks, [f"{t:g}" for t in ticks])
    figure.title("median step (ms) by phase:   " + "   ".join(f"{marker} {name}" for name, _, marker in _PHASES))
    return _text(figure, color)


def stragglers_rows(facts: Mapping[Any, Any]) -> list[dict[str, Any]]:
    """The stragglers probe's facts as the rows `step_phases_chart` draws: each rank's median step, and each
    phase's share of it by the phases' medians (render/step_phases.py: the page reads them alike)."""
    from ddpdoctor.render.step_phases import from_stragglers

    return [{"rank": r.rank, "step_ms_median": r.step_ms, **r.shares_pct()}
            for r in from_stragglers(facts) if r.shares_pct()]


# -- `ddpdoctor history`: a named node's speed over its runs ------------------------------------------

def charted_nodes(verdicts: Verdicts) -> list[NodeSummary]:
    """The nodes a drift (HIS001) or lemon (HIS002) verdict names, worst first, with 2 runs measured or more."""
    named = [s for s in verdicts.summaries if any(f.code in ("HIS001", "HIS002") for f in s.findings)]
    return [s for s in named if len(s.speed) >= 2][:NODES_CHARTED]


def _date_ticks(low: float, high: float, room: int) -> tuple[list[float], list[str]]:
    """Evenly spaced dates (UTC, as the verdicts' evidence writes them), with the hour when the runs span a day."""
    form = "%Y-%m-%d" if high - low >= 2 * 86400 else "%m-%d %H:%M"
    count = max(2, min(room, 6)) if high > low else 1
    positions = [low + (high - low) * i / max(1, count - 1) for i in range(count)]
    labels = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(form) for t in positions]
    return positions, labels


def history_chart(verdicts: Verdicts, width: int, *, color: bool = False, height: int = HISTORY_HEIGHT) -> str:
    """Each named node's measured compute speed at each of its runs, by date, and the fleet's median as the
    first of them was held against it: a drift is the line that leaves the fleet's. The key is in the title,
    not in a box that would hide the runs before the change. "" when no verdict names a node with 2 runs."""
    nodes = charted_nodes(verdicts)
    if not nodes:
        return ""
    peak = max(p.value for s in nodes for p in s.speed)
    scale, unit = (1e12, "TFLOP/s") if peak >= 1e12 else (1e9, "GFLOP/s")
    figure = _figure(width, height)
    fleet = [p for p in nodes[0].speed if p.fleet]
    if len(fleet) >= 2:  # first, so that the nodes' lines are drawn over it
        line = figure.signal([p.started_at for p in fleet], [float(p.fleet or 0.0) / scale for p in fleet],
                             marker=_FLEET)
        figure.draw(line.lines())
    for s, marker in zip(nodes, _NODE_MARKERS):
        line = figure.signal([p.started_at for p in s.speed], [p.value / scale for p in s.speed], marker=marker)
        figure.draw(line.lines())
    key = [f"{marker} {s.node}" for s, marker in zip(nodes, _NODE_MARKERS)]
    key += [f"{_FLEET} fleet median"] if len(fleet) >= 2 else []
    times = [p.started_at for s in nodes for p in s.speed]
    positions, labels = _date_ticks(min(times), max(times), max(2, (width - 10) // 14))
    figure.ruler("x").ticks(positions, labels)
    figure.title(f"compute speed ({unit}) by run:   " + "   ".join(key))
    figure.label("run date (UTC)", "x")
    return _text(figure, color)
