"""`ddpdoctor allreduce-bench` flags: bad ones are exit 3 and one line before any rank starts,
good ones build the CheckConfig the ranks will read."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ddpdoctor import cli
from ddpdoctor.runtime.config import BenchConfig, CheckConfig
from ddpdoctor.core.findings import EXIT_UNKNOWN
from ddpdoctor.core.faults import Fault, parse_faults

from . import cli_guard
from .cli_guard import assert_usage_error, one_error_line

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

no_launch = cli_guard.no_launch  # autouse: in this module no rank may start


def _bench(*flags: str) -> list[str]:
    return ["allreduce-bench", *flags]


@pytest.mark.parametrize("argv, words", [
    (_bench("--op", "bogus"), ["--op", "invalid choice: 'bogus'", "all_reduce"]),
    (_bench("--min-bytes", "0"), ["--min-bytes", "'0' is not a size"]),
    (_bench("--min-bytes", "12X"), ["--min-bytes", "'12X' is not a size", "K, M or G"]),
    (_bench("--max-bytes", "2T"), ["--max-bytes", "'2T' is not a size"]),
    (_bench("--max-bytes", "1025G"), ["--max-bytes", "1025G is out of range"]),
    (_bench("--min-bytes", "4K", "--max-bytes", "1K"), ["--min-bytes 4096 is larger than --max-bytes 1024"]),
    (_bench("--factor", "1"), ["--factor", "out of range", "from 2 to 1024"]),
    (_bench("--factor", "2.5"), ["--factor", "'2.5' is not a whole number"]),
    (_bench("--iters", "0"), ["--iters", "out of range", "from 1 to 10000"]),
    (_bench("--warmup", "-1"), ["--warmup", "out of range", "from 0 to 1000"]),
    (_bench("--dtype", "int8"), ["--dtype", "invalid choice: 'int8'"]),
    (_bench("--min-busbw", "-5"), ["--min-busbw", "out of range", "GB/s"]),
    (_bench("--min-busbw", "fast"), ["--min-busbw", "'fast' is not a bandwidth in GB/s"]),
    (_bench("--localise", "sometimes"), ["--localise", "invalid choice: 'sometimes'"]),
    (_bench("--csv", "/nonexistent/dir/sweep.csv"), ["--csv /nonexistent/dir/sweep.csv", "does not exist"]),
    (_bench("--inject", "slowlink:ranks=1"), ["slowlink needs two different ranks", "slowlink:ranks=1"]),
    (_bench("--inject", "slowlink:ranks=1,1"), ["slowlink needs two different ranks", "slowlink:ranks=1,1"]),
    (_bench("--inject", "slowlink:ranks=a,b"), ["slowlink needs two different ranks"]),
    (_bench("--inject", "slowlink:rank=1"), ["bad option 'rank=1' for fault 'slowlink'"]),
    (_bench("--inject", "blip:ranks=2"), ["blip needs two different ranks", "blip:ranks=2"]),
    (_bench("--inject", "corrupt:rank=x"), ["rank must be an integer", "corrupt:rank=x"]),
    (_bench("--inject", "corrupt:rank=-1"), ["rank must be >= 0"]),
    (_bench("--steps", "3"), ["unrecognized arguments: --steps 3"]),
])
def test_bad_bench_flag_is_one_line_and_exit_3(capsys, argv, words):
    assert_usage_error(capsys, argv, words)


def test_plot_needs_svg_or_png(capsys, tmp_path):
    path = tmp_path / "x.pdf"
    assert cli.main(_bench("--plot", str(path))) == EXIT_UNKNOWN
    line = one_error_line(capsys)
    assert f"--plot {path}" in line and ".svg or .png" in line
    assert not path.exists()


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed: a .png plot is allowed")
def test_png_plot_without_matplotlib(capsys, tmp_path):
    assert cli.main(_bench("--plot", str(tmp_path / "x.png"))) == EXIT_UNKNOWN
    line = one_error_line(capsys)
    assert "needs matplotlib" in line and ".svg" in line


@pytest.mark.parametrize("flag", ["--csv", "--plot"])
def test_output_path_that_is_a_folder(capsys, tmp_path, flag):
    folder = tmp_path / "out.svg"
    folder.mkdir()
    assert cli.main(_bench(flag, str(folder))) == EXIT_UNKNOWN
    assert "is a folder" in one_error_line(capsys)


def test_bad_inject_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("DDPDOCTOR_INJECT", "slowlink:ranks=2")
    assert cli.main(_bench()) == EXIT_UNKNOWN
    assert "slowlink needs two different ranks" in one_error_line(capsys)


# -- good flags ----------------------------------------------------------------

def _config(*flags: str) -> CheckConfig:
    return cli._config(cli.build_parser().parse_args(_bench(*flags)))


def test_defaults():
    cfg = _config()
    assert cfg.probes == ("topology", "allreduce")
    assert cfg.command == "allreduce-bench"
    assert cfg.bench == BenchConfig(op="all_reduce", min_bytes=None, max_bytes=None, factor=None, dtype="float32",
                                    warmup=5, iters=20, check=True, localise="auto", min_busbw_gbps=None,
                                    csv_path=None, plot_path=None)
    assert cfg.settings == {}
    assert cfg.inject == ()


def test_every_bench_flag_lands_in_the_config(tmp_path):
    csv, svg = str(tmp_path / "sweep.csv"), str(tmp_path / "sweep.svg")
    cfg = _config("--op", "all_gather", "--min-bytes", "1K", "--max-bytes", "64M", "--factor", "4",
                  "--dtype", "bfloat16", "--warmup", "0", "--iters", "7", "--no-check", "--localise", "always",
                  "--min-busbw", "12.5", "--csv", csv, "--plot", svg, "--nproc", "3", "--backend", "gloo",
                  "--device", "cpu", "--timeout", "9", "--inject", "slowlink:ranks=1,2,corrupt:rank=0")
    assert cfg.probes == ("topology", "allreduce")
    assert cfg.command == "allreduce-bench"
    assert cfg.bench == BenchConfig(op="all_gather", min_bytes=1024, max_bytes=64 * 2**20, factor=4,
                                    dtype="bfloat16", warmup=0, iters=7, check=False, localise="always",
                                    min_busbw_gbps=12.5, csv_path=csv, plot_path=svg)
    assert cfg.settings == {"min_busbw_gbps": 12.5}
    assert (cfg.nproc, cfg.backend, cfg.device, cfg.timeout_s) == (3, "gloo", "cpu", 9.0)
    assert cfg.inject == (Fault("slowlink", 1, peer=2), Fault("corrupt", 0))
    assert not os.path.exists(csv) and not os.path.exists(svg)  # nothing written before the run


@pytest.mark.parametrize("text, size", [("8", 8), ("8B", 8), ("25M", 25 * 2**20), ("25MiB", 25 * 2**20),
                                        ("25MB", 25 * 2**20), ("1G", 2**30), ("1024G", 2**40)])
def test_sizes_in_nccl_tests_syntax(text, size):
    cfg = _config("--min-bytes", text, "--max-bytes", text)
    assert cfg.bench.min_bytes == cfg.bench.max_bytes == size


def test_equal_min_and_max_and_the_smallest_gate_are_accepted():
    cfg = _config("--min-bytes", "4K", "--max-bytes", "4096", "--min-busbw", "0.0001", "--warmup", "0")
    assert (cfg.bench.min_bytes, cfg.bench.max_bytes, cfg.bench.warmup) == (4096, 4096, 0)
    assert cfg.settings == {"min_busbw_gbps": 0.0001}


def test_inject_from_the_environment_reaches_the_config(monkeypatch):
    monkeypatch.setenv("DDPDOCTOR_INJECT", "corrupt:rank=3")
    assert _config().inject == (Fault("corrupt", 3),)
    assert _config("--inject", "slowlink:ranks=0,1").inject == (Fault("slowlink", 0, peer=1),)  # the flag wins


def test_slowlink_and_crash_parse_and_round_trip():
    faults = parse_faults("slowlink:ranks=1,2,crash:rank=0:stage=init")
    assert faults == (Fault("slowlink", 1, peer=2), Fault("crash", 0, stage="init"))
    assert [f.describe() for f in faults] == ["slowlink:ranks=1,2", "crash:rank=0:stage=init"]
    assert parse_faults(",".join(f.describe() for f in faults)) == faults
    assert faults[0].to_json() == {"kind": "slowlink", "rank": 1, "peer": 2}


# -- existing --csv/--plot files ---------------------------------------------------------

@pytest.mark.parametrize("flag, name", [("--csv", "sweep.csv"), ("--plot", "sweep.svg")])
def test_an_existing_csv_or_plot_is_refused_before_any_rank_starts(capsys, tmp_path, flag, name):
    path = tmp_path / name
    path.write_text("last week's sweep")
    assert cli.main(_bench(flag, str(path))) == EXIT_UNKNOWN
    assert one_error_line(capsys) == (f"ddpdoctor: error: {path} already exists: pass --force to overwrite it, "
                                      f"or choose another {flag} path")
    assert path.read_text() == "last week's sweep"


def test_force_accepts_existing_csv_and_plot(tmp_path, monkeypatch):
    import ddpdoctor.session.launcher

    seen = []
    monkeypatch.setattr(ddpdoctor.session.launcher, "run_standalone", lambda cfg, argv, command: seen.append(cfg) or 0)
    csv, svg = tmp_path / "sweep.csv", tmp_path / "sweep.svg"
    csv.write_text("old")
    svg.write_text("old")
    assert cli.main(_bench("--csv", str(csv), "--plot", str(svg), "--force")) == 0
    (cfg,) = seen
    assert cfg.force and (cfg.bench.csv_path, cfg.bench.plot_path) == (str(csv), str(svg))


def test_the_plot_writer_never_overwrites_unless_told(tmp_path, capsys):
    from ddpdoctor.probes.allreduce.outputs import write_plot
    from ddpdoctor.judge.busbw import SizeResult

    results = [SizeResult(op="all_reduce", size_bytes=1 << k, count=(1 << k) // 4, dtype="float32", in_place=False,
                          world_size=4, per_iter_s=[1e-5 * k], wrong=0) for k in range(10, 14)]
    path = tmp_path / "bw.svg"
    path.write_text("appeared during the sweep")
    assert write_plot(results, str(path), "t", overwrite=False) == str(tmp_path / "bw.1.svg")
    assert path.read_text() == "appeared during the sweep" and "wrote" in capsys.readouterr().err
    assert write_plot(results, str(path), "t", overwrite=True) == str(path)
    assert path.read_text().startswith("<svg")


def test_a_blip_slows_the_pairs_own_collective_once_and_nothing_else():
    from ddpdoctor.core.faults import parse_faults
    from ddpdoctor.runtime.inject import Injector

    faults = parse_faults("blip:ranks=1,2")
    assert [(f.kind, f.rank, f.peer) for f in faults] == [("blip", 1, 2)]
    injector = Injector(faults, rank=2)
    assert injector.link_delay_s((0, 1, 2, 3), 2**20) == 0.0  # the whole group's sweep: not theirs alone
    assert injector.link_delay_s((2, 1), 2**20) == pytest.approx(2**20 / 0.25e9)  # their pair, the first time
    assert injector.link_delay_s((1, 2), 2**20) == 0.0  # and never again
    assert Injector(faults, rank=0).link_delay_s((1, 2), 2**20) == 0.0  # only the two ends wait


def test_a_slow_link_takes_its_rate_in_mbit_per_s_beside_its_two_ranks():
    """`slowlink:ranks=4,5:mbps=500` (a link throttled as tc would): the rank list's comma does not cut the fault."""
    from ddpdoctor.core.faults import parse_faults
    from ddpdoctor.runtime.inject import Injector

    faults = parse_faults("slowlink:ranks=4,5:mbps=500,slowlink:ranks=2,4")
    assert [(f.rank, f.peer, f.mbps) for f in faults] == [(4, 5, 500.0), (2, 4, None)]
    assert faults[0].describe() == "slowlink:ranks=4,5:mbps=500"
    odd = parse_faults("slowlink:ranks=1,2:mbps=1234.5678")[0]
    assert parse_faults(odd.describe())[0].mbps == 1234.5678  # the report's spec reads back exactly
    injector = Injector(faults, 4)
    assert injector.link_delay_s((4, 5), 2**20) == pytest.approx(2**20 / 62.5e6)  # 500 Mbit/s
    assert injector.link_delay_s((2, 4), 2**20) == pytest.approx(2**20 / 0.25e9)  # the default rate
    assert injector.link_delay_s((0, 1), 2**20) == 0.0
