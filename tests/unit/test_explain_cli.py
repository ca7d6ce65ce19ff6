"""`ddpdoctor explain` from the command line: exit codes, JSON, stdin, bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor import cli
from tests.unit.cli_guard import assert_usage_error, no_launch  # noqa: F401  (autouse fixture)

CRASH = ("[rank1]: Traceback (most recent call last):\n"
         "[rank1]:   File \"/job/train.py\", line 7, in <module>\n"
         "[rank1]: ValueError: bad batch on rank 1\n"
         "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6528. GLHF\n")


def test_a_failed_job_exits_critical_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "job.log"
    log.write_text(CRASH)
    out = tmp_path / "why.json"
    assert cli.main(["explain", str(log), "--json", str(out)]) == 2
    screen = capsys.readouterr().out
    assert "RUN003" in screen and "ValueError: bad batch on rank 1" in screen and "first error per rank" in screen
    data = json.loads(out.read_text())
    assert data["schema"] == "ddpdoctor.explain/1" and data["exit_code"] == 2 and data["verdict"] == "critical"
    (first,) = [f for f in data["findings"] if f["code"] == "RUN003"]
    assert first["ranks"] == [1] and set(first["evidence"]["affected_ranks"]) == {"0"}
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][0]["first_error"]["signature"] == "gloo_peer_closed"


def test_a_log_with_nothing_known_says_so_and_exits_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "job.log"
    log.write_text("step 1 loss 2.3\nstep 2 loss 2.1\n")
    assert cli.main(["explain", str(log)]) == 0
    screen = capsys.readouterr().out
    assert "LOG000" in screen and "No known failure signature" in screen


def test_stdin_plain_and_gzip(tmp_path: Path) -> None:
    for n, data in enumerate((CRASH.encode(), gzip.compress(CRASH.encode()))):
        out = tmp_path / f"o{n}.json"  # one each: --json never overwrites without --force
        proc = subprocess.run([sys.executable, "-m", "ddpdoctor", "explain", "-", "--json", str(out)],
                              input=data, capture_output=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert json.loads(out.read_text())["findings"][0]["ranks"] == [1]


@pytest.mark.parametrize("argv, words", [
    (["explain"], ["LOG"]),
    (["explain", "/nonexistent/x.log"], ["/nonexistent/x.log", "no such file"]),
    (["explain", "-", "-"], ["standard input", "once"]),
    (["explain", "x.log", "--json", "/nonexistent/dir/o.json"], ["--json", "does not exist"]),
    (["explain", "x.log", "--world-size", "0"], ["--world-size", "out of range"]),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]) -> None:
    assert_usage_error(capsys, argv, words)


def test_world_size_flag_counts_ranks_that_printed_nothing(tmp_path: Path) -> None:
    """Ranks 0-2 timed out in the same collective; rank 3 printed nothing: only --world-size knows it exists."""
    log = tmp_path / "job.log"
    log.write_text("".join(
        f"[rank{r}]:[E1123 10:00:0{r}.0 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600010 "
        "milliseconds before timing out.\n" for r in range(3)))
    from ddpdoctor.explain.command import explain

    assert explain([str(log)]).explanation.findings[0].code == "RUN008"
    named = explain([str(log)], world_size=4).explanation.findings[0]
    assert named.code == "RUN004" and named.ranks == (3,)


def test_srun_naming_a_task_that_exited_non_zero_is_that_ranks_failure(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "slurm-123.out"
    log.write_text("srun: error: node7: task 3: Exited with exit code 1\n"
                   "srun: error: node7: task 2: Exited with exit code 0\n")
    assert cli.main(["explain", str(log), "--json", str(tmp_path / "e.json")]) == 2
    first = json.loads((tmp_path / "e.json").read_text())["findings"][0]
    assert (first["code"], first["ranks"], first["title"]) == ("RUN002", [3], "Rank 3 (node7) exited with code 1")


def test_the_terminal_keeps_the_first_cause_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from ddpdoctor.core.findings import Finding, Severity
    from ddpdoctor.render.console import render_findings

    found = [Finding("RUN009", Severity.CRITICAL, "the desync", "explain"),
             Finding("RUN002", Severity.CRITICAL, "an exit after it", "explain"),
             Finding("LOG000", Severity.INFO, "context", "explain")]
    console = Console(record=True, width=100)
    render_findings(found, console, keep_order=True)
    text = console.export_text()
    assert text.index("the desync") < text.index("an exit after it") < text.index("context")
    console = Console(record=True, width=100)
    render_findings(found, console)  # check's tables sort by code within a severity
    text = console.export_text()
    assert text.index("an exit after it") < text.index("the desync")


def test_no_title_has_a_placeholder_left_in_it() -> None:
    from ddpdoctor.explain.command import explain

    root = Path(__file__).parent.parent / "fixtures" / "explain"
    logs = sorted(p for p in (root / "real").glob("*.log")) + sorted((root / "published").glob("*.log"))
    assert len(logs) > 40
    for log in logs:
        for f in explain([str(log)]).explanation.findings:
            assert "?" not in f.title and "{" not in f.title, (log.name, f.title)


@pytest.mark.parametrize("line, title", [
    ("[rank1]: RuntimeError: Address already in use", "The rendezvous port is already in use on rank 1"),
    ("[rank1]: torch.distributed.DistBackendError: NCCL error in: /pt/ProcessGroupNCCL.cpp:1970, unhandled cuda "
     "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
     "CUDA error on rank 1: NCCL's unhandled cuda error (NCCL_DEBUG=WARN prints which CUDA call failed)"),
])
def test_a_message_that_leaves_a_value_out_gives_a_title_without_a_hole(tmp_path: Path, line: str,
                                                                          title: str) -> None:
    from ddpdoctor.explain.command import explain

    (tmp_path / "x.log").write_text(line + "\n")
    assert explain([str(tmp_path / "x.log")]).explanation.findings[0].title == title


def test_srun_tasks_over_torchrun_are_nodes_even_without_labels(tmp_path: Path) -> None:
    # `srun torchrun ...` on two nodes, no --label: srun's task 1 is node02's torchrun, not rank 1.
    from ddpdoctor.explain.command import explain

    log = tmp_path / "slurm-9.out"
    log.write_text(
        "E1123 10:00:00.000000 4242 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -9) "
        "local_rank: 1 (pid: 5151) of binary: /usr/bin/python\n"
        "Root Cause (first observed failure):\n"
        "[0]:\n"
        "  time      : 2026-11-23_10:00:00\n"
        "  host      : node02\n"
        "  rank      : 5 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 5151)\n"
        "  error_file: <N/A>\n"
        "  traceback : Signal 9 (SIGKILL) received by PID 5151\n"
        "srun: error: node02: task 1: Exited with exit code 1\n")
    findings = explain([str(log)]).explanation.findings
    assert [(f.code, f.ranks) for f in findings] == [("LOG012", (5,))], [(f.code, f.title) for f in findings]
