"""ddpdoctor.cli.main in-process on bad input: exit 3 and one line on stderr, never a rank started."""

from __future__ import annotations

import os

import pytest

from ddpdoctor import cli
from ddpdoctor.findings import EXIT_UNKNOWN

from . import cli_guard
from .cli_guard import assert_usage_error, one_error_line

no_launch = cli_guard.no_launch  # autouse: in this module no rank may start


@pytest.mark.parametrize("argv, words", [
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["check", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["check", "--nproc", "0"], ["--nproc", "from 1 to"]),
    (["check", "--nproc", "two"], ["--nproc", "'two' is not a whole number"]),
    (["check", "--timeout", "abc"], ["--timeout", "'abc' is not a number of seconds"]),
    (["check", "--timeout", "0.1"], ["--timeout", "out of range"]),
    (["check", "--timeout", "nan"], ["--timeout", "out of range"]),
    (["check", "--port", "70000"], ["--port", "from 1 to 65535"]),
    (["check", "--backend", "mpi"], ["--backend", "invalid choice: 'mpi'"]),
    (["check", "--steps", "-1"], ["--steps"]),
    (["check", "--probes", "nope"], ["unknown probe 'nope'", "ddp-smoke"]),
    (["check", "--probes", "ddp-smoke,nope"], ["unknown probe 'nope'"]),
    (["check", "--inject", "crash:rank=x"], ["--inject 'crash:rank=x'", "needs stage"]),
    (["check", "--inject", "crash:rank=x:stage=init"], ["rank must be an integer", "crash:rank=x:stage=init"]),
    (["check", "--inject", "explode:rank=1"], ["unknown fault kind 'explode'"]),
    (["check", "--json", "/nonexistent/dir/r.json"], ["--json /nonexistent/dir/r.json", "does not exist"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
])
def test_bad_input_is_one_line_and_exit_3(capsys, argv, words):
    assert_usage_error(capsys, argv, words)


def test_json_path_that_is_a_folder(capsys, tmp_path):
    assert cli.main(["check", "--json", str(tmp_path)]) == EXIT_UNKNOWN
    assert "is a folder" in one_error_line(capsys)


def test_bad_inject_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("DDPDOCTOR_INJECT", "hang:rank=0:stage=lunch")
    assert cli.main(["check"]) == EXIT_UNKNOWN
    assert "unknown stage 'lunch'" in one_error_line(capsys)


def test_inject_flag_wins_over_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("DDPDOCTOR_INJECT", "diverge:rank=0")
    assert cli.main(["check", "--inject", "slow:rank=0:factor=0"]) == EXIT_UNKNOWN
    assert "factor must be between 1 and 1000" in one_error_line(capsys)


def test_bad_rank_environment_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert cli.main(["check"]) == EXIT_UNKNOWN
    assert "WORLD_SIZE='abc' is not an integer" in one_error_line(capsys)


def test_no_command_prints_help_and_exits_3(capsys):
    assert cli.main([]) == EXIT_UNKNOWN
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: ddpdoctor")
    assert "check" in captured.out and "probes" in captured.out
    assert captured.err == ""


def test_probes_lists_ddp_smoke(capsys):
    assert cli.main(["probes"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    smoke = [line for line in lines if "ddp-smoke" in line]
    assert len(smoke) == 1
    assert smoke[0].startswith("* ddp-smoke")  # runs by default
    assert "identical weights" in smoke[0]
    assert lines[-1] == "(* runs by default)"


def test_main_quiets_torch_cpp_logs_unless_the_user_chose(monkeypatch, capsys):
    assert cli.main(["probes"]) == 0
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "FATAL"
    assert os.environ["TORCH_SHOW_CPP_STACKTRACES"] == "0"
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    assert cli.main(["probes"]) == 0
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
