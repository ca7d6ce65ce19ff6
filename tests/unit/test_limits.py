"""The limits probe judged on readings recorded from real limited processes on the project's VM
(tests/fixtures/limits/: each file says how it was made), and the readings themselves."""

from __future__ import annotations

import copy
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Severity
from ddpdoctor.measure import limits as measure
from ddpdoctor.measure.limits import LimitsFacts
from ddpdoctor.probes import DEFAULT_PROBES, get_probe
from ddpdoctor.probes.base import RunView, diagnose_safely
from ddpdoctor.probes.limits import judge

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "limits"


def _load(name: str) -> tuple[dict[str, Any], RunView]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    hosts = {int(r): h for r, h in data.get("hosts", {}).items()} or {0: "vm", 1: "vm"}
    return data["facts"], RunView(world_size=data.get("world_size", 2), hosts=hosts)


def _judge(facts: dict[str, Any], run: RunView) -> dict[str, Any]:
    found = diagnose_safely(get_probe("limits"), facts, run)
    assert not [f for f in found if f.code == "RUN011"], found
    return {f.code: f for f in found}


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_recorded_facts_round_trip_byte_for_byte(name):
    facts, _ = _load(name)
    for value in facts.values():
        assert LimitsFacts.from_json(value).to_json() == value


def test_a_64mb_shm_and_ulimit_n_40_are_named_with_their_values():
    found = _judge(*_load("check_shm64_nofile40"))
    assert sorted(found) == ["LIM001", "LIM002"]
    shm, nofile = found["LIM001"], found["LIM002"]
    assert shm.evidence["shm_size_bytes"] == 64 << 20 and "64.0 MiB free" in shm.title
    # No GPU here: only the loader needs it, and check assumes the loader: a warning, not critical.
    assert shm.severity == Severity.WARN and shm.evidence["nccl_shm_bytes"] == 0
    assert "Bus error" in shm.evidence["expected_errors"] and "--shm-size" in shm.fix and "medium: Memory" in shm.fix
    assert nofile.evidence["nofile_soft"] == 40 and "limited to 40" in nofile.title
    assert nofile.severity == Severity.WARN  # check's own ranks ran under it: the estimates make it short
    assert "Too many open files" in nofile.evidence["expected_errors"] and "ulimit -n" in nofile.fix
    assert shm.ranks == nofile.ranks == (0, 1) and shm.nodes == ("vm",)


def test_the_healthy_node_gives_only_the_all_clear():
    found = _judge(*_load("check_healthy"))
    assert list(found) == ["LIM000"] and found["LIM000"].severity == Severity.OK


def test_pids_memory_and_quota_cgroups_are_named():
    found = _judge(*_load("pids_memory_quota"))
    assert sorted(found) == ["LIM004", "LIM005", "LIM006"]
    pids = found["LIM004"]
    assert pids.evidence["pids_max"] == 24 and pids.evidence["room"] == 22 and pids.severity == Severity.WARN
    assert "can't start new thread" in pids.evidence["expected_errors"]
    mem = found["LIM005"]
    assert mem.evidence["memory_max_bytes"] == 512 << 20 and mem.evidence["needed_bytes"] > 512 << 20
    quota = found["LIM006"]
    assert quota.evidence["cpu_quota_cpus"] == 0.5 and "cpu.max" in quota.fix  # the stragglers' quota fix, reused


def test_memlock_is_judged_only_where_an_rdma_device_is():
    facts, run = _load("pids_memory_quota")  # recorded under `ulimit -l 64`; the VM has no RDMA device
    assert "LIM003" not in _judge(facts, run)
    with_ib = copy.deepcopy(facts)
    for f in with_ib.values():
        f["rdma_devices"], f["gpus"] = ["mlx5_0", "mlx5_1"], 8
    found = _judge(with_ib, run)["LIM003"]
    assert found.severity == Severity.CRITICAL and found.evidence["memlock_soft_bytes"] == 65536
    assert "ibv_reg_mr failed" in found.evidence["expected_errors"] and "memlock=-1" in found.fix
    for f in with_ib.values():
        f["gpus"] = 0
    assert _judge(with_ib, run)["LIM003"].severity == Severity.INFO


def test_nproc_holds_a_non_root_user_and_never_root():
    facts, run = _load("nproc_nonroot")
    found = _judge(facts, run)["LIM004"]
    assert found.evidence["nproc_soft"] == 16 and found.evidence["uid"] == 65534 and "ulimit -u" in found.fix
    as_root = copy.deepcopy(facts)
    for f in as_root.values():
        f["uid"] = 0
    assert "LIM004" not in _judge(as_root, run)


def test_nccl_needs_shm_for_each_gpu_rank_and_a_known_loader_is_critical():
    facts, run = _load("check_healthy")
    small = copy.deepcopy(facts)
    for f in small.values():
        f["shm"] = {"path": "/dev/shm", "size_bytes": 64 << 20, "free_bytes": 64 << 20}
        f["gpus"] = 2
    found = _judge(small, run)["LIM001"]
    assert found.severity == Severity.CRITICAL and found.evidence["nccl_shm_bytes"] == 2 * judge.NCCL_SHM_PER_RANK
    assert "unable to extend /dev/shm" in found.evidence["expected_errors"]
    known = copy.deepcopy(small)
    for f in known.values():
        f["gpus"], f["loader_workers"] = 0, 4
    found = _judge(known, run)["LIM001"]
    assert found.severity == Severity.CRITICAL and "as the job's loader has" in found.evidence["dataloader"]


def test_a_limit_below_what_the_ranks_hold_is_critical():
    facts, run = _load("check_shm64_nofile40")
    tight = copy.deepcopy(facts)
    for f in tight.values():
        f["nofile"] = {"soft": 12, "hard": 12}
    assert _judge(tight, run)["LIM002"].severity == Severity.CRITICAL


def test_environment_that_names_absent_devices_or_switches_transports_off():
    facts, run = _load("check_healthy")
    env = copy.deepcopy(facts)
    for f in env.values():
        f["rdma_devices"] = ["mlx5_0"]
        f["env"] = {"NCCL_IB_HCA": "mlx4_0:1,mlx5", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0",
                    "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_IB_DISABLE": "1"}
    found = diagnose_safely(get_probe("limits"), env, run)
    hca = [f for f in found if f.code == "LIM007"]
    assert len(hca) == 1 and hca[0].evidence["absent"] == ["mlx4_0"] and hca[0].ranks == (0, 1)
    info = sorted(f.evidence["variable"] for f in found if f.code == "LIM008")
    assert info == ["CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE"]  # SHM_DISABLE=0 is unset
    assert all(f.severity == Severity.INFO and f.why and f.fix for f in found if f.code == "LIM008")
    exact = copy.deepcopy(env)
    for f in exact.values():
        f["env"] = {"NCCL_IB_HCA": "=mlx5"}
    assert [f.evidence["absent"] for f in diagnose_safely(get_probe("limits"), exact, run) if f.code == "LIM007"] == [
        ["mlx5"]]
    for f in exact.values():
        f["env"] = {"NCCL_IB_HCA": "^mlx5_0"}
    assert not [f for f in diagnose_safely(get_probe("limits"), exact, run) if f.code == "LIM007"]


def test_low_disk_space_where_the_job_writes_is_information():
    facts, run = _load("check_healthy")
    low = copy.deepcopy(facts)
    low["1"]["disks"] = [{"path": "/tmp", "size_bytes": 10 << 30, "free_bytes": 200 << 20}]
    found = [f for f in diagnose_safely(get_probe("limits"), low, run) if f.code == "LIM009"]
    assert len(found) == 1 and found[0].severity == Severity.INFO and found[0].ranks == (1,)
    assert "LIM000" in {f.code for f in diagnose_safely(get_probe("limits"), low, run)}


def test_one_finding_per_node_with_all_its_ranks():
    facts, _ = _load("check_shm64_nofile40")
    four = {str(r): dict(copy.deepcopy(facts[str(r % 2)]), rank=r, local_world_size=2, world_size=4) for r in range(4)}
    run = RunView(world_size=4, hosts={0: "a", 1: "a", 2: "b", 3: "b"})
    shm = [f for f in diagnose_safely(get_probe("limits"), four, run) if f.code == "LIM001"]
    assert [(f.ranks, f.nodes) for f in shm] == [((0, 1), ("a",)), ((2, 3), ("b",))]


def test_unreadable_or_foreign_facts_never_raise():
    run = RunView(world_size=2, hosts={0: "vm", 1: "vm"})
    found = diagnose_safely(get_probe("limits"), {"0": {"shm": 5, "nofile": "x"}, "1": {}}, run)
    assert [f.code for f in found] == ["LIM000"]
    odd = {"shm": {"size_bytes": "x", "free_bytes": [1]}, "nofile": {"soft": True}, "rdma_devices": [3],
           "cgroup": {"pids_max": "max", "cpu_quota": {}}, "disks": [{"free_bytes": "0"}], "env": {"NCCL_IB_HCA": 5},
           "threads": "many", "local_world_size": 2}
    found = diagnose_safely(get_probe("limits"), {"0": odd, "1": odd}, run)
    assert [f.code for f in found] == ["LIM000"], found


def test_limits_is_a_default_probe_that_trains_nothing():
    assert "limits" in DEFAULT_PROBES and get_probe("limits").trains is False


def test_the_readings_are_this_process_s_own_and_cheap():
    start = time.perf_counter()
    f = measure.read_limits(None)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, elapsed  # a few ms: files, getrlimit and statvfs, no subprocess
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert f.nofile.soft == (None if soft == resource.RLIM_INFINITY else soft)
    assert f.shm.path == "/dev/shm" and (f.shm.free_bytes is not None or f.shm.error)
    assert f.open_files and f.threads and f.uid == os.getuid()
    assert f.disks and f.disks[-1].path == measure.write_paths(None)[-1]
    assert facts_by_rank(LimitsFacts, {"0": f.to_json()})[0].to_json() == f.to_json()


def test_a_cgroup_v1_unlimited_value_reads_as_no_limit(tmp_path):
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "pids.max").write_text("max\n")
    assert measure._first(str(tmp_path), "memory.max", "memory.limit_in_bytes") is None
    assert measure._first(str(tmp_path), "pids.max") is None


def test_the_history_records_each_node_s_limits_once():
    from ddpdoctor.history.record import from_report, from_snapshot

    facts, _ = _load("check_shm64_nofile40")
    report = {"command": ["ddpdoctor", "check"], "verdict": "warning", "exit_code": 1, "world_size": 2,
              "ranks": [{"rank": 0, "host": "vm"}, {"rank": 1, "host": "vm"}], "by_node": [{"host": "vm", "ranks": "0-1"}],
              "probes": [{"name": "limits", "facts": facts}]}
    rows = {m.metric: m for m in from_report(report).measurements}
    assert rows["shm_size_bytes"].value == 64 << 20 and rows["nofile_soft"].value == 40
    assert all(m.rank is None and m.node == "vm" for m in rows.values())
    assert "pids_max" not in rows  # unlimited: not recorded (absent is not zero)
    snapshot = {"host": "vm", "created": "2026-11-27T10:00:00+00:00", "probes": {"homogeneity": [{"rank": 0}],
                                                                                 "limits": [facts["0"]]}}
    assert {m.metric for m in from_snapshot(snapshot).measurements} >= {"shm_free_bytes", "nofile_soft"}


def test_the_callback_judges_the_limits_with_the_job_s_own_loader(monkeypatch):
    import torch
    from torch import nn

    from ddpdoctor.callback.doctor import Doctor
    from ddpdoctor.probes.limits import probe

    facts, _ = _load("check_shm64_nofile40")  # the readings of a rank under a 64 MB /dev/shm and ulimit -n 40
    monkeypatch.setattr(probe, "read_limits", lambda _path: LimitsFacts.from_json(copy.deepcopy(facts["0"])))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), num_workers=4)
    doctor = Doctor(nn.Linear(2, 2), loader=loader, raise_on_finding=True)  # never raised at construction
    try:
        found = {f.code: f for f in doctor.report()}
    finally:
        doctor.close()
    shm = found["LIM001"]
    assert shm.severity == Severity.CRITICAL and "4 DataLoader worker(s) per rank" in shm.evidence["dataloader"]
    assert "as the job's loader has" in shm.evidence["dataloader"]
    assert found["LIM002"].severity == Severity.CRITICAL and found["LIM002"].evidence["nofile_soft"] == 40
    assert "LIM000" not in found


def test_the_callback_says_nothing_on_a_healthy_node():
    from torch import nn

    from ddpdoctor.callback.doctor import Doctor

    doctor = Doctor(nn.Linear(2, 2))
    try:
        assert not [f for f in doctor.report() if f.code.startswith("LIM") and f.severity >= Severity.WARN]
    finally:
        doctor.close()


def test_the_tightest_limit_on_the_way_up_is_taken_with_its_own_usage(tmp_path):
    """A Slurm job's memory limit sits on the job's group, above the step's; a pod's pids.max on the pod's."""
    job = tmp_path / "job"
    step = job / "step"
    step.mkdir(parents=True)
    (job / "memory.max").write_text(str(8 << 30))
    (job / "memory.current").write_text(str(3 << 30))
    (job / "pids.max").write_text("100\n")
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text(str(1 << 30))
    (step / "pids.max").write_text("max\n")
    assert measure._memory(str(step), root=str(tmp_path)) == (8 << 30, 3 << 30)
    assert measure._pids_max(str(step), root=str(tmp_path)) == 100
    (step / "memory.max").write_text(str(2 << 30))
    assert measure._memory(str(step), root=str(tmp_path)) == (2 << 30, 1 << 30)
