"""Fuzzed bad input through `ddpdoctor.cli.main` in-process: arguments, environment, files.

Every case ends in one of two ways: a usage error (exit 3, exactly one stderr line, no
traceback), or input that is legitimately accepted, which stops where a rank would start
(the `Accepted` stub below) or, for `diagnose`/`explain`/`probes`, finishes its work. Never
another exception, never an "internal error" line, never a hang. The Slurm node-list and
rank-variable parsers are fuzzed on their own in test_slurm_and_env.py; here their
variables go through the CLI.

Cases tried per test: run with `--hypothesis-show-statistics`, or count the loops below.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import string
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import ddpdoctor.session.launcher
import ddpdoctor.session.rank
import ddpdoctor.snapshot
from ddpdoctor import cli
from ddpdoctor.measure import cuda_visible
from ddpdoctor.core.errors import UsageError
from ddpdoctor.probes import all_probes
from ddpdoctor.snapshot import MAX_INPUT_BYTES, REPORT_SCHEMA, SCHEMA, load_inputs

from . import cli_guard

no_launch = cli_guard.no_launch  # autouse: no launcher variable leaks in

FIXTURES = Path(__file__).parent.parent / "fixtures" / "homogeneity"
SNAPSHOT = FIXTURES / "cpu_vm_2core_recorded.json"  # a real `ddpdoctor snapshot`, 2 KB
_FUZZ = settings(database=None, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fuzz(examples: int) -> settings:
    """Modest counts: the whole file runs in well under a minute on 2 cores."""
    return settings(_FUZZ, max_examples=examples)


class Accepted(BaseException):
    """Raised where a rank (or the snapshot's measurement) would start. A BaseException, so
    main's `except Exception` cannot turn an accepted input into an error line."""

    def __init__(self, where: str, cfg: Any = None, env: Any = None) -> None:
        super().__init__(where)
        self.where, self.cfg, self.env = where, cfg, env


@pytest.fixture(autouse=True)
def accept_instead_of_starting(no_launch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def standalone(cfg: Any, argv: list[str], command: list[str]) -> int:
        raise Accepted("standalone", cfg)

    def rank(cfg: Any, env: Any, command: list[str]) -> int:
        raise Accepted("rank", cfg, env)

    def snapshot(measure: bool = True) -> dict[str, Any]:
        raise Accepted("snapshot")

    monkeypatch.setattr(ddpdoctor.session.launcher, "run_standalone", standalone)
    monkeypatch.setattr(ddpdoctor.session.rank, "run_rank", rank)
    monkeypatch.setattr(ddpdoctor.snapshot, "take_snapshot", snapshot)


class TooSlow(BaseException):
    pass


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail, instead of hanging the suite, if the block takes longer (a FIFO that blocks open())."""
    def expire(signum: int, frame: Any) -> None:
        raise TooSlow(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run(capsys: pytest.CaptureFixture[str], argv: list[str], seconds: float = 10.0) -> tuple[Any, str, str]:
    """main(argv): (exit code or the Accepted, stdout, stderr), with the invariants every
    outcome shares: no traceback, no internal error, at most one stderr line."""
    capsys.readouterr()
    with within(seconds):
        try:
            result: Any = cli.main(argv)
        except Accepted as accepted:
            result = accepted
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out, (argv, captured.err)
    assert "internal error" not in captured.err, (argv, captured.err)
    assert len(captured.err.splitlines()) <= 1, (argv, captured.err)
    return result, captured.out, captured.err


def usage_error(result: Any, out: str, err: str) -> str:
    """The one line of a usage error (exit 3)."""
    assert result == 3, (result, err)
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n") and lines[0].startswith("ddpdoctor: error: "), err
    return lines[0]


# -- arguments ---------------------------------------------------------------------------------

SUBCOMMANDS = ("check", "scaling", "allreduce-bench", "snapshot", "diagnose", "explain", "probes")


def _options() -> dict[str, list[str]]:
    """Every real flag of every subcommand, read from the parser, so new flags are fuzzed too."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [o for a in p._actions for o in a.option_strings if o not in ("-h", "--help")]
            for name, p in sub.choices.items()}


OPTIONS = _options()
# --model/--batch import what they name: given only values that cannot name a real module.
SAFE_VALUES = {"--model": ["", ":", "nonexistent_mod_zq:fn", "/nonexistent/x.py:fn", "x.py", "a:b:c"],
               "--batch": ["", ":", "nonexistent_mod_zq:fn", "/nonexistent/x.py:fn"]}
GARBAGE = ["", " ", "-", "--", "-1", "0", "1", "2", "3", "99999", "65536", "65535", "2.5", "1e309", "-0",
           "nan", "NaN", "inf", "-inf", "1X", "1K", "4M", "1025G", "0x10", "1_0", "\u0661\u0662", "\u00b2",
           "\u00e9", "\U0001f4a5", "a\nb", "\u2028", "\udcff", "9" * 5000, "x" * 300, ",", ",,", "all", "default",
           "nope", "crash:rank=0:stage=init", "hang:rank=9", "slowlink:ranks=1", "2:95,8:80", "1:200", "a:b",
           "gloo", "nccl", "mpi", "cpu", "cuda", "auto", "always", "float16", "int8", "all_gather",
           "report.json", "out.svg", "out.png", "out.pdf", "sub/", "/nonexistent/r.json", "/dev/null", ".",
           "snapshot.json", "report_in.json"]
UNKNOWN_FLAGS = ["--bogus", "-x", "--json-", "--timeout=", "--nproc=0", "--port=99999", "--min-bytes=1X",
                 "--timeout=-1", "--s", "---force", "--force=yes"]
VALUE = st.one_of(st.sampled_from(GARBAGE), st.integers(-10**12, 10**12).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=8))


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    sub = draw(st.sampled_from(SUBCOMMANDS + ("", "frobnicate")))
    argv = [draw(st.sampled_from(["--force", "--version", "-h", "--bogus"]))] if draw(st.integers(0, 9)) == 0 else []
    if sub:
        argv.append(sub)
    options = OPTIONS.get(sub, [])
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 9))
        if kind <= 5 and options:
            flag = draw(st.sampled_from(options))
            argv.append(flag)
            if draw(st.integers(0, 7)):  # mostly with a value, sometimes missing it
                argv.append(draw(st.sampled_from(SAFE_VALUES[flag])) if flag in SAFE_VALUES else draw(VALUE))
        elif kind <= 7:
            argv.append(draw(VALUE))  # a stray positional: a file for diagnose/explain
        else:
            argv.append(draw(st.sampled_from(UNKNOWN_FLAGS)))
    return argv


def _config_is_sane(cfg: Any) -> None:
    """What an accepted rank-starting command hands the launcher."""
    assert cfg.probes and set(cfg.probes) <= set(all_probes())
    assert 0.5 <= cfg.timeout_s <= 86400
    assert cfg.nproc is None or 1 <= cfg.nproc <= 65536
    assert cfg.port is None or 1 <= cfg.port <= 65535
    for path in (cfg.json_path, cfg.bench.csv_path, cfg.bench.plot_path):
        assert path is None or (path.strip() and not os.path.isdir(path))
        assert path is None or cfg.force or not os.path.lexists(path)  # never overwritten silently
    if cfg.bench.min_bytes is not None and cfg.bench.max_bytes is not None:
        assert cfg.bench.min_bytes <= cfg.bench.max_bytes


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder to run in, with real inputs under the names the fuzzer draws."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snapshot.json").write_text(SNAPSHOT.read_text())
    (tmp_path / "report_in.json").write_text(json.dumps(_real_report()))
    (tmp_path / "sub").mkdir()
    return tmp_path


def _real_report() -> dict[str, Any]:
    from ddpdoctor.session.reporter import build_report

    from .test_report import COMMAND, healthy_record

    return build_report(healthy_record(2), command=COMMAND).to_json()


@fuzz(150)
@given(argv=argvs())
@example(argv=["check", "--timeout", "-1"])
@example(argv=["check", "--nproc", "0"])
@example(argv=["check", "--port", "99999"])
@example(argv=["allreduce-bench", "--min-bytes", "1X"])
@example(argv=["check", "--probes", ","])
@example(argv=["check", "--json", ""])
@example(argv=["check", "a\nb"])
@example(argv=["check", "--json", "a\x00b"])
@example(argv=["snapshot", "--out", ""])
@example(argv=["--force", "check", "--json", "report_in.json"])
def test_any_argv_is_a_usage_error_or_accepted(capsys, workdir, argv):
    result, out, err = run(capsys, argv)
    event(f"outcome: {result.where if isinstance(result, Accepted) else 'error' if result == 3 and err else result}")
    if isinstance(result, Accepted):
        assert err == ""
        if result.where != "snapshot":
            _config_is_sane(result.cfg)
        return
    if result == 3 and err:
        usage_error(result, out, err)
        return
    # Not an error: help, version, the probe list, or a diagnosis/explanation of real files.
    assert err == "" and out
    helped = {"-h", "--help", "--version"} & set(argv) or not (set(argv) & set(SUBCOMMANDS))
    if helped:
        assert out.startswith(("usage: ddpdoctor", "ddpdoctor "))
    else:
        assert {"probes", "diagnose", "explain"} & set(argv) and result in (0, 1, 2), (argv, result)


@pytest.mark.parametrize("argv, words", [
    (["check", "--nproc"], ["--nproc: expected one argument"]),
    (["check", "--json"], ["--json: expected one argument"]),
    (["allreduce-bench", "--dtype", "int8"], ["--dtype", "invalid choice: 'int8'"]),
    (["check", "--s", "3"], ["ambiguous option: --s could match"]),
    (["check", "--force=yes"], ["--force: ignored explicit argument 'yes'"]),
    (["diagnose"], ["the following arguments are required: FILE"]),
    (["explain", "--world-size", "0", "x.log"], ["--world-size", "out of range"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["check", "stray", "args"], ["unrecognized arguments: stray args"]),
    (["check", "a\nb"], ["unrecognized arguments: a\\nb"]),          # escaped: still one line
    (["check", "\u2028"], ["unrecognized arguments: \\u2028"]),
    (["check", "--json", "x\x00"], ["NUL byte"]),
])
def test_argparses_own_errors_are_one_line_and_exit_3(capsys, argv, words):
    line = usage_error(*run(capsys, argv))
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["check", "--help"], ["explain", "-h"]])
def test_help_and_version_return_0_instead_of_raising_systemexit(capsys, argv):
    result, out, err = run(capsys, argv)
    assert result == 0 and err == "" and out.startswith(("usage: ddpdoctor", "ddpdoctor "))


# -- environment for `check` ---------------------------------------------------------------------

RANK_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, words", [
    ({**RANK_ENV, "WORLD_SIZE": "abc"}, ["WORLD_SIZE='abc' is not an integer"]),
    ({**RANK_ENV, "LOCAL_RANK": "-1"}, ["LOCAL_RANK=-1 is out of range"]),
    ({**RANK_ENV, "RANK": "5"}, ["RANK=5 is out of range", "between 0 and 1"]),       # RANK > WORLD_SIZE
    ({**RANK_ENV, "RANK": "2"}, ["RANK=2 is out of range"]),                          # RANK == WORLD_SIZE
    ({**RANK_ENV, "MASTER_PORT": "99999"}, ["MASTER_PORT=99999 is out of range"]),
    ({**RANK_ENV, "MASTER_PORT": "abc"}, ["MASTER_PORT='abc' is not an integer"]),
    ({**RANK_ENV, "MASTER_PORT": "0"}, ["MASTER_PORT=0 is out of range"]),
    ({**RANK_ENV, "MASTER_ADDR": ""}, ["MASTER_ADDR is not set"]),
    ({**RANK_ENV, "WORLD_SIZE": "\u0662\u0662\u0662" * 2000}, ["WORLD_SIZE"]),       # over int()'s digit limit
    ({"DDPDOCTOR_INJECT": "crash:rank=\U0001f4a5:stage=init"}, ["rank must be an integer"]),
    ({"DDPDOCTOR_INJECT": "hang"}, ["--inject 'hang'"]),
    ({"DDPDOCTOR_INJECT": "::::"}, ["unknown fault kind"]),
    ({"DDPDOCTOR_INJECT": "slow:rank=0:factor=nan"}, ["factor"]),
    ({"OMP_NUM_THREADS": "abc"}, ["OMP_NUM_THREADS='abc' is not a number of threads"]),
    ({"OMP_NUM_THREADS": "0"}, ["OMP_NUM_THREADS='0'"]),
    ({"OMP_NUM_THREADS": "-2"}, ["OMP_NUM_THREADS='-2'"]),
    ({"OMP_NUM_THREADS": "1.5"}, ["OMP_NUM_THREADS='1.5'"]),
    ({"OMP_NUM_THREADS": ""}, ["OMP_NUM_THREADS=''"]),
    ({**RANK_ENV, "OMP_NUM_THREADS": "abc"}, ["OMP_NUM_THREADS='abc'"]),            # ranks refuse it too
])
def test_bad_environment_is_one_line_and_exit_3(capsys, monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = usage_error(*run(capsys, ["check"]))
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("env", [
    # No RANK/WORLD_SIZE: we are the standalone parent, and the launcher sets MASTER_ADDR,
    # MASTER_PORT and LOCAL_RANK for every rank it spawns: what the shell had is not used.
    {"MASTER_PORT": "abc"}, {"MASTER_ADDR": ""}, {"LOCAL_RANK": "-1"}, {"MASTER_PORT": "99999"},
    {"OMP_NUM_THREADS": "8,2"}, {"OMP_NUM_THREADS": " 2 "},  # OpenMP's per-level list; spaces are read
])
def test_environment_the_standalone_launcher_replaces_is_accepted(capsys, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result, out, err = run(capsys, ["check"])
    assert isinstance(result, Accepted) and result.where == "standalone" and err == ""


@pytest.mark.parametrize("raw, used, problem", [
    # CUDA reads the list up to the first entry it cannot read, silently. That is not a usage
    # error: it is what the gpu-count probe exists to report (GPU004/GPU005) on every rank.
    ("0,,x", ("0",), "'' is not a GPU index"),
    ("GPU-zzz", (), "'GPU-zzz' is not a GPU index"),
    ("-1", (), "hides every GPU"),      # the documented way to hide every GPU
    ("", (), "hides every GPU"),
    ("," * 500, (), "'' is not a GPU index"),
    ("0,1,0", ("0", "1"), "'0' is listed twice"),
    ("3, 1", ("3", "1"), None),
])
def test_garbled_cuda_visible_devices_is_accepted_and_read_as_cuda_reads_it(capsys, monkeypatch, raw, used, problem):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", raw)
    result, out, err = run(capsys, ["check"])
    assert isinstance(result, Accepted) and err == ""
    visible = cuda_visible.parse(os.environ["CUDA_VISIBLE_DEVICES"])
    assert visible.entries == used and visible.count == len(used)
    assert (problem is None and not visible.problems) or any(problem in p for p in visible.problems)


@fuzz(150)
@given(st.text(max_size=30))
def test_any_cuda_visible_devices_parses_to_a_prefix_of_its_entries(raw):
    visible = cuda_visible.parse(raw)
    items = [t.strip() for t in raw.strip().split(",")]
    assert visible.restricts and visible.count == len(visible.entries)
    if raw.strip() not in ("", "-1"):
        assert list(visible.entries) + list(visible.ignored) == items  # CUDA stops at the first bad entry
        assert bool(visible.ignored) == bool(visible.problems)


@fuzz(150)
@given(st.one_of(st.text(max_size=12), st.text(alphabet=" ,0123456789-", max_size=10)))
@example("4")
@example("8,2")
@example("0")
@example("\u0662")  # an Arabic-Indic two: int() reads it, OpenMP does not
@example("007")
@example("1000000")
def test_omp_num_threads_is_refused_or_an_openmp_thread_list(capsys, monkeypatch, raw):
    if "\x00" in raw:
        return  # the environment cannot hold a NUL
    monkeypatch.setenv("OMP_NUM_THREADS", raw)
    result, out, err = run(capsys, ["check"])
    levels = [p.strip(" \t") for p in raw.split(",")]
    readable = all(p.isascii() and p.isdigit() and 1 <= int(p) < 10**6 for p in levels)
    if isinstance(result, Accepted):
        assert readable, raw
    else:
        assert not readable, raw
        assert "OMP_NUM_THREADS" in usage_error(result, out, err)


# -- files for `diagnose` and `explain` ------------------------------------------------------------

def _diagnose_error(capsys: pytest.CaptureFixture[str], path: Path, seconds: float = 5.0) -> str:
    started = time.monotonic()
    line = usage_error(*run(capsys, ["diagnose", str(path)], seconds))
    assert time.monotonic() - started < seconds
    return line


def test_every_prefix_of_a_real_snapshot_and_report_is_refused(tmp_path):
    """Through load_inputs for every prefix (main rebuilds its parser per call, ~9 ms), and
    through main for a spread of them below."""
    count, expected = 0, 0
    for name, text in (("snapshot", SNAPSHOT.read_text()), ("report", json.dumps(_real_report()))):
        path = tmp_path / f"{name}.json"
        complete = len(text.rstrip())
        expected += complete
        for end in range(complete):
            path.write_text(text[:end])
            try:  # not pytest.raises: thousands of them cost seconds
                load_inputs([str(path)])
            except UsageError as exc:
                message = str(exc)
            else:
                raise AssertionError(f"{name} cut at {end} was accepted")
            assert "\n" not in message and str(path) in message
            count += 1
        path.write_text(text[:complete])  # the whole document, without its final newline, is fine
        assert load_inputs([str(path)]).facts
    assert count == expected > 6000


def test_a_spread_of_prefixes_through_main(capsys, tmp_path):
    text = SNAPSHOT.read_text()
    path = tmp_path / "cut.json"
    for end in range(0, len(text.rstrip()), 17):
        path.write_text(text[:end])
        line = _diagnose_error(capsys, path)
        assert "is not valid JSON" in line and "was it cut short?" in line


@pytest.mark.parametrize("content, words", [
    ({"schema": "ddpdoctor.report/99"}, ["schema 'ddpdoctor.report/99'", "expected ddpdoctor.snapshot/1"]),
    ({"schema": "ddpdoctor.snapshot/2", "probes": {}}, ["schema 'ddpdoctor.snapshot/2'"]),
    ({"schema": "DDPDOCTOR.REPORT/1"}, ["schema 'DDPDOCTOR.REPORT/1'"]),
    ({"schema": ["ddpdoctor.report/1"]}, ["schema ['ddpdoctor.report/1']"]),
    ([], ["schema 'list'"]),
    (3, ["schema 'int'"]),
    (None, ["schema 'NoneType'"]),
    ("ddpdoctor.report/1", ["schema 'str'"]),
    ({"schema": SCHEMA, "probes": {"homogeneity": [[["host", "x"]]]}}, ["malformed body", "not an object"]),
    ({"schema": SCHEMA, "probes": {"homogeneity": [{"host": {"a": 1}}]}}, ["malformed body", "host is dict"]),
    ({"schema": REPORT_SCHEMA, "probes": [{"name": "homogeneity", "facts": {"0": {}}}],
      "ranks": [{"rank": "q", "host": "a"}]}, ["malformed rank table"]),
    ({"schema": REPORT_SCHEMA, "probes": [{"name": 7, "facts": {"0": {}}}]}, ["malformed body"]),
    ({"schema": REPORT_SCHEMA, "probes": [{"name": "homogeneity", "facts": {"1e400": {}}}]}, ["malformed body"]),
    ({"schema": SCHEMA, "probes": {"homogeneity": [{"env": 3, "measured": 5}]}},
     ["homogeneity facts", "regenerate"]),  # a probe that cannot judge them: the file's fault
])
def test_wrong_schema_or_shape_is_one_line(capsys, tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    line = _diagnose_error(capsys, path)
    for word in words:
        assert word in line, line


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
FACT_KEYS = st.sampled_from(["host", "rank", "env", "measured", "gpu", "torch", "device", "cpu", "node", "load",
                             "placement", "gpu_uuid", "steps", "nvml", "numa", "matmul"])
FACTS = st.dictionaries(FACT_KEYS, JSON, max_size=5)


@st.composite
def wrong_documents(draw: st.DrawFn) -> Any:
    """Garbage at the top, or garbage under the right schema, down to one rank's facts."""
    probe = draw(st.sampled_from(sorted(all_probes())))
    return draw(st.one_of(
        JSON,
        st.fixed_dictionaries({"schema": st.sampled_from([SCHEMA, REPORT_SCHEMA]), "probes": JSON}),
        st.fixed_dictionaries({"schema": st.just(SCHEMA), "probes": st.dictionaries(st.just(probe), st.lists(JSON))}),
        st.fixed_dictionaries({"schema": st.just(SCHEMA),
                               "probes": st.fixed_dictionaries({probe: st.lists(FACTS, min_size=1, max_size=3)})}),
        st.fixed_dictionaries({"schema": st.just(REPORT_SCHEMA), "ranks": JSON, "settings": JSON,
                               "probes": st.lists(st.fixed_dictionaries(
                                   {"name": st.just(probe),
                                    "facts": st.dictionaries(st.integers(0, 3).map(str), FACTS, max_size=3)}),
                                   max_size=2)}),
    ))


@fuzz(100)
@given(wrong_documents())
def test_json_of_the_wrong_shape_is_one_line_or_a_diagnosis(capsys, tmp_path, document):
    """Garbage is exit 3 with one line. Garbage that happens to be a well-formed snapshot
    (say, a rank whose facts are only {"host": "x"}) is judged like any other file: a
    diagnosis and exit 0-2, never a crash."""
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(document))
    result, out, err = run(capsys, ["diagnose", str(path)])
    event(f"exit {result}")
    if result == 3:
        usage_error(result, out, err)
    else:
        assert result in (0, 1, 2) and err == "" and "exit" in out
        assert isinstance(document, dict) and document.get("schema") in (SCHEMA, REPORT_SCHEMA)


@fuzz(100)
@given(st.binary(max_size=200))
@example(b"\x89PNG\r\n\x1a\n\x00")
@example(b"\xff\xfe{\x00}\x00")  # UTF-16 JSON
@example(b"\x1f\x8b\x08\x00")
def test_binary_garbage_is_one_line(capsys, tmp_path, raw):
    path = tmp_path / "blob.json"
    path.write_bytes(raw)
    _diagnose_error(capsys, path)


class _RunsShell:
    """Unpickling this would run a shell command (what a hostile 'dump' or 'report' holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_pickle_is_refused_by_diagnose_and_never_unpickled(capsys, tmp_path, protocol):
    marker = tmp_path / "PWNED"
    path = tmp_path / "report.json"
    path.write_bytes(pickle.dumps({"schema": REPORT_SCHEMA, "x": _RunsShell(marker)}, protocol=protocol))
    line = _diagnose_error(capsys, path)
    assert ("looks like a pickle" in line and "never unpickles" in line) if protocol >= 2 else "not valid JSON" in line
    assert not marker.exists()


def test_a_200_mb_file_is_refused_at_once_without_being_read(capsys, tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:  # sparse: 200 MiB long, nothing on disk
        handle.truncate(200 << 20)
    started = time.monotonic()
    line = _diagnose_error(capsys, path, seconds=5.0)
    assert time.monotonic() - started < 1.0
    assert f"over the {MAX_INPUT_BYTES >> 20} MiB limit" in line and "200 MiB" in line


def test_a_file_that_grows_past_the_limit_while_read_is_refused(capsys, tmp_path, monkeypatch):
    # st_size can be 0 for files that are not (procfs) or may grow: the read itself stops.
    monkeypatch.setattr(ddpdoctor.snapshot, "MAX_INPUT_BYTES", 1000)
    path = tmp_path / "big.json"
    path.write_text("[" + "0," * 1000 + "0]")
    real_fstat = os.fstat
    monkeypatch.setattr(ddpdoctor.snapshot.os, "fstat",
                        lambda fd: os.stat_result((*real_fstat(fd)[:6], 0, *real_fstat(fd)[7:])))
    assert "over the 0 MiB limit" in _diagnose_error(capsys, path)


def test_deeply_nested_json_is_one_line(capsys, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert "nests JSON deeper than Python can read" in _diagnose_error(capsys, path)
    path.write_text('{"schema": "ddpdoctor.report/1", "probes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nests JSON deeper" in _diagnose_error(capsys, path)


def test_a_folder_a_fifo_and_a_device_are_refused_without_blocking(capsys, tmp_path):
    assert "is a folder" in _diagnose_error(capsys, tmp_path)
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # nobody writes: a plain open() would wait forever
    assert "not a regular file" in _diagnose_error(capsys, fifo, seconds=3.0)
    assert "not a regular file" in _diagnose_error(capsys, Path("/dev/zero"), seconds=3.0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode: chmod 000 cannot stop it")
def test_a_file_without_read_permission_is_one_line(capsys, tmp_path):
    path = tmp_path / "secret.json"
    path.write_text(SNAPSHOT.read_text())
    path.chmod(0)
    assert "permission denied" in _diagnose_error(capsys, path)


# -- explain: any text is a log; what is not text is refused -------------------------------------

def _explain(capsys: pytest.CaptureFixture[str], *paths: Path, seconds: float = 10.0) -> tuple[Any, str, str]:
    return run(capsys, ["explain", *map(str, paths)], seconds)


def test_explain_reads_garbage_text_as_a_log_with_nothing_known(capsys, tmp_path):
    """A truncated report or nested JSON is text: explain reads it as a log, finds no failure
    signature and says so (LOG000, exit 0). That is its meaning of "nothing wrong found"."""
    cut = tmp_path / "cut.log"
    cut.write_text(SNAPSHOT.read_text()[:700])
    deep = tmp_path / "deep.log"
    deep.write_text("[" * 100_000)
    for path in (cut, deep):
        result, out, err = _explain(capsys, path)
        assert result == 0 and err == "" and "No known failure signature" in out


def test_explain_passes_over_binary_input_with_a_note(capsys, tmp_path):
    """A file whose first bytes hold a NUL is not a log: it is skipped with a note, without
    reading the rest (a 200 MiB one too), and the run says it found nothing known (exit 0),
    as test_explain_reading's "any text is explained" expects of text with a NUL in it."""
    blob = tmp_path / "core"
    blob.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    sparse = tmp_path / "huge.log"
    with open(sparse, "wb") as handle:
        handle.truncate(200 << 20)
    started = time.monotonic()
    result, out, err = _explain(capsys, blob, sparse)
    assert time.monotonic() - started < 2.0
    assert result == 0 and err == ""
    assert "core: binary, not a log" in out and "huge.log: binary, not a log" in out


def test_explain_refuses_a_fifo_a_device_and_an_empty_folder_without_blocking(capsys, tmp_path):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    assert "not a regular file" in usage_error(*_explain(capsys, fifo, seconds=3.0))
    assert "not a regular file" in usage_error(*_explain(capsys, Path("/dev/zero"), seconds=3.0))
    folder = tmp_path / "only-a-fifo"
    folder.mkdir()
    os.mkfifo(folder / "rank0.log")  # a FIFO inside a folder is passed over, not opened
    assert "holds no files" in usage_error(*_explain(capsys, folder, seconds=3.0))


def test_explain_notes_a_flight_recorder_json_dump_nested_too_deep(capsys, tmp_path):
    dump = tmp_path / "nccl_trace_rank_0"
    dump.write_text('{"version": "2.10", "pg_config": {}, "entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    log = tmp_path / "job.log"
    log.write_text("[rank0]: RuntimeError: boom\n")
    result, out, err = _explain(capsys, log, dump)
    assert result in (1, 2) and err == ""
    # A note about that file, read past: no internal error, the log still explained.
    assert "nccl_trace_rank_0: not a readable Flight Recorder dump" in out and "Recursion" in out.replace("\n", "")


@fuzz(60)
@given(st.binary(max_size=300))
@example(b"\x80\x00")
@example(b"\x80\x04\x00")
def test_explain_any_bytes_are_explained_without_crashing(capsys, tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("blob") / "rank0.log"
    path.write_bytes(raw)
    result, out, err = _explain(capsys, path)
    assert result in (0, 1, 2) and err == ""
    gzip_or_pickle = raw.startswith(b"\x1f\x8b") or raw[:1] == b"\x80" and raw[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    assert ("binary, not a log" in out) == (b"\x00" in raw and not gzip_or_pickle)


@fuzz(80)
@given(st.binary(max_size=120), st.sampled_from([b"\x80\x02", b"\x80\x04", b"\x80\x05"]))
@example(b"}q\x00(X\x07\x00\x00\x00entries]q\x01u.", b"\x80\x04")  # entries is a list: a dump
@example(b"X\xff\xff\xff\x7f", b"\x80\x04")  # a string said to be 2 GiB long
def test_explain_a_garbled_pickle_dump_is_a_note(capsys, tmp_path_factory, body, magic):
    folder = tmp_path_factory.mktemp("dump")
    (folder / "nccl_trace_rank_0").write_bytes(magic + body)
    (folder / "rank0.log").write_text("[rank0]: RuntimeError: boom\n")
    result, out, err = _explain(capsys, folder)
    assert result in (0, 1, 2) and err == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode: chmod 000 cannot stop it")
def test_explain_a_file_without_read_permission_is_one_line(capsys, tmp_path):
    path = tmp_path / "rank0.log"
    path.write_text("x\n")
    path.chmod(0)
    assert "permission denied" in usage_error(*_explain(capsys, path))


def test_printable_escaping_keeps_every_message_on_one_line():
    weird = "a\nb\rc\u2028d\x85e\x0bf\udcff" + "".join(map(chr, range(32)))
    escaped = cli.one_line(weird)
    assert escaped.splitlines() == [escaped] and escaped.isprintable()
    assert escaped.startswith("a\\nb\\rc\\u2028d\\x85e\\x0bf\\udcff")
    assert cli.one_line(string.printable.strip() + " é 💥") == string.printable.strip() + " é 💥"
