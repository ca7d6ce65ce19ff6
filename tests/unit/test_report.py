"""ddpdoctor.core.report: the JSON report built from a hand-made RunRecord, and its atomic write."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import pytest

from ddpdoctor import __version__
from ddpdoctor.core import files as report_mod
from ddpdoctor.session import reporter
from ddpdoctor.core.findings import EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, Severity
from ddpdoctor.probes import get_probe
from ddpdoctor.core.report import SCHEMA, write_json
from ddpdoctor.session.reporter import build_report
from ddpdoctor.core.run_record import ExitInfo, RunRecord
from ddpdoctor.runtime.workload import StepTiming, WorkloadResult

T0 = 1_700_000_000.0
SHA = "9f2c" * 16
COMMAND = ["ddpdoctor", "check", "--nproc", "2"]


def smoke_facts(rank: int, **overrides: Any) -> dict[str, Any]:
    steps = [StepTiming(0.2, 1.9, 4.6, 2.4 + 0.1 * i, 0.8, 7.7 + 0.1 * i + 0.2 * rank) for i in range(5)]
    result = WorkloadResult(device="cpu", backend="gloo", parameters=399_370, gradient_bytes=1_597_480,
                            batch_size=32, steps=steps, warmup_steps=2, comm_calls=14, comm_bytes=11_182_360,
                            param_sha256=SHA, param_sum=-12.35, peak_mem_bytes=400_000_000,
                            loss_first=2.34, loss_last=2.29)
    facts = asdict(result)
    facts["steps"] = [asdict(s) for s in steps]
    facts.update(overrides)
    return facts


def stages(upto: str, status: str = "ok") -> list[dict[str, Any]]:
    names = ["rendezvous", "init", "probe:ddp-smoke", "ddp", "train", "verify", "report"]
    names = names[: names.index(upto) + 1]
    return [{"name": n, "started": T0 + i, "ended": T0 + i + 0.5, "status": status if n == upto else "ok",
             "detail": ""} for i, n in enumerate(names)]


def healthy_record(world: int = 2) -> RunRecord:
    record = RunRecord(world_size=world, mode="ddpdoctor", probes=("ddp-smoke",), started=T0, ended=T0 + 9.5,
                       default_host="node-a")
    for r in range(world):
        record.hellos[r] = {"rank": r, "host": "node-a" if r < 2 else "node-b", "pid": 500 + r, "local_rank": r % 2,
                            "local_world_size": 2, "world_size": world, "mode": "ddpdoctor", "cuda_devices": 0,
                            "t": T0 + 0.4, "torch": "2.13.0"}
        record.timelines[r] = stages("report")
        record.heartbeats[r] = {"t": T0 + 8, "stage": "report", "stage_started": T0 + 7.5, "collective": None,
                                "seq": 12}
        record.exits[r] = ExitInfo(0, t=T0 + 9)
        record.done.add(r)
    record.results["ddp-smoke"] = {r: smoke_facts(r) for r in range(world)}
    return record


def crashed_record() -> RunRecord:
    """Rank 1 crashed in train (injected); rank 0 timed out waiting in the all-reduce."""
    record = healthy_record(2)
    record.done = set()
    record.faults = ("crash:rank=1:stage=train",)
    record.timelines = {0: stages("train", "timeout"), 1: stages("train", "running")}
    record.timeouts = {0: {"stage": "train", "deadline_s": 30.0, "t": T0 + 36,
                           "collective": {"op": "ddp_gradient_allreduce", "seq": 6, "step": 1}, "seq": 6,
                           "stack": "  File \"workload.py\", line 494 in run_workload\n"}}
    record.exits = {1: ExitInfo(86, t=T0 + 5, log_tail=["ddpdoctor: injected crash on rank 1 in stage train"]),
                    0: ExitInfo(124, t=T0 + 36.2)}
    record.results = {"ddp-smoke": {}}
    return record


def test_healthy_report_json():
    report = build_report(healthy_record(), backend="gloo", device="cpu", command=COMMAND)
    data = report.to_json()
    assert data["schema"] == SCHEMA == "ddpdoctor.report/1"
    assert data["ddpdoctor_version"] == __version__
    assert (data["exit_code"], data["verdict"]) == (EXIT_OK, "ok")
    assert (data["mode"], data["world_size"], data["backend"], data["device"]) == ("ddpdoctor", 2, "gloo", "cpu")
    assert data["command"] == COMMAND
    assert data["nodes"] == ["node-a"]
    assert data["duration_s"] == 9.5
    assert data["injected_faults"] == [] and data["interrupted"] is None
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r, rank in enumerate(data["ranks"]):
        assert rank["state"] == "ok"
        assert rank["host"] == "node-a" and rank["node_index"] == 0
        assert rank["pid"] == 500 + r and rank["local_rank"] == r
        assert rank["last_stage"] == "report"
        assert rank["exit"]["code"] == 0
        assert rank["timeline"][0]["name"] == "rendezvous"
    assert [f["code"] for f in data["findings"]] == ["DDP001"]
    probe, = data["probes"]
    assert probe["name"] == "ddp-smoke" and probe["status"] == "ok"
    assert probe["findings"] == ["DDP001"]
    assert set(probe["facts"]) == {"0", "1"}  # string keys: JSON objects
    assert probe["facts"]["1"]["param_sha256"] == SHA
    again = json.loads(json.dumps(data, allow_nan=False))
    assert again["ranks"][1]["state"] == "ok"


def test_report_nodes_keep_rank_order():
    report = build_report(healthy_record(4), command=COMMAND)
    data = report.to_json()
    assert data["nodes"] == ["node-a", "node-b"]
    assert [r["node_index"] for r in data["ranks"]] == [0, 0, 1, 1]


def test_crash_report_json():
    report = build_report(crashed_record(), backend="gloo", device="cpu", command=COMMAND)
    data = json.loads(json.dumps(report.to_json()))
    assert (data["exit_code"], data["verdict"]) == (EXIT_CRITICAL, "critical")
    assert report.verdict == Severity.CRITICAL
    assert {r["rank"]: r["state"] for r in data["ranks"]} == {0: "timeout", 1: "crash"}
    assert data["ranks"][0]["collective_in_flight"] == {"op": "ddp_gradient_allreduce", "seq": 6, "step": 1}
    assert data["ranks"][1]["exit"]["code"] == 86
    assert data["ranks"][1]["last_stage"] == "train"
    assert data["injected_faults"] == ["crash:rank=1:stage=train"]
    assert [f["code"] for f in data["findings"]] == ["RUN002", "RUN010"]  # shown order: the crash (critical) first
    probe, = data["probes"]
    assert probe["status"] == "not-run" and probe["findings"] == [] and probe["facts"] == {}


def test_partial_results_make_the_probe_incomplete():
    record = crashed_record()
    record.results["ddp-smoke"] = {0: smoke_facts(0)}
    data = build_report(record, command=COMMAND).to_json()
    probe, = data["probes"]
    assert probe["status"] == "incomplete"
    assert probe["findings"] == ["DDP005"]
    assert list(probe["facts"]) == ["0"]
    assert data["exit_code"] == EXIT_CRITICAL


def test_interrupted_before_any_cause_is_unknown():
    record = healthy_record(2)
    record.done = set()
    record.results = {"ddp-smoke": {}}
    record.interrupted = "SIGTERM"
    record.exits = {r: ExitInfo(-15, t=T0 + 4, killed_by_us="interrupted by SIGTERM") for r in range(2)}
    report = build_report(record, command=COMMAND)
    data = report.to_json()
    assert [f["code"] for f in data["findings"]] == ["RUN006"]
    assert data["exit_code"] == EXIT_UNKNOWN == 3
    assert data["interrupted"] == "SIGTERM"
    assert {r["state"] for r in data["ranks"]} == {"interrupted"}


def test_interrupted_after_a_crash_is_critical():
    record = crashed_record()
    record.interrupted = "SIGINT"
    assert build_report(record, command=COMMAND).exit_code == EXIT_CRITICAL


def test_a_failing_diagnosis_becomes_run011_and_keeps_the_facts(monkeypatch):
    def broken(facts, run):
        raise ValueError("boom: facts from rank 3 look odd")

    monkeypatch.setattr(get_probe("ddp-smoke"), "diagnose", broken)
    record = healthy_record(2)
    report = build_report(record, command=COMMAND)
    section, = report.probes
    assert section.status == "ok"
    assert section.facts == record.results["ddp-smoke"]
    failed, = section.findings
    assert failed.code == "RUN011" and failed.severity == Severity.WARN and failed.probe == "ddp-smoke"
    assert "ValueError: boom: facts from rank 3 look odd" in failed.title
    assert any("ValueError" in line for line in failed.evidence["traceback"])
    data = json.loads(json.dumps(report.to_json()))
    assert data["exit_code"] == EXIT_WARNING and data["verdict"] == "warning" and data["worst_severity"] == "warn"
    assert data["probes"][0]["findings"] == ["RUN011"]
    assert data["probes"][0]["facts"]["0"]["param_sha256"] == SHA


# -- write_json -------------------------------------------------------------------

def test_write_json_writes_complete_json_and_no_temp_file(tmp_path):
    path = tmp_path / "run.report.json"
    assert write_json(build_report(healthy_record(), command=COMMAND), str(path)) == str(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["schema"] == SCHEMA and data["exit_code"] == EXIT_OK
    assert path.read_text(encoding="utf-8").endswith("}\n")
    assert sorted(os.listdir(tmp_path)) == ["run.report.json"]


OLD = "old content that is not JSON and is longer than nothing " * 100


def test_write_json_with_overwrite_replaces_an_existing_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(OLD)
    write_json(build_report(crashed_record(), command=COMMAND), str(path), overwrite=True)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["exit_code"] == EXIT_CRITICAL
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


def test_write_json_never_replaces_a_file_that_appeared_meanwhile(tmp_path, capsys):
    """The CLI refused existing files before the run; one there now was made during it
    (another job, a second run): it is kept, and the report goes to a sibling name."""
    path = tmp_path / "r.json"
    path.write_text(OLD)
    (tmp_path / "r.1.json").write_text("also taken")
    written = write_json(build_report(crashed_record(), command=COMMAND), str(path))
    assert written == str(tmp_path / "r.2.json")
    assert path.read_text() == OLD and (tmp_path / "r.1.json").read_text() == "also taken"
    assert json.loads((tmp_path / "r.2.json").read_text())["exit_code"] == EXIT_CRITICAL
    assert sorted(os.listdir(tmp_path)) == ["r.1.json", "r.2.json", "r.json"]
    err = capsys.readouterr().err
    assert err == (f"ddpdoctor: {path} appeared while ddpdoctor ran and was not overwritten: "
                   f"wrote {tmp_path / 'r.2.json'} instead (pass --force to overwrite)\n")


@pytest.mark.parametrize("force", [False, True])
def test_write_outputs_follows_the_force_setting(tmp_path, capsys, force):
    """The reporter (launcher, or rank 0 under torchrun) writes through write_outputs with the
    CheckConfig it parsed from the same argv: --force reaches it as cfg.force."""
    from ddpdoctor.runtime.config import CheckConfig

    path = tmp_path / "r.json"
    path.write_text(OLD)
    cfg = CheckConfig(probes=("ddp-smoke",), json_path=str(path), force=force)
    reporter.write_outputs(build_report(healthy_record(), command=COMMAND), cfg)
    if force:
        assert json.loads(path.read_text())["verdict"] == "ok" and sorted(os.listdir(tmp_path)) == ["r.json"]
        assert capsys.readouterr().err == ""
    else:
        assert path.read_text() == OLD and json.loads((tmp_path / "r.1.json").read_text())["verdict"] == "ok"
        assert "wrote " + str(tmp_path / "r.1.json") in capsys.readouterr().err


@pytest.mark.parametrize("name, sibling", [("r.json", "r.1.json"), ("report", "report.1"),
                                           ("bw.tar.gz", "bw.tar.1.gz"), (".hidden", ".hidden.1")])
def test_sibling_names_keep_the_suffix(name, sibling):
    names = report_mod.sibling_names(name)
    assert next(names) == name and next(names) == sibling


def test_write_json_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_json(build_report(healthy_record(), command=COMMAND), "here.json")
    assert json.loads((tmp_path / "here.json").read_text())["verdict"] == "ok"
    assert sorted(os.listdir(tmp_path)) == ["here.json"]


def test_write_json_failure_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_mod.os, "replace", failing_replace)
    with pytest.raises(OSError):
        write_json(build_report(healthy_record(), command=COMMAND), str(path), overwrite=True)
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


def test_a_failed_link_leaves_nothing(tmp_path, monkeypatch):
    def failing_link(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_mod.os, "link", failing_link)
    with pytest.raises(OSError):
        write_json(build_report(healthy_record(), command=COMMAND), str(tmp_path / "r.json"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_without_o_tmpfile_a_named_temp_file_does_the_same(tmp_path, monkeypatch, capsys, overwrite):
    """Not Linux, or a file system without O_TMPFILE: a hidden temp file, then link or rename."""
    monkeypatch.delattr(report_mod.os, "O_TMPFILE", raising=False)
    path = tmp_path / "r.json"
    path.write_text(OLD)
    old = os.umask(0o022)
    try:
        written = write_json(build_report(healthy_record(), command=COMMAND), str(path), overwrite=overwrite)
    finally:
        os.umask(old)
    assert written == str(path if overwrite else tmp_path / "r.1.json")
    assert json.loads(open(written).read())["verdict"] == "ok"
    assert os.stat(written).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(tmp_path)) == (["r.json"] if overwrite else ["r.1.json", "r.json"])
    assert (path.read_text() == OLD) != overwrite


@pytest.mark.parametrize("overwrite", [False, True])
def test_when_proc_cannot_name_an_unnamed_file_a_temp_file_does(tmp_path, monkeypatch, overwrite):
    """O_TMPFILE opens, but linking /proc/self/fd/N fails (hidepid, a sandbox): the write is
    redone through a named temp file instead of losing the report."""
    import errno

    real_link = os.link

    def no_proc_links(src, dst, **kwargs):
        if str(src).startswith("/proc/"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(report_mod.os, "link", no_proc_links)
    path = tmp_path / "r.json"
    path.write_text(OLD)
    written = write_json(build_report(healthy_record(), command=COMMAND), str(path), overwrite=overwrite)
    assert written == str(path if overwrite else tmp_path / "r.1.json")
    assert json.loads(open(written).read())["verdict"] == "ok"
    assert sorted(os.listdir(tmp_path)) == (["r.json"] if overwrite else ["r.1.json", "r.json"])


def test_a_file_system_without_hard_links_still_never_overwrites(tmp_path, monkeypatch):
    """EPERM from link() (FAT, some FUSE and network file systems): the name is claimed with
    O_EXCL, which fails on an existing file, and the complete temp file renamed onto the claim."""
    import errno

    monkeypatch.delattr(report_mod.os, "O_TMPFILE", raising=False)

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(report_mod.os, "link", no_links)
    path = tmp_path / "r.json"
    path.write_text(OLD)
    written = write_json(build_report(healthy_record(), command=COMMAND), str(path))
    assert written == str(tmp_path / "r.1.json") and path.read_text() == OLD
    assert json.loads((tmp_path / "r.1.json").read_text())["verdict"] == "ok"
    assert sorted(os.listdir(tmp_path)) == ["r.1.json", "r.json"]


_KILLED_WRITER = """
import os, sys, time
from ddpdoctor.core import files as report
def half_then_wait(fd, data):
    os.write(fd, data[: len(data) // 2])
    print("half", flush=True)
    time.sleep(60)
report._write_all = half_then_wait
report.atomic_write_bytes(b"x" * (4 << 20), sys.argv[1], overwrite=sys.argv[2] == "1")
"""


def _o_tmpfile_works(folder) -> bool:
    try:
        os.close(os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600))
        return os.path.isdir("/proc/self/fd")
    except (AttributeError, OSError):
        return False


@pytest.mark.parametrize("existing", [False, True])
def test_a_writer_killed_mid_write_leaves_no_partial_or_temp_file(tmp_path, existing):
    """SIGKILL while half the data is written: no try/finally runs. The data was in a file
    with no name (O_TMPFILE), so the folder holds exactly what it held before."""
    import signal
    import subprocess
    import sys

    if not _o_tmpfile_works(str(tmp_path)):
        pytest.skip("no O_TMPFILE here: the named temp file of the fallback would survive a SIGKILL")
    path = tmp_path / "r.json"
    if existing:
        path.write_text(OLD)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), "1" if existing else "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "half\n"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(os.listdir(tmp_path)) == (["r.json"] if existing else [])
    assert not existing or path.read_text() == OLD


def test_report_with_nan_loss_is_strict_json(tmp_path):
    record = healthy_record(2)
    record.results["ddp-smoke"][1] = smoke_facts(1, loss_last=float("nan"))
    report = build_report(record, command=COMMAND)
    assert "DDP004" in [f.code for f in report.findings]
    path = tmp_path / "r.json"
    write_json(report, str(path))

    def reject(constant):
        raise ValueError(f"not JSON: {constant}")

    json.loads(path.read_text(), parse_constant=reject)


def test_report_file_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "r.json"
        write_json(build_report(healthy_record(), command=COMMAND), str(path))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_probe_cut_off_by_the_signal_does_not_make_the_interrupt_critical():
    # SIGTERM while rank 1 was still in ddp-smoke: its missing result (DDP005, critical) is the
    # interruption again; the verdict stays "could not tell" (found by the fault matrix, verify x sigterm).
    record = healthy_record(2)
    record.done = set()
    record.results["ddp-smoke"].pop(1)
    record.interrupted = "SIGTERM"
    record.exits = {r: ExitInfo(-15, t=T0 + 4, killed_by_us="interrupted by SIGTERM") for r in range(2)}
    report = build_report(record, command=COMMAND)
    assert "DDP005" in [f.code for f in report.findings] and report.probes[0].status == "incomplete"
    assert report.exit_code == EXIT_UNKNOWN


def test_a_finished_probes_critical_finding_still_counts_when_interrupted():
    record = healthy_record(2)
    record.results["ddp-smoke"][1]["param_sha256"] = "f" * 64  # weights diverged: DDP002, critical
    record.interrupted = "SIGTERM"
    assert build_report(record, command=COMMAND).exit_code == EXIT_CRITICAL
