"""Files out of `ddpdoctor allreduce-bench`: a CSV of every size and a busbw-vs-size plot.

The plot is hand-written SVG so the tool needs nothing beyond its own dependencies on a
cluster node where pip may be off-limits; PNG is offered only when matplotlib happens
to be installed already.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Sequence
from xml.sax.saxutils import escape

from ddpdoctor.judge.busbw import SizeResult, format_size, series
from ddpdoctor.core.errors import UsageError

CSV_HEADER = ("op", "size_bytes", "count", "dtype", "in_place", "median_us", "p95_us", "min_us",
              "algbw_gbps", "busbw_gbps", "wrong")

PLOT_SUFFIXES = (".svg", ".png")

# Colour-blind-safe (Okabe-Ito), in the order series() yields curves.
_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")

_WIDTH, _HEIGHT = 820, 480
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 220, 44, 62
_MAX_X_TICKS = 14
_X_STRIDES = (1, 2, 5, 10, 20)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3f}"


def _gbps(value: float) -> str:
    return f"{value:.4f}"


def to_csv(results: Sequence[SizeResult]) -> str:
    """One row per result, in the order given, with fixed decimals.

    Fixed decimals (µs to the nanosecond, GB/s to 4 places) rather than repr(): two runs
    of the same numbers give byte-identical files, so they diff cleanly.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for r in results:
        writer.writerow([
            r.op, r.size_bytes, r.count, r.dtype, "true" if r.in_place else "false",
            _us(r.median_s), _us(r.p95_s), _us(r.min_s),
            _gbps(r.algbw_gbps), _gbps(r.busbw_gbps), "" if r.wrong is None else r.wrong,
        ])
    return buffer.getvalue()


def _series_label(op: str, in_place: bool) -> str:
    return f"{op} ({'in-place' if in_place else 'out-of-place'})"


def _nice_step(span: float, ticks: int = 5) -> float:
    """1, 2 or 5 × 10^k: tick labels a reader can add up at a glance."""
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 5, 10):
        if raw <= multiple * magnitude:
            return multiple * magnitude
    return 10 * magnitude


def _x_ticks(low: int, high: int) -> list[int]:
    """Exponents of the powers of two to label, thinned so the labels never overlap.

    Kept to multiples of the stride (1, 2, 5, 10, ...) so a wide sweep still lands on
    round sizes: stride 2 labels 1K, 4K, ... 1M ... 256M; stride 10 labels 1K, 1M, 1G.
    """
    for stride in _X_STRIDES:
        first = -(-low // stride) * stride
        ticks = list(range(first, high + 1, stride))
        if len(ticks) <= _MAX_X_TICKS:
            return ticks
    return [low, high]


def _x_range(sizes: Sequence[int]) -> tuple[int, int]:
    """Whole powers of two around the sizes, at least one apart so a one-size sweep still has an axis."""
    low = math.floor(math.log2(min(sizes)))
    return low, max(math.ceil(math.log2(max(sizes))), low + 1)


def _num(value: float) -> str:
    return f"{value:.2f}"


def to_svg(results: Sequence[SizeResult], title: str) -> str:
    """busbw (GB/s) against size on a log2 axis, one line per (op, in_place).

    busbw, not algbw, because it is the figure that can be held against the links' peak
    whatever the world size; log2 because the sweep doubles (or quadruples) the size.
    """
    grouped = series(results)
    if not grouped:
        raise ValueError("nothing to plot: no results")
    sizes = [r.size_bytes for group in grouped.values() for r in group]
    x_low, x_high = _x_range(sizes)
    y_peak = max(r.busbw_gbps for group in grouped.values() for r in group)
    y_step = _nice_step(y_peak) if y_peak > 0 else 0.2
    y_high = max(1, math.ceil(y_peak / y_step)) * y_step

    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM

    def px(size: int) -> float:
        return _LEFT + (math.log2(size) - x_low) / (x_high - x_low) * plot_w

    def py(gbps: float) -> float:
        return _TOP + plot_h - gbps / y_high * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
        f'<text x="{_WIDTH / 2:.0f}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>',
    ]
    for k in _x_ticks(x_low, x_high):
        x = _num(px(2**k))
        out.append(f'<line x1="{x}" y1="{_TOP}" x2="{x}" y2="{_TOP + plot_h}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x}" y="{_TOP + plot_h + 16}" text-anchor="middle">{format_size(2**k)}</text>')
    tick_count = round(y_high / y_step)
    for i in range(tick_count + 1):
        value = i * y_step
        y = _num(py(value))
        out.append(f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + plot_w}" y2="{y}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y}" text-anchor="end" dominant-baseline="middle">'
                   f'{round(value, 10):g}</text>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_HEIGHT - 18}" text-anchor="middle">'
               f'message size (bytes, log2 scale)</text>')
    out.append(f'<text x="18" y="{_TOP + plot_h / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {_TOP + plot_h / 2:.0f})">busbw (GB/s)</text>')

    for index, ((op, in_place), group) in enumerate(grouped.items()):
        colour = _COLOURS[index % len(_COLOURS)]
        dash = ' stroke-dasharray="6 3"' if in_place else ""
        points = " ".join(f"{_num(px(r.size_bytes))},{_num(py(r.busbw_gbps))}" for r in group)
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for r in group:
            out.append(f'<circle cx="{_num(px(r.size_bytes))}" cy="{_num(py(r.busbw_gbps))}" r="2.5" '
                       f'fill="{colour}"><title>{escape(op)} {format_size(r.size_bytes)}: '
                       f'{r.busbw_gbps:.2f} GB/s</title></circle>')
        legend_y = _TOP + 10 + 20 * index
        legend_x = _LEFT + plot_w + 14
        out.append(f'<line x1="{legend_x}" y1="{legend_y}" x2="{legend_x + 24}" y2="{legend_y}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{legend_x + 30}" y="{legend_y}" dominant-baseline="middle">'
                   f'{escape(_series_label(op, in_place))}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png_bytes(results: Sequence[SizeResult], title: str, path: str) -> bytes:
    """The same plot through matplotlib, which is never a dependency: only used if present."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"--plot {path} needs matplotlib (pip install matplotlib), or give a .svg path") from None
    grouped = series(results)
    if not grouped:
        raise ValueError("nothing to plot: no results")
    # Figure + Agg canvas, not pyplot: no global backend switch inside the caller's process.
    figure = Figure(figsize=(8.2, 4.8), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for (op, in_place), group in grouped.items():
        axes.plot([r.size_bytes for r in group], [r.busbw_gbps for r in group], marker="o", markersize=3,
                  linestyle="--" if in_place else "-", label=_series_label(op, in_place))
    axes.set_xscale("log", base=2)
    ticks = _x_ticks(*_x_range([r.size_bytes for group in grouped.values() for r in group]))
    axes.set_xticks([2**k for k in ticks])
    axes.set_xticklabels([format_size(2**k) for k in ticks])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("message size (bytes, log2 scale)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title)
    axes.grid(True, color="#e4e4e4")
    axes.legend(loc="upper left", fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _atomic_write(data: bytes, path: str, overwrite: bool) -> str:
    from ddpdoctor.core.files import atomic_write_bytes

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--plot {path}: folder {directory} does not exist; create it or give another path")
    return atomic_write_bytes(data, path, overwrite=overwrite)


def write_plot(results: Sequence[SizeResult], path: str, title: str, *, overwrite: bool = True) -> str:
    """Write the busbw plot; the suffix picks the format (.svg always works, .png needs matplotlib).

    The format is checked before anything is drawn, so a typo costs nothing. With
    `overwrite=False` (no --force) an existing file is kept and the plot goes to a sibling
    name: the CLI refused existing files before the sweep, so such a file appeared during
    it. The default replaces, for callers that do not pass the run's --force yet.
    Returns the path written.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".svg":
        data = to_svg(results, title).encode("utf-8")
    elif suffix == ".png":
        data = _png_bytes(results, title, path)
    else:
        raise UsageError(
            f"--plot {path}: unknown plot format {suffix or '(no suffix)'}; give a path ending in "
            f"{' or '.join(PLOT_SUFFIXES)}"
        )
    return _atomic_write(data, path, overwrite)
