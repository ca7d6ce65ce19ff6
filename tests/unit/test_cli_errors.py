"""ddpdoctor.cli.main in-process on bad input: exit 3 and one line on stderr, never a rank started."""

from __future__ import annotations

import json
import os

import pytest

from ddpdoctor import cli
from ddpdoctor.core.findings import EXIT_UNKNOWN

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


# -- existing output files: refused before anything runs, replaced only with --force --------------

FIXTURE_SNAPSHOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "homogeneity", "cpu_vm_2core_recorded.json")


class _Started(BaseException):
    """Where a rank would start (BaseException: main's `except Exception` must not eat it)."""

    def __init__(self, cfg, argv=None):
        super().__init__("started")
        self.cfg, self.argv = cfg, argv


@pytest.fixture
def record_launch(monkeypatch):
    import ddpdoctor.session.launcher
    import ddpdoctor.session.rank

    def standalone(cfg, argv, command):
        raise _Started(cfg, argv)

    def rank(cfg, env, command):
        raise _Started(cfg)

    monkeypatch.setattr(ddpdoctor.session.launcher, "run_standalone", standalone)
    monkeypatch.setattr(ddpdoctor.session.rank, "run_rank", rank)


@pytest.mark.parametrize("command", [["check"], ["scaling"], ["allreduce-bench"],
                                     ["diagnose", "/nonexistent/in.json"], ["explain", "/nonexistent/job.log"]])
def test_an_existing_json_is_refused_before_anything_runs(capsys, tmp_path, command):
    """No rank starts (the autouse guard), and for diagnose/explain not even the inputs are
    read: the refusal comes before the 'no such file' of the missing input."""
    path = tmp_path / "report.json"
    path.write_text("keep me")
    assert cli.main([*command, "--json", str(path)]) == EXIT_UNKNOWN
    assert one_error_line(capsys) == (f"ddpdoctor: error: {path} already exists: pass --force to overwrite it, "
                                      "or choose another --json path")
    assert path.read_text() == "keep me"


@pytest.mark.parametrize("argv", [["check", "--json", "{}", "--force"], ["--force", "check", "--json", "{}"],
                                  ["allreduce-bench", "--force", "--json", "{}"]])
def test_force_lets_the_run_start_and_reaches_the_ranks(capsys, tmp_path, record_launch, argv):
    path = tmp_path / "report.json"
    path.write_text("old")
    argv = [a.format(path) for a in argv]
    with pytest.raises(_Started) as started:
        cli.main(argv)
    assert started.value.cfg.force is True and started.value.cfg.json_path == str(path)
    assert started.value.argv == argv  # the ranks parse the same argv, --force included
    assert capsys.readouterr().err == ""


def test_without_force_the_config_says_so(record_launch, tmp_path):
    with pytest.raises(_Started) as started:
        cli.main(["check", "--json", str(tmp_path / "new.json")])
    assert started.value.cfg.force is False


def test_a_torchrun_rank_refuses_an_existing_report_too(capsys, monkeypatch, tmp_path, record_launch):
    """Under torchrun any rank may become the reporter, so every rank checks before it starts."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "report.json"
    path.write_text("keep me")
    assert cli.main(["check", "--json", str(path)]) == EXIT_UNKNOWN
    assert "already exists: pass --force" in one_error_line(capsys)


def test_a_rank_of_our_launcher_does_not_recheck(monkeypatch, tmp_path, record_launch):
    """The launcher checked before spawning its ranks and writes the report itself; its ranks
    write nothing, so a file that appeared since must not make them fail."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "DDPDOCTOR_LAUNCHER_PID": "1", "DDPDOCTOR_RUN_ID": "abc"}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "report.json"
    path.write_text("appeared after the launcher's check")
    with pytest.raises(_Started) as started:
        cli.main(["check", "--json", str(path)])
    assert started.value.cfg.force is False


@pytest.mark.parametrize("command", [["diagnose", FIXTURE_SNAPSHOT], ["explain", FIXTURE_SNAPSHOT]])
def test_force_replaces_the_json_of_diagnose_and_explain(capsys, tmp_path, command):
    path = tmp_path / "out.json"
    path.write_text("old")
    assert cli.main([*command, "--json", str(path), "--force"]) == 0
    data = json.loads(path.read_text())
    assert data["schema"] in ("ddpdoctor.diagnosis/1", "ddpdoctor.explain/1")
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_one_file_for_two_outputs_is_refused(capsys, tmp_path):
    path = tmp_path / "same.svg"
    assert cli.main(["allreduce-bench", "--json", str(path), "--plot", str(path)]) == EXIT_UNKNOWN
    assert one_error_line(capsys) == f"ddpdoctor: error: --json and --plot both name {path}: give each its own file"


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_device_is_never_an_output_even_with_force(capsys, force):
    """Writes rename a finished file onto the path: as root, onto /dev/null that would replace the device."""
    assert cli.main(["check", "--json", "/dev/null", *force]) == EXIT_UNKNOWN
    assert "--json /dev/null is not a regular file" in one_error_line(capsys)
    assert not os.path.isfile("/dev/null")


@pytest.mark.parametrize("argv", [["check", "--json", ""], ["check", "--json", " "],
                                  ["diagnose", FIXTURE_SNAPSHOT, "--json", ""]])
def test_an_empty_output_path_is_refused(capsys, argv):
    # It used to be read as "no --json": a run without the report the user asked for.
    assert cli.main(argv) == EXIT_UNKNOWN
    assert "--json" in one_error_line(capsys)


@pytest.mark.parametrize("spec", [",", " , ,"])
def test_probes_naming_nothing_is_refused(capsys, spec):
    # It used to run no probe at all and say OK.
    assert cli.main(["check", "--probes", spec]) == EXIT_UNKNOWN
    assert "names no probe" in one_error_line(capsys)


def test_an_existing_output_is_refused_before_the_model_is_built(capsys, tmp_path):
    """--model is imported, built and run on one batch before ranks start (seconds for a big
    model): an output that would be refused anyway is refused first."""
    path = tmp_path / "report.json"
    path.write_text("keep me")
    argv = ["scaling", "--model", "nonexistent_mod_zq:build", "--batch", "nonexistent_mod_zq:batch", "--json", str(path)]
    assert cli.main(argv) == EXIT_UNKNOWN
    assert "already exists: pass --force" in one_error_line(capsys)
    assert cli.main([*argv, "--force"]) == EXIT_UNKNOWN
    assert "nonexistent_mod_zq" in one_error_line(capsys)  # with --force, the next problem is the model
