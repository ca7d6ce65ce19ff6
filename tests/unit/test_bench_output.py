"""The bench's CSV and plot: exact text, valid SVG, and no half-written files."""

import os
import sys
import xml.etree.ElementTree as ET

import pytest

from ddpdoctor.probes.allreduce import outputs as bench_output
from ddpdoctor.probes.allreduce.outputs import to_csv, to_svg, write_plot
from ddpdoctor.judge.busbw import SizeResult, sweep_sizes
from ddpdoctor.core.errors import UsageError

SVG = "{http://www.w3.org/2000/svg}"


def _result(op="all_reduce", size=1024, times=(1e-5,), in_place=False, n=8, wrong=0):
    return SizeResult(op=op, size_bytes=size, count=size // 4, dtype="float32", in_place=in_place,
                      world_size=n, per_iter_s=list(times), wrong=wrong)


def test_csv_exact_text():
    rows = [
        _result(size=1024, times=[1e-5, 2e-5, 3e-5]),
        _result(size=1_000_000_000, times=[0.1, 0.1, 0.2, 0.1], in_place=True, wrong=3),
    ]
    assert to_csv(rows) == (
        "op,size_bytes,count,dtype,in_place,median_us,p95_us,min_us,algbw_gbps,busbw_gbps,wrong\n"
        "all_reduce,1024,256,float32,false,20.000,30.000,10.000,0.0512,0.0896,0\n"
        "all_reduce,1000000000,250000000,float32,true,100000.000,200000.000,100000.000,10.0000,17.5000,3\n"
    )


def test_csv_of_nothing_is_the_header():
    assert to_csv([]) == ("op,size_bytes,count,dtype,in_place,median_us,p95_us,min_us,"
                          "algbw_gbps,busbw_gbps,wrong\n")


def _sweep(op="all_reduce", in_place=False, low=8, high=256 * 2**20, n=8):
    # time = 5 µs + size / 100 GB/s: latency-bound small, bandwidth-bound large
    return [_result(op=op, size=s, times=[5e-6 + s / 100e9], in_place=in_place, n=n)
            for s in sweep_sizes(low, high, 2, 4, n, op)]


def _parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_svg_is_xml_with_one_polyline_per_series():
    results = _sweep() + _sweep(in_place=True) + _sweep(op="all_gather", low=1024, high=2**20)
    root = _parse(to_svg(results, "busbw <8 ranks> & friends"))
    assert root.tag == f"{SVG}svg"
    polylines = root.findall(f".//{SVG}polyline")
    assert len(polylines) == 3
    point_counts = sorted(len(p.get("points").split()) for p in polylines)
    assert point_counts == sorted([len(_sweep()), len(_sweep()), len(_sweep(op="all_gather", low=1024, high=2**20))])


def test_svg_labels_title_axes_ticks_and_legend():
    root = _parse(to_svg(_sweep() + _sweep(in_place=True), "busbw <8 ranks> & friends"))
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert "busbw <8 ranks> & friends" in texts
    assert "busbw (GB/s)" in texts
    assert any("size" in t for t in texts)
    for label in ("1K", "1M", "256M"):
        assert label in texts
    assert "all_reduce (out-of-place)" in texts
    assert "all_reduce (in-place)" in texts


def test_svg_small_sweep_labels_bytes():
    root = _parse(to_svg(_sweep(low=8, high=64), "small"))
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert [t for t in texts if t in ("8B", "16B", "32B", "64B")] == ["8B", "16B", "32B", "64B"]


def test_svg_higher_busbw_is_drawn_higher():
    root = _parse(to_svg(_sweep(low=8, high=2**20), "t"))
    points = [tuple(map(float, p.split(","))) for p in root.find(f".//{SVG}polyline").get("points").split()]
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    assert xs == sorted(xs)
    assert ys == sorted(ys, reverse=True)  # busbw grows with size here; SVG y grows downward


def test_svg_single_point_and_zero_busbw_still_valid():
    root = _parse(to_svg([_result(size=8, n=1)], "one rank"))
    assert len(root.findall(f".//{SVG}polyline")) == 1


def test_svg_of_nothing_refused():
    with pytest.raises(ValueError, match="no results"):
        to_svg([], "t")


def test_write_plot_svg(tmp_path):
    target = tmp_path / "plot.svg"
    target.write_text("old")
    write_plot(_sweep(low=8, high=2**20), str(target), "t")
    assert len(_parse(target.read_text()).findall(f".//{SVG}polyline")) == 1
    assert os.listdir(tmp_path) == ["plot.svg"]


def test_write_plot_png_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    target = tmp_path / "x.png"
    with pytest.raises(UsageError) as error:
        write_plot(_sweep(low=8, high=64), str(target), "t")
    assert str(error.value) == f"--plot {target} needs matplotlib (pip install matplotlib), or give a .svg path"
    assert os.listdir(tmp_path) == []


def test_write_plot_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "x.png"
    write_plot(_sweep(low=8, high=2**20), str(target), "t")
    assert target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("name", ["x.jpg", "x", "x.svg.txt"])
def test_write_plot_unknown_suffix(tmp_path, name):
    with pytest.raises(UsageError) as error:
        write_plot(_sweep(low=8, high=64), str(tmp_path / name), "t")
    assert ".svg" in str(error.value) and ".png" in str(error.value)
    assert os.listdir(tmp_path) == []


def test_write_plot_missing_folder(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        write_plot(_sweep(low=8, high=64), str(tmp_path / "nope" / "x.svg"), "t")


def test_write_plot_failure_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "plot.svg"
    target.write_text("old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(bench_output.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_plot(_sweep(low=8, high=64), str(target), "t")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["plot.svg"]
