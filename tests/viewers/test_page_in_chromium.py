"""The report page (ddpdoctor/render/html_report.py) in a real browser: Debian's Chromium, headless, reading pages
made from real reports (tests/fixtures). What is asserted is what the browser built after the page's scripts ran
(its DOM, dumped) and what it drew (a screenshot's pixels), not our own string. .ci/run installs chromium.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from ddpdoctor.render import html_parts, html_report
from tests.page_parts import block, load, outside_scripts

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium's own connections are refused here and it stalls.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def png_pixels(path: Path) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes a pixel, rows of pixel bytes) of an 8-bit RGB(A) PNG, with zlib and struct only:
    enough to tell a drawn screenshot from a blank one without adding an image library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and not interlace, header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    low, high = int.from_bytes(b"\x7f" * stride, "big"), int.from_bytes(b"\x80" * stride, "big")
    rows, prior = [], bytes(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)]
        if kind == 0:
            out = bytes(line)
        elif kind == 2:  # Up, the commonest: a bytewise add without carries, on the row as one big integer
            a, b = int.from_bytes(line, "big"), int.from_bytes(prior, "big")
            out = (((a & low) + (b & low)) ^ ((a ^ b) & high)).to_bytes(stride, "big")
        else:  # Sub, Average, Paeth: byte by byte
            cur = bytearray(line)
            for x in range(stride):
                left = cur[x - bpp] if x >= bpp else 0
                up = prior[x]
                if kind == 1:
                    cur[x] = (cur[x] + left) & 255
                elif kind == 3:
                    cur[x] = (cur[x] + ((left + up) >> 1)) & 255
                else:
                    corner = prior[x - bpp] if x >= bpp else 0
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    cur[x] = (cur[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
            out = bytes(cur)
        rows.append(out)
        prior = out
    return width, height, bpp, rows


def _hex_rgb(colour: str) -> bytes:
    return bytes(int(colour[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM}: apt-get install chromium (Debian) to run it")
def test_the_pages_in_headless_chromium(tmp_path: Path) -> None:
    """Three real pages loaded from file:// at once: the DOM after plotly ran (one drawn svg per chart, a bar per
    timeline span, no JS error and no request blocked) and a screenshot whose stuck bars are really red."""
    pytest.importorskip("plotly", reason="the charts need plotly (pip install ddpdoctor[html])")
    began = time.monotonic()
    inputs = {"check": ("check", "gpu_runs/h100x1_check_all.json"),
              "bench": ("allreduce-bench", "gpu_runs/h100x1_bench2.json"),
              "frozen": ("check", "trace/check_frozen_rank1.json")}
    shot = tmp_path / "frozen.png"
    runs = {}
    for name, (kind, fixture) in inputs.items():
        page = tmp_path / f"{name}.html"
        html_report.write(str(page), kind, load(fixture))
        extra = [f"--screenshot={shot}", "--window-size=1280,2000"] if name == "frozen" else []
        profile = tmp_path / f"profile-{name}"
        profile.mkdir()
        runs[name] = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", *extra,
                                       page.as_uri()], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    doms = {}
    for name, run in runs.items():
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, f"chromium on the {name} page: exit {run.returncode}"
        doms[name] = outside_scripts(out)

    for name, dom in doms.items():
        errors = re.search(r'<div id="js-errors">(.*?)</div>\s*<header', dom, re.DOTALL)
        assert errors is not None and errors.group(1) == "", f"{name}: {errors.group(1) if errors else dom[:300]}"
        source = (tmp_path / f"{name}.html").read_text()
        charts = re.findall(r'<div id="chart-(\w+)"', source)
        for key in charts:  # plotly drew each chart: its svg is in the DOM, not only the script that makes it
            assert 'class="main-svg"' in block(dom, key), f"{name}: chart {key} not drawn"
        assert dom.count('class="plot-container plotly"') == len(charts)
        timeline = block(dom, "timeline")
        bars = int(re.search(r'data-bars="(\d+)"', timeline).group(1))  # type: ignore[union-attr]
        assert bars > 0 and timeline.count('<g class="point"') == bars, name

    assert sorted(re.findall(r'<div id="chart-(\w+)"', doms["check"])) == ["steps", "timeline"]
    assert block(doms["check"], "steps").count('<g class="point"') == 3  # rank 0's data, compute and wait
    assert block(doms["check"], "timeline").count('<g class="point"') == 848
    bench = block(doms["bench"], "busbw")
    sizes = len(re.findall(r"<tr><td>\d+[BKMG]</td>", bench))
    assert bench.count('class="trace scatter') == 1 and bench.count('class="point"') == sizes > 5

    width, height, bpp, rows = png_pixels(shot)
    assert (width, height) == (1280, 2000)
    sampled = [row[x:x + 3] for row in rows[::8] for x in range(0, len(row), bpp * 2)]
    white = sum(1 for p in sampled if p == b"\xff\xff\xff")
    assert len(set(sampled)) > 50 and white < 0.97 * len(sampled), "the screenshot is blank"
    stuck = _hex_rgb(html_parts.BAR_CLASSES["stuck"][1])
    stuck_inside = _hex_rgb(html_parts.STUCK_INSIDE)
    red = sum(1 for row in rows for x in range(0, len(row), bpp) if row[x:x + 3] in (stuck, stuck_inside))
    assert red > 5000, f"the stuck spans are not drawn red ({red} pixels)"
    print(f"browser test: {time.monotonic() - began:.1f} s")
