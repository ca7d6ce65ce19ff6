"""The history store: rows round-trip typed; concurrent writers lose nothing; a store it cannot
write (newer schema, corrupt, locked past the deadline, read-only path) is refused in one line
and left byte for byte as it was; the commands still write their report first."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sqlite3
import time
from pathlib import Path

import pytest

from ddpdoctor.core.codes import finding
from ddpdoctor.history import recording, record, schema
from ddpdoctor.history.store import (FindingRow, HistoryError, Measurement, NodeRow, RunRow, RunRows, append,
                                     read_history)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _rows(run_id: str, node: str = "node-a", speed: float = 1e9) -> RunRows:
    return RunRows(RunRow(run_id, time.time(), "check", "warning", 1, 2, "0.1.0", "job-7"),
                   [NodeRow(run_id, node, "0-1")],
                   [Measurement(run_id, node, r, None, "cpu", "compute_speed", speed + r, "flop/s") for r in (0, 1)],
                   [FindingRow(run_id, "HOM001", "warn", node, 1, "rank 1 is slow")])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_rows_round_trip_typed(tmp_path: Path) -> None:
    store = str(tmp_path / "h.db")
    first, second = _rows("r1"), _rows("r2", node="node-b", speed=2e9)
    append(store, first)
    append(store, second)
    history = read_history(store)
    assert history.schema_version == schema.SCHEMA_VERSION
    assert [r.run_id for r in history.runs] == ["r1", "r2"]
    assert history.runs[0] == first.run
    assert history.nodes == first.nodes + second.nodes
    assert history.measurements == first.measurements + second.measurements
    assert history.findings == first.findings + second.findings
    with sqlite3.connect(store) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "1"


def _writer(store: str, who: int, runs: int) -> None:
    for i in range(runs):
        append(store, _rows(f"w{who}-{i}", node=f"node-{who}"), deadline_s=60)


def test_concurrent_writers_lose_no_row(tmp_path: Path) -> None:
    store = str(tmp_path / "h.db")
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(store, who, 15)) for who in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    history = read_history(store)
    assert len(history.runs) == 60 and len({r.run_id for r in history.runs}) == 60
    assert len(history.nodes) == 60 and len(history.measurements) == 120 and len(history.findings) == 60
    for who in range(4):  # each run whole: its node, both ranks' speeds, its finding
        assert sum(m.node == f"node-{who}" for m in history.measurements) == 30


def test_newer_schema_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    append(str(path), _rows("r1"))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
        conn.execute("ALTER TABLE runs ADD COLUMN future TEXT")
    before = _digest(path)
    with pytest.raises(HistoryError, match="newer than this ddpdoctor knows") as exc:
        append(str(path), _rows("r2"))
    assert "\n" not in str(exc.value)
    assert _digest(path) == before
    # Columns are only ever added: what this version knows is still read.
    assert [r.run_id for r in read_history(str(path)).runs] == ["r1"]


def test_corrupt_store_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    path.write_bytes(b"not sqlite at all\n" * 300)
    before = _digest(path)
    with pytest.raises(HistoryError, match="not a readable SQLite store"):
        append(str(path), _rows("r1"))
    with pytest.raises(HistoryError, match="not a readable SQLite store"):
        read_history(str(path))
    assert _digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.db"]


def test_store_locked_past_the_deadline(tmp_path: Path) -> None:
    store = str(tmp_path / "h.db")
    append(store, _rows("r1"))
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        began = time.monotonic()
        with pytest.raises(HistoryError, match="stayed locked for 0.5s"):
            append(store, _rows("r2"), deadline_s=0.5)
        assert time.monotonic() - began < 5
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    append(store, _rows("r3"))  # the lock gone, the store takes runs again and kept the first
    assert [r.run_id for r in read_history(store).runs] == ["r1", "r3"]


def test_unwritable_paths(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="does not exist"):
        append(str(tmp_path / "no" / "h.db"), _rows("r1"))
    with pytest.raises(HistoryError, match="is a folder"):
        append(str(tmp_path), _rows("r1"))
    with pytest.raises(HistoryError, match="cannot be written or opened"):
        append("/proc/self/ddpdoctor-history.db", _rows("r1"))  # a folder no one may create files in
    with pytest.raises(HistoryError, match="no history store"):
        read_history(str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_read_only_store_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    append(str(path), _rows("r1"))
    path.chmod(0o444)
    with pytest.raises(HistoryError, match="cannot be written"):
        append(str(path), _rows("r2"))
    assert [r.run_id for r in read_history(str(path)).runs] == ["r1"]


def test_migrations_only_add() -> None:
    """A store is migrated forward, never rewritten: every statement creates or adds."""
    for version, statements in schema.MIGRATIONS.items():
        for statement in statements:
            words = statement.split()
            assert (words[:2] == ["CREATE", "TABLE"] or words[:2] == ["CREATE", "INDEX"]
                    or (words[:2] == ["ALTER", "TABLE"] and words[3:5] == ["ADD", "COLUMN"])), (version, statement)
            assert "IF NOT EXISTS" in statement or words[0] == "ALTER"
    assert sorted(schema.MIGRATIONS) == list(range(1, schema.SCHEMA_VERSION + 1))


def test_a_store_keeps_what_others_added(tmp_path: Path) -> None:
    """A fleet's own table or column in the store survives appending (nothing is recreated)."""
    store = str(tmp_path / "h.db")
    append(store, _rows("r1"))
    with sqlite3.connect(store) as conn:
        conn.execute("CREATE TABLE ours (x TEXT)")
        conn.execute("INSERT INTO ours VALUES ('kept')")
        conn.execute("ALTER TABLE runs ADD COLUMN cluster TEXT")
        conn.execute("UPDATE runs SET cluster = 'east'")
    append(store, _rows("r2"))
    with sqlite3.connect(store) as conn:
        assert conn.execute("SELECT x FROM ours").fetchall() == [("kept",)]
        assert conn.execute("SELECT run_id, cluster FROM runs ORDER BY rowid").fetchall() == [("r1", "east"), ("r2", None)]


def test_bench_report_rows() -> None:
    report = json.loads((FIXTURES / "allreduce" / "bench-2rank-gloo.json").read_text())
    rows = record.from_report(report, label="nightly")
    assert rows.run.command == "allreduce-bench" and rows.run.world_size == report["world_size"]
    assert rows.run.verdict == report["verdict"] and rows.run.label == "nightly"
    assert [n.node for n in rows.nodes] == report["nodes"]
    metrics = {m.metric: m.value for m in rows.measurements}
    sizes = sorted({int(e["size_bytes"]) for e in report["probes"][-1]["facts"]["0"]["results"]})
    assert {f"busbw_gbs@{s}" for s in sizes} <= set(metrics)
    assert metrics["busbw_gbs"] == metrics[f"busbw_gbs@{sizes[-1]}"] > 0
    # all_reduce on 2 ranks: busbw = algbw * 2(n-1)/n = algbw
    assert metrics["algbw_gbs"] == pytest.approx(metrics["busbw_gbs"])
    bw000 = [f for f in report["findings"] if f["code"] == "BW000"]
    if bw000 and "busbw_at_largest_gbps" in bw000[0]["evidence"]:  # the probe's own figure agrees
        assert metrics["busbw_gbs"] == pytest.approx(bw000[0]["evidence"]["busbw_at_largest_gbps"], rel=0.01)
    per_rank = [f for f in report["findings"] if f["ranks"]]
    assert len(rows.findings) == sum(len(f["ranks"]) for f in per_rank) + sum(
        max(1, len(f["nodes"])) for f in report["findings"] if not f["ranks"])


def test_snapshot_rows_gpu_counters() -> None:
    snap = json.loads((FIXTURES / "gpu_outputs" / "smi_qx_modeled_a100x2.snapshot.json").read_text())
    rows = record.from_snapshot(snap)
    assert rows.run.command == "snapshot" and rows.nodes[0].node == snap["host"]
    by = {(m.rank, m.metric): m for m in rows.measurements}
    gpu1 = snap["probes"]["homogeneity"][1]["gpu"]
    assert by[(1, "remapped_rows_pending")].value == float(gpu1["remapped_rows"]["pending"])
    assert by[(1, "ecc_uncorrected_aggregate")].gpu == gpu1["uuid"]
    assert by[(1, "compute_speed")].model == gpu1["name"]
    assert by[(1, "compute_speed")].value == max(snap["probes"]["homogeneity"][1]["measured"]["matmul"]["round_flops_per_s"])
    assert (0, "retired_pages") not in by  # NVML could not read them: absent, not zero


def test_callback_rows() -> None:
    class Window:
        def __init__(self, rank: int, host: str, step: list[float], wait: list[float]) -> None:
            self.rank, self.host, self.step_ms, self.wait_ms, self.wait_measured = rank, host, step, wait, True

    windows = [{0: Window(0, "a", [10, 12], [1, 1]), 1: Window(1, "b", [30, 31], [0, 0])},
               {0: Window(0, "a", [11], [2]), 1: Window(1, "b", [29], [0])}]
    found = [finding("DOC003", "callback", "rank 1 is slow", ranks=[1])]
    rows = record.from_callback(windows, found, world_size=2, started_at=5.0)
    assert rows.run.command == "callback" and rows.run.verdict == "warning" and rows.run.exit_code == 1
    assert [(f.code, f.node, f.rank) for f in rows.findings] == [("DOC003", "b", 1)]
    assert {(n.node, n.ranks) for n in rows.nodes} == {("a", "0"), ("b", "1")}
    values = {(m.node, m.metric): m.value for m in rows.measurements}
    assert values[("a", "step_ms")] == 11 and values[("b", "step_ms")] == 30 and values[("a", "wait_ms")] == 1


def test_recording_writes_the_report_before_the_store(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"x" * 4096)
    report = json.loads((FIXTURES / "allreduce" / "bench-2rank-gloo.json").read_text())
    rec = recording.begin(str(bad), str(tmp_path / "report.json"), force=False)
    Path(rec.report_path).write_text(json.dumps(report))
    problem = rec.finish()
    assert problem is not None and "not a readable SQLite store" in problem and "\n" not in problem
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert not os.path.exists(rec.folder) and bad.read_bytes() == b"x" * 4096
    idle = recording.begin(str(tmp_path / "h.db"), None, force=False)
    assert idle.finish() is None and not (tmp_path / "h.db").exists()  # another rank reported: nothing to record


def test_snapshot_command_records_or_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddpdoctor.cli import main

    store = tmp_path / "h.db"
    assert main(["snapshot", "--no-measure", "--out", str(tmp_path / "s1.json"), "--history", str(store)]) == 0
    assert [r.command for r in read_history(str(store)).runs] == ["snapshot"]
    capsys.readouterr()
    store.write_bytes(b"y" * 2048)
    assert main(["snapshot", "--no-measure", "--out", str(tmp_path / "s2.json"), "--history", str(store)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable SQLite store" in err and "the snapshot file is written" in err
    assert json.loads((tmp_path / "s2.json").read_text())["host"]


def test_callback_records_at_close_and_a_bad_store_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ddpdoctor.callback.doctor import Doctor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "fs"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))

        def train(store: Path, steps: int) -> None:
            doctor = Doctor(model, history=str(store), every=2, check_every_s=0)
            for _ in range(steps):
                doctor.step_begin()
                model(torch.ones(4, 2)).sum().backward()
                doctor.step_end()
            doctor.close()

        train(tmp_path / "h.db", 6)
        history = read_history(str(tmp_path / "h.db"))
        assert [r.command for r in history.runs] == ["callback"] and history.runs[0].world_size == 1
        assert {m.metric for m in history.measurements} == {"step_ms", "wait_ms"}
        assert all(m.value > 0 and m.rank == 0 for m in history.measurements)
        bad = tmp_path / "bad.db"
        bad.write_bytes(b"z" * 2048)
        train(bad, 4)  # no exception: training goes on
        assert "this run is not in the history" in caplog.text and bad.read_bytes() == b"z" * 2048
    finally:
        dist.destroy_process_group()


MOUNTS = """/dev/sda1 / ext4 rw 0 0
server:/export /shared nfs4 rw 0 0
/dev/sdb /shared/scratch ext4 rw 0 0
mds@tcp:/fs /lustre lustre rw 0 0
srv:/x /mnt/my\\040dir nfs rw 0 0
"""


def test_network_filesystems_are_told_apart() -> None:
    from ddpdoctor.history.store import on_network_filesystem as shared

    assert shared("/shared/h.db", MOUNTS) and shared("/lustre/a/b/h.db", MOUNTS) and shared("/mnt/my dir/h.db", MOUNTS)
    assert not shared("/shared/scratch/h.db", MOUNTS)  # the deeper mount point decides
    assert not shared("/sharedx/h.db", MOUNTS) and not shared("/tmp/h.db", MOUNTS)


def test_a_store_on_a_network_filesystem_keeps_the_rollback_journal(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdoctor.history import store as store_module

    monkeypatch.setattr(store_module, "on_network_filesystem", lambda path, mounts=None: True)
    path = str(tmp_path / "h.db")
    append(path, _rows("r1"))
    append(path, _rows("r2"))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert [r.run_id for r in read_history(path).runs] == ["r1", "r2"]


def test_a_path_that_cannot_be_a_store_is_refused_before_anything_runs(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from ddpdoctor.cli import main

    began = time.monotonic()
    for argv in (["check", "--history", str(tmp_path / "no" / "h.db")], ["allreduce-bench", "--history", ""],
                 ["snapshot", "--out", str(tmp_path / "s.json"), "--history", str(tmp_path)]):
        capsys.readouterr()
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "history store" in err, err
    assert time.monotonic() - began < 5 and not (tmp_path / "s.json").exists()  # nothing was measured
