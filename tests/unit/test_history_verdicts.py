"""history/verdicts.py on synthetic fleets with noise: drift named at the run it began, lemons named,
rising counters named, and a healthy noisy fleet named nowhere (3 and 50 nodes)."""

from __future__ import annotations

import random
import time
from typing import Optional

import pytest

from ddpdoctor.core.findings import Severity
from ddpdoctor.history.store import FindingRow, History, Measurement, NodeRow, RunRow
from ddpdoctor.history.verdicts import Rules, binomial_tail, change_point, judge, since

DAY = 86400.0
T0 = 1_700_000_000.0


def _fleet(nodes: int, runs: int, *, seed: int, noise: float = 0.03, slow: Optional[dict[str, tuple[int, float]]] = None,
           per_node_runs: bool = False, gpus: int = 2,
           slow_gpus: Optional[dict[tuple[str, int], tuple[int, float]]] = None) -> History:
    """`runs` runs of `nodes` nodes with `gpus` GPUs each (speed 100 +- noise, busbw 20 +- noise).

    slow: node -> (first slow run, factor); slow_gpus: the same for one GPU, (node, index) -> ...
    per_node_runs: each run is one node's (a prolog), else one run holds every node (a multi-node check)."""
    rng = random.Random(seed)
    slow, slow_gpus = slow or {}, slow_gpus or {}
    names = [f"node{i:02d}" for i in range(nodes)]
    h = History(path="synthetic", schema_version=1, runs=[], nodes=[], measurements=[], findings=[])
    for i in range(runs):
        groups = [[n] for n in names] if per_node_runs else [names]
        for j, group in enumerate(groups):
            run_id = f"r{i:03d}-{j:02d}"
            h.runs.append(RunRow(run_id, T0 + i * DAY + j * 60, "check", "ok", 0, len(group) * gpus, "0.1.0"))
            for node in group:
                h.nodes.append(NodeRow(run_id, node, "0-1"))
                first, factor = slow.get(node, (10**9, 1.0))
                scale = factor if i >= first else 1.0
                for g in range(gpus):
                    gpu_first, gpu_factor = slow_gpus.get((node, g), (10**9, 1.0))
                    speed = 100.0 * scale * (gpu_factor if i >= gpu_first else 1.0) * (1 + rng.gauss(0, noise))
                    h.measurements.append(Measurement(run_id, node, g, f"GPU-{node}-{g}", "H100", "compute_speed",
                                                      speed, "TFLOP/s"))
                h.measurements.append(Measurement(run_id, node, None, None, "H100", "busbw_gbs",
                                                  20.0 * (1 + rng.gauss(0, noise)), "GB/s"))
    return h


def _codes(findings, code):
    return [f for f in findings if f.code == code]


@pytest.mark.parametrize("nodes", [3, 50])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_node_drifting_at_run_10_of_20_is_named_at_run_10_and_no_other(nodes, seed):
    history = _fleet(nodes, 20, seed=seed, slow={"node01": (10, 0.8)})
    verdicts = judge(history)
    drift = _codes(verdicts.findings, "HIS001")
    assert [f.nodes for f in drift] == [("node01",)], [f.title for f in drift]
    started = int(drift[0].evidence["since_run"][1:4])
    assert abs(started - 10) <= 1, drift[0].evidence
    assert drift[0].evidence["metric"] == "compute_speed" and 15 <= drift[0].evidence["drop_pct"] <= 25
    assert verdicts.exit_code == 1 and verdicts.summaries[0].node == "node01"


def test_drift_between_prolog_runs_of_one_node_each():
    """Each node recorded alone (a prolog): the fleet median is the other nodes' latest runs."""
    history = _fleet(3, 20, seed=5, slow={"node02": (10, 0.7)}, per_node_runs=True)
    drift = _codes(judge(history).findings, "HIS001")
    assert [f.nodes for f in drift] == [("node02",)]
    assert drift[0].evidence["since_run"] == "r010-02"


@pytest.mark.parametrize("nodes", [3, 50])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_healthy_noisy_fleet_gets_no_verdict(nodes, seed):
    verdicts = judge(_fleet(nodes, 20, seed=seed, noise=0.04))
    assert verdicts.findings == [], [f.title for f in verdicts.findings]
    assert verdicts.exit_code == 0 and len(verdicts.summaries) == nodes


@pytest.mark.parametrize("nodes", [3, 50])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_gpu_of_8_drifting_at_run_10_of_20_is_named_with_its_node_and_nothing_else(nodes, seed):
    history = _fleet(nodes, 20, seed=seed, gpus=8, slow_gpus={("node01", 5): (10, 0.8)})
    verdicts = judge(history)
    assert [(f.code, f.nodes, f.evidence.get("gpu")) for f in verdicts.findings] == [
        ("HIS001", ("node01",), "GPU-node01-5")], [f.title for f in verdicts.findings]
    drift = verdicts.findings[0]
    assert drift.title.startswith("node01 GPU GPU-node01-5: compute speed")
    assert abs(int(drift.evidence["since_run"][1:4]) - 10) <= 1 and 15 <= drift.evidence["drop_pct"] <= 25
    row = verdicts.summaries[0]  # the node's row first, its GPU row carries the verdict
    assert row.node == "node01" and [g.gpu for g in row.gpus] == [f"GPU-node01-{g}" for g in range(8)]
    trend = row.gpus[5].trend_pct
    assert [g.gpu for g in row.gpus if g.findings] == ["GPU-node01-5"] and trend is not None and trend < -10
    assert all(not g.findings for s in verdicts.summaries[1:] for g in s.gpus)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_whole_node_of_8_gpus_drifting_is_named_once_as_the_node(seed):
    verdicts = judge(_fleet(3, 20, seed=seed, gpus=8, slow={"node02": (10, 0.8)}))
    drift = _codes(verdicts.findings, "HIS001")
    assert [(f.nodes, f.evidence.get("gpu")) for f in drift] == [(("node02",), None)], [f.title for f in drift]
    named = drift[0].evidence["gpus_drifted"]  # those of its GPUs whose own series shows it (noise may hide one)
    assert len(named) >= 6 and set(named) <= {f"GPU-node02-{g}" for g in range(8)}, named
    assert verdicts.findings == drift and abs(int(drift[0].evidence["since_run"][1:4]) - 10) <= 1


@pytest.mark.parametrize("nodes", [3, 50])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_healthy_noisy_fleet_of_8_gpu_nodes_gets_no_verdict_per_gpu(nodes, seed):
    verdicts = judge(_fleet(nodes, 20, seed=seed, gpus=8, noise=0.04))
    assert verdicts.findings == [], [f.title for f in verdicts.findings]
    assert sum(len(s.gpus) for s in verdicts.summaries) == 8 * nodes


def test_the_whole_fleet_slowing_is_not_drift():
    """A driver upgrade that slows every node moves the fleet median with them."""
    history = _fleet(3, 20, seed=7, slow={f"node{i:02d}": (10, 0.7) for i in range(3)})
    assert _codes(judge(history).findings, "HIS001") == []


def test_a_slow_patch_the_node_recovered_from_is_not_drift():
    history = _fleet(3, 20, seed=8, slow={"node01": (5, 0.7)})
    for i, m in enumerate(history.measurements):  # back to normal from run 9 on
        if m.node == "node01" and m.metric == "compute_speed" and int(m.run_id[1:4]) >= 9:
            history.measurements[i] = Measurement(m.run_id, m.node, m.rank, m.gpu, m.model, m.metric,
                                                  m.value / 0.7, m.unit)
    assert _codes(judge(history).findings, "HIS001") == []


def test_change_point_needs_runs_before_and_after():
    rules = Rules()
    assert change_point([1.0, 1.0, 1.0, 0.7, 0.7, 0.7], rules) == 3
    assert change_point([1.0, 1.0, 1.0, 1.0, 0.7, 0.7], rules) is None  # two slow runs: not yet
    assert change_point([1.0, 1.0, 0.7, 0.7, 0.7], rules) is None  # two runs of baseline: not enough
    assert change_point([1.0, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0, 1.0], rules) is None  # one slow run is noise
    assert change_point([1.0, 1.0, 1.0, 0.7, 1.0, 0.7, 0.7, 0.7], rules) == 3  # one good run inside does not reset


def _with_critical(history: History, counts: dict[str, int], seed: int) -> History:
    rng = random.Random(seed)
    by_node: dict[str, list[str]] = {}
    for row in history.nodes:
        by_node.setdefault(row.node, []).append(row.run_id)
    for node, k in counts.items():
        for run_id in rng.sample(by_node[node], k):
            history.findings.append(FindingRow(run_id, "BW001", "critical", node, 0, "wrong all-reduce result"))
    return history


@pytest.mark.parametrize("nodes", [3, 50])
def test_a_lemon_with_5_of_10_critical_runs_is_named_against_peers_with_0_or_1(nodes):
    rng = random.Random(nodes)
    counts = {f"node{i:02d}": rng.choice((0, 1)) for i in range(nodes)}
    counts["node02"] = 5
    verdicts = judge(_with_critical(_fleet(nodes, 10, seed=21), counts, seed=22))
    lemons = _codes(verdicts.findings, "HIS002")
    assert [f.nodes for f in lemons] == [("node02",)], [f.title for f in lemons]
    assert lemons[0].severity == Severity.CRITICAL and lemons[0].evidence["critical_runs"] == 5
    assert verdicts.exit_code == 2


def test_no_lemon_below_the_minimum_runs_or_counts():
    few = _with_critical(_fleet(3, 4, seed=3), {"node00": 4}, seed=1)  # 4 of 4, but only 4 runs
    assert _codes(judge(few).findings, "HIS002") == []
    two = _with_critical(_fleet(3, 10, seed=3), {"node00": 2}, seed=1)  # 2 of 10 vs 0: too few to say
    assert _codes(judge(two).findings, "HIS002") == []


def test_binomial_tail():
    assert binomial_tail(0, 10, 0.3) == pytest.approx(1.0)
    assert binomial_tail(10, 10, 0.5) == pytest.approx(0.5 ** 10)
    assert binomial_tail(5, 10, 0.05) == pytest.approx(6.4e-5, rel=0.03)


def _counter(history: History, node: str, gpu: str, metric: str, values: list[float]) -> None:
    for run, value in zip(history.runs, values):
        history.measurements.append(Measurement(run.run_id, node, 0, gpu, "H100", metric, value, "count"))


def test_rising_counters_are_named_per_gpu_with_the_severity_of_the_counter():
    history = _fleet(3, 6, seed=4)
    _counter(history, "node00", "GPU-a", "ecc_uncorrected_aggregate", [0, 0, 1, 1, 3, 4])
    _counter(history, "node01", "GPU-b", "remapped_rows_pending", [0, 1, 1, 2, 2, 2])
    _counter(history, "node02", "GPU-c", "ecc_uncorrected_aggregate", [2, 2, 2, 2, 2, 2])  # old errors, not rising
    _counter(history, "node02", "GPU-d", "retired_pages", [0, 0, 0, 0, 0, 5])  # one jump: not "keeps rising"
    found = {f.nodes[0]: f for f in _codes(judge(history).findings, "HIS003")}
    assert sorted(found) == ["node00", "node01"]
    assert found["node00"].severity == Severity.CRITICAL and found["node01"].severity == Severity.WARN
    rises = found["node00"].evidence["rises"]["ecc_uncorrected_aggregate"]
    assert [r["run_id"] for r in rises] == ["r002-00", "r004-00", "r005-00"]


def test_since_keeps_the_later_runs_and_their_rows():
    history = _fleet(3, 10, seed=1)
    later = since(history, T0 + 5 * DAY)
    assert len(later.runs) == 5 and {m.run_id for m in later.measurements} == {r.run_id for r in later.runs}


def test_50_nodes_by_100_runs_is_judged_in_seconds():
    history = _fleet(50, 100, seed=9, slow={"node07": (60, 0.8)})
    began = time.perf_counter()
    verdicts = judge(history)
    took = time.perf_counter() - began
    assert [f.nodes for f in verdicts.findings] == [("node07",)]
    assert took < 30, took  # 15 000 measurements; about 0.3 s on one core


# -- `ddpdoctor history` on a real store -------------------------------------------------
def _store(tmp_path, history: History) -> str:
    from ddpdoctor.history.store import RunRows, append

    path = str(tmp_path / "history.db")
    for run in history.runs:
        append(path, RunRows(run, [n for n in history.nodes if n.run_id == run.run_id],
                             [m for m in history.measurements if m.run_id == run.run_id],
                             [f for f in history.findings if f.run_id == run.run_id]))
    return path


def test_the_command_names_the_drifting_node_in_json_and_exit_code(tmp_path, capsys):
    import json

    from ddpdoctor.cli import main

    store = _store(tmp_path, _fleet(3, 20, seed=1, slow={"node01": (10, 0.8)}))
    out = tmp_path / "verdicts.json"
    assert main(["history", store, "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert [(f["code"], f["nodes"]) for f in data["findings"]] == [("HIS001", ["node01"])]
    assert data["runs"] == 20 and data["nodes"][0]["node"] == "node01" and data["nodes"][0]["trend_pct"] < -10
    assert "node01" in capsys.readouterr().out
    assert main(["history", store, "--node", "node00"]) == 0  # judged against the fleet, shown alone
    assert main(["history", store, "--since", "2023-11-30"]) == 0  # 4 runs left, all after the change: no drift


def test_the_command_shows_a_drifting_gpu_under_its_node(tmp_path, capsys):
    import json

    from ddpdoctor.cli import main

    store = _store(tmp_path, _fleet(3, 20, seed=2, gpus=8, slow_gpus={("node01", 5): (10, 0.8)}))
    out = tmp_path / "verdicts.json"
    assert main(["history", store, "--json", str(out)]) == 1
    row = json.loads(out.read_text())["nodes"][0]
    assert row["node"] == "node01" and len(row["gpus"]) == 8
    assert [(g["gpu"], g["findings"]) for g in row["gpus"] if g["findings"]] == [("GPU-node01-5", ["HIS001"])]
    assert row["gpus"][5]["trend_pct"] < -10 and abs(row["trend_pct"]) < 10  # the node as a whole did not move
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("node01"))
    assert lines[at + 1].split()[:2] == ["GPU", "GPU-node01-5"] and "HIS001" in lines[at + 1]


@pytest.mark.parametrize("case", ["missing", "corrupt", "newer", "unknown-node", "bad-date", "plot"])
def test_bad_input_is_one_line_and_exit_3(tmp_path, capsys, case):
    import importlib.util
    import sqlite3

    from ddpdoctor.cli import main

    store = _store(tmp_path, _fleet(3, 2, seed=1))
    args = ["history", store]
    if case == "missing":
        args = ["history", str(tmp_path / "nope.db")]
    elif case == "corrupt":
        (tmp_path / "bad.db").write_bytes(b"not a database" * 100)
        args = ["history", str(tmp_path / "bad.db")]
    elif case == "newer":
        with sqlite3.connect(store) as conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    elif case == "unknown-node":
        args += ["--node", "node99"]
    elif case == "bad-date":
        args += ["--since", "last tuesday"]
    elif case == "plot":
        if importlib.util.find_spec("matplotlib") is not None:
            pytest.skip("matplotlib is installed: --plot works")
        args += ["--plot", str(tmp_path / "h.png")]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddpdoctor: error: "), err
