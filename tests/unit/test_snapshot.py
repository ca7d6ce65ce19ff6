"""Snapshots: taking one on this machine, writing it, and loading snapshots and reports back.

take_snapshot really reads this (CPU-only) machine and, with measure=True, really times
a matmul (~0.5 s). Files are written under tmp_path only.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import socket
from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.redact import REDACTED
from ddpdoctor.snapshot import REPORT_SCHEMA, SCHEMA, load_inputs, take_snapshot, write_snapshot
from ddpdoctor.measure.throughput import ROUNDS, MatmulThroughput

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "homogeneity"
CPU = FIXTURES / "cpu_vm_2core_recorded.json"
H100, H100_2 = FIXTURES / "dgx_h100_healthy.json", FIXTURES / "dgx_h100_healthy_node2.json"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


cpu_only = pytest.mark.skipif(_cuda(), reason="checks the CPU snapshot of a machine without a GPU")


def recorded() -> dict[str, Any]:
    return json.loads(CPU.read_text())


def write(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def rank_entry(rank: int, host: str) -> dict[str, Any]:
    """A live rank's homogeneity facts, as `check --json` stores them under probes[].facts."""
    e = copy.deepcopy(recorded()["probes"]["homogeneity"][0])
    e.update(rank=rank, local_rank=rank % 2, local_world_size=2, world_size=4, host=host, source="rank")
    e["measured"]["step_ms"] = 41.5
    return e


def report(facts: dict[str, dict[str, Any]], *extra_probes: dict[str, Any]) -> dict[str, Any]:
    """The parts of a `ddpdoctor check --json` report (schema ddpdoctor.report/1) that diagnose reads."""
    return {"schema": REPORT_SCHEMA, "ddpdoctor_version": "0.1.0", "world_size": len(facts),
            "verdict": "ok", "exit_code": 0, "findings": [],
            "probes": [{"name": "homogeneity", "status": "ok", "findings": ["HOM000"], "facts": facts},
                       *extra_probes]}


# -- take_snapshot on this machine ---------------------------------------------------------

@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return take_snapshot(measure=True)


@cpu_only
def test_snapshot_without_measuring_reads_one_cpu_entry():
    snap = take_snapshot(measure=False)
    assert snap["schema"] == SCHEMA == "ddpdoctor.snapshot/1"
    assert snap["ddpdoctor_version"] == ddpdoctor.__version__
    assert snap["host"] == socket.gethostname() and snap["measured"] is False
    created = datetime.datetime.fromisoformat(snap["created"])
    assert created.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 120
    assert list(snap["probes"]) == ["homogeneity", "topology", "limits"]
    [limits] = snap["probes"]["limits"]  # this process's own limits, as a rank started here would have them
    assert (limits["rank"], limits["gpus"], limits["shm"]["path"]) == (0, 0, "/dev/shm") and limits["nofile"]
    [topo] = snap["probes"]["topology"]
    # The node's facts, as its local rank 0 reads them; no placement: a snapshot is not a rank.
    assert topo["node"]["numa"] and isinstance(topo["node"]["nics"], list) and "unknown" in topo["placement"]
    assert (topo["rank"], topo["device"], topo["load"]) == (0, "cpu", None)
    [entry] = snap["probes"]["homogeneity"]
    assert entry["device"] == "cpu" and entry["gpu"] is None and "measured" not in entry
    assert (entry["rank"], entry["local_rank"], entry["local_world_size"], entry["world_size"]) == (0, 0, 1, 1)
    assert entry["source"] == "snapshot" and entry["host"] == snap["host"]
    assert entry["host_hw"]["cpu_logical_cores"] >= 1 and entry["host_hw"]["ram_bytes"] > 2**28
    assert entry["software"]["torch"]


@cpu_only
def test_measured_snapshot_has_a_real_matmul_and_the_recorded_shape(measured):
    assert measured["measured"] is True
    [entry] = measured["probes"]["homogeneity"]
    mm = entry["measured"]["matmul"]
    assert list(mm) == [f.name for f in dataclasses.fields(MatmulThroughput)]
    assert (mm["device"], mm["dtype"], mm["size"]) == ("cpu", "float32", 384)
    assert len(mm["round_flops_per_s"]) == ROUNDS == 8
    assert all(x > 1e7 for x in mm["round_flops_per_s"]) and mm["flops_per_s"] > 1e7
    assert mm["reps"] >= 3 * ROUNDS  # at least 3 repetitions a round
    assert abs(mm["median_ms"] - 2e3 * 384**3 / mm["flops_per_s"]) < 1e-3
    # The recorded fixture is what this version writes: same keys, section by section.
    rec = recorded()
    rec_entry = rec["probes"]["homogeneity"][0]
    assert list(measured) == list(rec) and list(entry) == list(rec_entry)
    for section in ("software", "host_hw", "measured"):
        assert list(entry[section]) == list(rec_entry[section]), section


# -- write and load back -----------------------------------------------------------------

@cpu_only
def test_written_snapshot_loads_back_as_the_same_facts(measured, tmp_path):
    path = write_snapshot(measured, str(tmp_path / "node.json"))
    assert path == str(tmp_path / "node.json")
    text = Path(path).read_text()
    assert text.endswith("\n") and json.loads(text) == measured
    inputs = load_inputs([path])
    assert inputs.files == [path] and inputs.world_size == 1
    assert inputs.facts == {name: {0: measured["probes"][name][0]} for name in ("homogeneity", "topology", "limits")}
    assert inputs.hosts == {0: measured["host"]}


@cpu_only
def test_default_file_name_names_the_host(measured, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_snapshot(measured, None)
    assert path == f"ddpdoctor-snapshot-{measured['host']}.json"
    assert json.loads((tmp_path / path).read_text()) == measured
    assert [p.name for p in tmp_path.iterdir()] == [path]  # no temp file left behind


def test_two_files_are_renumbered_file_by_file():
    inputs = load_inputs([str(H100), str(H100_2), str(CPU)])
    facts = inputs.facts["homogeneity"]
    assert sorted(facts) == list(range(17)) and inputs.world_size == 17
    assert [inputs.hosts[r] for r in range(17)] == ["dgx-h100-01"] * 8 + ["dgx-h100-02"] * 8 + ["vm"]
    second = json.loads(H100_2.read_text())["probes"]["homogeneity"]
    for i, entry in enumerate(second):
        assert facts[8 + i] == dict(entry, rank=8 + i)  # everything else as written
    assert facts[16]["rank"] == 16 and facts[16]["source"] == "snapshot"
    assert facts[3]["gpu"]["uuid"] != facts[11]["gpu"]["uuid"]


def test_the_same_host_in_two_files_is_told_apart_by_file_name(tmp_path):
    other = tmp_path / "again.json"
    other.write_text(CPU.read_text())
    inputs = load_inputs([str(CPU), str(other)])
    assert inputs.hosts == {0: "vm", 1: "vm (again.json)"}
    assert inputs.facts["homogeneity"][1]["host"] == "vm (again.json)"


def test_a_check_report_loads_with_its_rank_numbers(tmp_path):
    facts = {str(r): rank_entry(r, "node-a" if r < 2 else "node-b") for r in (3, 1, 0, 2)}  # any key order
    path = write(tmp_path / "r.json", report(facts))
    inputs = load_inputs([path])
    assert inputs.hosts == {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    loaded = inputs.facts["homogeneity"]
    assert sorted(loaded) == [0, 1, 2, 3] and all(loaded[r]["rank"] == r for r in loaded)
    assert loaded[2]["measured"]["step_ms"] == 41.5 and loaded[2]["source"] == "rank"


def test_a_report_after_a_snapshot_continues_the_numbering(tmp_path):
    path = write(tmp_path / "r.json", report({str(r): rank_entry(r, "node-a") for r in range(2)}))
    inputs = load_inputs([str(CPU), path])
    assert inputs.hosts == {0: "vm", 1: "node-a", 2: "node-a"}
    assert [inputs.facts["homogeneity"][r]["source"] for r in range(3)] == ["snapshot", "rank", "rank"]


def test_a_report_with_a_missing_rank_does_not_lose_facts_to_the_next_file(tmp_path):
    # Rank 1 never sent its homogeneity facts (it hung): `check` writes ranks 0 and 2 only.
    path = write(tmp_path / "r.json", report({"0": rank_entry(0, "node-a"), "2": rank_entry(2, "node-b")}))
    inputs = load_inputs([path, str(CPU)])
    assert {r: f["host"] for r, f in inputs.facts["homogeneity"].items()} == {0: "node-a", 2: "node-b", 3: "vm"}
    assert inputs.hosts == {0: "node-a", 2: "node-b", 3: "vm"}


def test_unknown_probes_in_a_file_are_skipped(tmp_path):
    snap = recorded()
    snap["probes"]["nvlink-from-the-future"] = [{"links": 18}]
    path = write(tmp_path / "s.json", snap)
    rep = write(tmp_path / "r.json", report({"0": rank_entry(0, "node-a")},
                                            {"name": "future-probe", "status": "ok", "findings": [],
                                             "facts": {"0": {"x": 1}}}))
    inputs = load_inputs([path, rep])
    assert list(inputs.facts) == ["homogeneity"] and sorted(inputs.facts["homogeneity"]) == [0, 1]


def test_a_file_of_only_unknown_probes_is_a_usage_error(tmp_path):
    snap = recorded()
    snap["probes"] = {"nvlink-from-the-future": [{"links": 18}]}
    path = write(tmp_path / "s.json", snap)
    with pytest.raises(UsageError) as caught:
        load_inputs([path])
    message = str(caught.value)
    assert path in message and "nvlink-from-the-future" in message and "\n" not in message


# -- bad files ---------------------------------------------------------------------------

def _snapshot_body(**change: Any) -> dict[str, Any]:
    return dict(recorded(), **change)


BAD = {
    "missing": (None, "no such file"),
    "folder": ("folder", "is a folder"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00", "is not a text file"),
    "gzip": (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", "is not a text file"),
    "empty": (b"", "is not valid JSON"),
    "truncated": ("truncated", "was it cut short?"),
    "wrong-schema": ({"schema": "ddpdoctor.diagnosis/1", "findings": []},
                     "is not a ddpdoctor snapshot or report (schema 'ddpdoctor.diagnosis/1'"),
    "no-schema": ({"probes": {}}, "(schema None;"),
    "a-list": ([1, 2], "(schema 'list';"),
    "snapshot-probes-a-list": (_snapshot_body(probes=[]), "malformed body"),
    "snapshot-no-probes": ({"schema": SCHEMA, "host": "x"}, "malformed body"),
    "snapshot-entries-not-dicts": (_snapshot_body(probes={"homogeneity": [1, 2]}), "malformed body"),
    "report-probes-a-dict": ({"schema": REPORT_SCHEMA, "probes": {"homogeneity": {}}}, "malformed body"),
    "report-rank-not-a-number": ({"schema": REPORT_SCHEMA, "probes": [{"name": "homogeneity",
                                                                      "facts": {"zero": {}}}]}, "malformed body"),
    "report-probe-without-name": ({"schema": REPORT_SCHEMA, "probes": [{"facts": {"0": {}}}]}, "malformed body"),
    "snapshot-no-entries": (_snapshot_body(probes={"homogeneity": []}), "holds no facts"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_files_are_one_line_usage_errors(kind, tmp_path):
    content, expected = BAD[kind]
    path = tmp_path / f"{kind}.json"
    if content == "folder":
        path.mkdir()
    elif content == "truncated":
        text = H100.read_text()
        path.write_text(text[: len(text) // 2])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(json.dumps(content))
    with pytest.raises(UsageError) as caught:
        load_inputs([str(CPU), str(path)])  # a good file first: the bad one is still named
    message = str(caught.value)
    assert expected in message, message
    assert str(path) in message and "\n" not in message and str(CPU) not in message


# -- secrets never reach the file -----------------------------------------------------------

TOKEN = "hf_" + "Zq7Xw2Vb9Nm4Lk8Jh3Gf6Ds1Ap5"
GH_TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"


@cpu_only
def test_secrets_in_the_environment_never_reach_the_written_file(monkeypatch, tmp_path):
    env = {
        "HF_TOKEN": TOKEN,  # not a training setting: not recorded at all
        "WANDB_API_KEY": "f00dfeedcafe1234f00dfeedcafe1234f00dfeed",
        "CUDA_SECRET_KEY": "s3cr3t-cuda-value",  # a relevant prefix, a secret name
        "NCCL_IB_PASSWORD": "hunter2-nccl",
        "NCCL_NET_PLUGIN_ARGS": f"--token {GH_TOKEN}",  # an innocent name, a token's shape
        "TORCH_NCCL_TRACE_URL": "https://alice:pa55word-xyz@traces.example.com/upload",
        "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p.log",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = write_snapshot(take_snapshot(measure=False), str(tmp_path / "s.json"))
    text = Path(path).read_text()
    for secret in (TOKEN, "f00dfeedcafe", "s3cr3t-cuda-value", "hunter2-nccl", GH_TOKEN, "pa55word-xyz"):
        assert secret not in text, secret
    recorded_env = json.loads(text)["probes"]["homogeneity"][0]["env"]
    assert "HF_TOKEN" not in recorded_env and "WANDB_API_KEY" not in recorded_env
    assert recorded_env["CUDA_SECRET_KEY"] == recorded_env["NCCL_IB_PASSWORD"] == REDACTED
    assert recorded_env["NCCL_NET_PLUGIN_ARGS"] == REDACTED
    assert recorded_env["TORCH_NCCL_TRACE_URL"] == f"https://alice:{REDACTED}@traces.example.com/upload"
    assert recorded_env["NCCL_DEBUG_FILE"] == "/tmp/nccl.%h.%p.log"
    assert recorded_env["NCCL_SOCKET_IFNAME"] == "^lo,docker0"
    assert recorded_env["OMP_NUM_THREADS"] == "1"  # set by the unit tests' conftest


# -- `snapshot --out`: an existing file is never replaced silently ---------------------------------

def _tiny_snapshot() -> dict[str, Any]:
    return {"schema": SCHEMA, "host": socket.gethostname(), "probes": {"homogeneity": [{"device": "cpu"}]}}


@pytest.fixture
def cli_env(monkeypatch):
    """main() sets these for the torch it may import: undone after each test."""
    for name in ("TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


@pytest.fixture
def no_measuring(monkeypatch, cli_env):
    """take_snapshot replaced: these tests are about the file, not the facts (and must not pay for torch)."""
    import ddpdoctor.snapshot

    calls = []
    monkeypatch.setattr(ddpdoctor.snapshot, "take_snapshot", lambda measure=True: calls.append(measure) or _tiny_snapshot())
    return calls


@pytest.mark.parametrize("explicit", [True, False])
def test_an_existing_snapshot_file_is_refused_before_measuring(capsys, tmp_path, monkeypatch, no_measuring, explicit):
    from ddpdoctor import cli

    monkeypatch.chdir(tmp_path)
    name = "node07.json" if explicit else f"ddpdoctor-snapshot-{socket.gethostname()}.json"
    (tmp_path / name).write_text("yesterday's snapshot")
    assert cli.main(["snapshot", *(["--out", name] if explicit else [])]) == 3
    captured = capsys.readouterr()
    assert captured.err == (f"ddpdoctor: error: {name} already exists: pass --force to overwrite it, "
                            "or choose another --out path\n")
    assert no_measuring == [] and (tmp_path / name).read_text() == "yesterday's snapshot"


def test_snapshot_force_overwrites(capsys, tmp_path, no_measuring):
    from ddpdoctor import cli

    path = tmp_path / "node07.json"
    path.write_text("yesterday's snapshot")
    assert cli.main(["snapshot", "--out", str(path), "--force", "--no-measure"]) == 0
    assert json.loads(path.read_text()) == _tiny_snapshot() and no_measuring == [False]
    assert capsys.readouterr().out.startswith(f"ddpdoctor: wrote {path}: 1 device")


def test_a_snapshot_file_that_appears_while_measuring_is_kept(capsys, tmp_path, monkeypatch, cli_env):
    import ddpdoctor.snapshot
    from ddpdoctor import cli

    path = tmp_path / "node07.json"

    def slow_measure(measure=True):
        path.write_text("written by someone else meanwhile")
        return _tiny_snapshot()

    monkeypatch.setattr(ddpdoctor.snapshot, "take_snapshot", slow_measure)
    assert cli.main(["snapshot", "--out", str(path)]) == 0
    captured = capsys.readouterr()
    sibling = tmp_path / "node07.1.json"
    assert path.read_text() == "written by someone else meanwhile"
    assert json.loads(sibling.read_text()) == _tiny_snapshot()
    assert captured.out.startswith(f"ddpdoctor: wrote {sibling}: ")  # says where it really went
    assert f"wrote {sibling} instead" in captured.err


def test_write_snapshot_returns_where_it_went(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("taken")
    assert write_snapshot(_tiny_snapshot(), str(path)) == str(tmp_path / "s.1.json")
    assert write_snapshot(_tiny_snapshot(), str(path), overwrite=True) == str(path)
    assert json.loads(path.read_text()) == _tiny_snapshot()
