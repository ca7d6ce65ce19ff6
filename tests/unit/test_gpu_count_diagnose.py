"""gpu-count's diagnosis on snapshots of all ranks' facts, and the readers it builds on.

The snapshots in tests/fixtures/gpu_count are modeled, not recorded on GPUs (see the README
there), except cpu_vm_2ranks_recorded.json. Variants that differ from a fixture in one
detail are made here, from a copy, the way collect would have recorded that machine:
when ddpdoctor's auto device choice (rank_runtime.choose_backend) runs every rank on CPU,
the facts say device "cpu", no current GPU and no contexts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdoctor.measure import nvml
from ddpdoctor.measure.cuda_visible import parse
from ddpdoctor.measure.device import ENV_KEYS, contexts_of, read_nvml
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.probes import RunView, get_probe

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpu_count"
Facts = dict[int, dict[str, Any]]

HEALTHY = ("h100x8_healthy.json", "a100x8_2node_healthy.json", "rtx5090x2_workstation_healthy.json")
NO_DRIVER = ("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a "
             "driver from http://www.nvidia.com/Download/index.aspx")
NO_GPUS = "No CUDA GPUs are available"


def load(name: str) -> Facts:
    return {int(rank): facts for rank, facts in json.loads((FIXTURES / name).read_text()).items()}


def diagnose(facts: Facts) -> list[Finding]:
    world = max((f.get("world_size") or 0 for f in facts.values()), default=0) or len(facts)
    return get_probe("gpu-count").diagnose(facts, RunView(world_size=world,
                                                         hosts={r: f["host"] for r, f in facts.items()}))


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def only(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def uuid_of(facts: Facts, rank: int) -> str:
    return facts[rank]["torch"]["current"]["uuid"]


def nvml_gpu(facts: Facts, rank: int, index: int) -> dict[str, Any]:
    """The NVML device (PCI order) of rank's node, as torch would list it."""
    d = facts[rank]["nvml"]["devices"][index]
    return {"index": index, "name": d["name"], "uuid": d["uuid"], "pci_bus_id": d["pci_bus_id"]}


def sees(f: dict[str, Any], gpus: list[dict[str, Any]]) -> None:
    """torch on this rank sees exactly `gpus` (renumbered from 0, as CUDA does)."""
    devices = [dict(g, index=i) for i, g in enumerate(gpus)]
    f["torch"].update(device_count=len(devices), devices=devices, cuda_available=bool(devices),
                      unavailable_reason=None if devices else NO_GPUS)
    if not devices:
        f["torch"]["current"] = None


def runs_on(f: dict[str, Any], index: int) -> None:
    f["device"] = f"cuda:{index}"
    f["torch"]["current"] = copy.deepcopy(f["torch"]["devices"][index])
    f["contexts"] = [f["torch"]["current"]["uuid"]]


def all_on_cpu(facts: Facts) -> None:
    for f in facts.values():
        f["device"] = "cpu"
        f["torch"]["current"] = None
        f["contexts"] = []
        for d in f["nvml"]["devices"]:
            d["processes"] = []


def set_env(f: dict[str, Any], **env: str) -> None:
    f["env"].update(env)


def no_trouble(findings: list[Finding]) -> bool:
    return all(f.severity < Severity.WARN for f in findings)


# -- the fixtures themselves -----------------------------------------------------------

def test_every_fixture_has_the_keys_collect_publishes():
    recorded = load("cpu_vm_2ranks_recorded.json")[0]  # written by the real collect on a CPU machine
    for path in sorted(FIXTURES.glob("*.json")):
        for rank, f in load(path.name).items():
            where = f"{path.name} rank {rank}"
            assert set(f) == set(recorded), where
            assert f["rank"] == rank, where
            assert tuple(f["env"]) == ENV_KEYS, where
            assert set(f["torch"]) == set(recorded["torch"]), where
            if f["nvml"]["available"]:
                assert set(f["nvml"]) == {"available", "reason", "driver_version", "cuda_driver_version",
                                          "device_count", "devices"}, where
                assert f["nvml"]["device_count"] == len(f["nvml"]["devices"]), where
                for d in f["nvml"]["devices"]:
                    assert set(d) == {"index", "uuid", "pci_bus_id", "name", "mig_mode", "processes"}, where
                    assert d["uuid"].startswith("GPU-") and d["pci_bus_id"].startswith("00000000:"), where
                # contexts are what contexts_of derives from NVML's process lists
                assert f["contexts"] == contexts_of(f["pid"], f["nvml"]), where


def test_modeled_machines_use_one_uuid_and_bus_id_per_gpu_and_node():
    for name in HEALTHY:
        facts = load(name)
        for host in {f["host"] for f in facts.values()}:
            devices = next(f for f in facts.values() if f["host"] == host)["nvml"]["devices"]
            assert len({d["uuid"] for d in devices}) == len({d["pci_bus_id"] for d in devices}) == len(devices)
        all_uuids = {uuid_of(facts, r) for r in facts}
        assert len(all_uuids) == len(facts), name  # every rank on a GPU of its own


# -- healthy machines ----------------------------------------------------------------

@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_machine_gives_exactly_one_ok(name):
    facts = load(name)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU000"]
    ok = findings[0]
    assert ok.severity == Severity.OK and no_trouble(findings)
    assert ok.ranks == tuple(sorted(facts))
    assert ok.nodes == tuple(sorted({f["host"] for f in facts.values()}))
    assert ok.evidence["gpu_by_rank"] == {r: uuid_of(facts, r) for r in facts}


def test_two_node_job_is_judged_per_node():
    findings = diagnose(load("a100x8_2node_healthy.json"))
    assert findings[0].title == "Each of 16 ranks has its own GPU"
    assert findings[0].nodes == ("dgxa100-001", "dgxa100-002")


def test_slurm_one_gpu_per_task_is_healthy():
    """srun --gpus-per-task=1: each task sees one GPU of its own; ddpdoctor uses cuda:0 on each."""
    facts = load("a100x8_2node_healthy.json")
    for f in facts.values():
        mine = nvml_gpu(facts, f["rank"], f["local_rank"])
        set_env(f, CUDA_VISIBLE_DEVICES=str(f["local_rank"]), SLURM_GPUS_PER_TASK="1")
        sees(f, [mine])
        runs_on(f, 0)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU000"] and findings[0].severity == Severity.OK


def test_no_facts_no_findings():
    assert diagnose({}) == []


# -- GPU000 info: CPU ranks ----------------------------------------------------------

def test_recorded_cpu_ranks_give_info():
    findings = diagnose(load("cpu_vm_2ranks_recorded.json"))
    assert codes(findings) == ["GPU000"]
    assert findings[0].severity == Severity.INFO and findings[0].ranks == (0, 1)
    assert findings[0].evidence["reason"] == ["torch was built without CUDA (a CPU-only wheel)"]
    assert findings[0].evidence["nvml"] == ["NVML unavailable: NVML Shared Library Not Found"]


def test_cuda_torch_on_a_cpu_node_gives_info_not_gpu008():
    facts = load("cpu_vm_2ranks_recorded.json")
    for f in facts.values():
        f["torch"].update(version="2.4.1+cu124", cuda_built="12.4", unavailable_reason=NO_DRIVER)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU000"] and findings[0].severity == Severity.INFO
    assert findings[0].evidence["reason"] == [NO_DRIVER]


# -- GPU001: more local ranks than GPUs ---------------------------------------------

def test_more_local_ranks_than_gpus_gives_gpu001():
    facts = load("rtx5090x2_nproc4.json")  # --nproc 4 on 2 GPUs, every rank sees both
    assert all(f["torch"]["device_count"] == 2 and f["device"] == "cpu" for f in facts.values())
    gpu001 = only(diagnose(facts), "GPU001")
    assert len(gpu001) == 1 and gpu001[0].severity == Severity.CRITICAL
    assert gpu001[0].ranks == (0, 1, 2, 3)
    assert gpu001[0].evidence["local_ranks"] == 4 and gpu001[0].evidence["distinct_gpus"] == 2
    # The ordinal errors of ranks 2 and 3 are this one cause: not reported again.
    assert codes(diagnose(facts)) == ["GPU001"]


# -- GPU002: fewer ranks than GPUs ---------------------------------------------------

def test_fewer_ranks_than_visible_gpus_gives_gpu002():
    findings = diagnose(load("h100x8_nproc2.json"))
    assert codes(findings) == ["GPU002"]
    assert findings[0].severity == Severity.WARN and findings[0].ranks == (0, 1)
    assert findings[0].nodes == ("dgx-h100-01",)
    assert findings[0].evidence == {"local_ranks": 2, "visible_gpus": 8}


# -- GPU003: two ranks on one GPU ----------------------------------------------------

def test_same_visible_device_on_both_ranks_gives_gpu001_with_the_node_count():
    facts = load("rtx5090x2_same_visible_device.json")  # CUDA_VISIBLE_DEVICES=0 on both ranks
    findings = diagnose(facts)
    assert codes(findings) == ["GPU001"]
    assert findings[0].ranks == (0, 1) and findings[0].evidence["distinct_gpus"] == 1
    assert findings[0].evidence["node_gpus"] == 2
    assert "CUDA_VISIBLE_DEVICES" in findings[0].fix


def test_two_ranks_on_the_same_gpu_give_gpu003():
    """Every rank sees all 8 GPUs, but rank 1 selected rank 0's: set_device missing or wrong."""
    facts = load("h100x8_healthy.json")
    facts[1]["torch"]["current"] = copy.deepcopy(facts[0]["torch"]["current"])
    facts[1]["device"] = facts[0]["device"]
    findings = diagnose(facts)
    assert "GPU003" in codes(findings) and "GPU001" not in codes(findings)
    dup = only(findings, "GPU003")[0]
    assert dup.severity == Severity.CRITICAL and dup.ranks == (0, 1)
    assert dup.evidence["gpu_uuid"] == uuid_of(facts, 0)
    assert "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device" in dup.why
    assert "Multiple Ranks are using the same GPU/Partition" in dup.why


def test_same_index_on_two_nodes_is_not_a_duplicate():
    """cuda:0 on node 1 and cuda:0 on node 2 are different GPUs: compared by UUID."""
    facts = load("a100x8_2node_healthy.json")
    assert facts[0]["device"] == facts[8]["device"] == "cuda:0"
    assert "GPU003" not in codes(diagnose(facts))


# -- GPU004: contexts on another rank's GPU ------------------------------------------

def test_contexts_on_gpu0_from_every_rank_give_gpu004():
    facts = load("h100x8_stray_contexts_on_gpu0.json")
    findings = diagnose(facts)
    assert set(codes(findings)) == {"GPU004"}
    assert [f.ranks for f in findings] == [(r,) for r in range(1, 8)]
    gpu0 = uuid_of(facts, 0)
    for f in findings:
        assert f.severity == Severity.CRITICAL
        assert f.evidence == {"own_gpu": uuid_of(facts, f.ranks[0]), "stray_contexts": [gpu0]}
        assert "rank 0's GPU" in f.title


# -- GPU005: CUDA_VISIBLE_DEVICES -----------------------------------------------------

def test_partly_unreadable_visible_devices_warn():
    """--nproc 4 with CUDA_VISIBLE_DEVICES=0,1,x,3: CUDA sees 2 GPUs, so the run falls back to CPU."""
    full = load("h100x8_healthy.json")
    facts = {r: copy.deepcopy(full[r]) for r in range(4)}
    for f in facts.values():
        f.update(world_size=4, local_world_size=4)
        set_env(f, CUDA_VISIBLE_DEVICES="0,1,x,3", LOCAL_WORLD_SIZE="4", WORLD_SIZE="4")
        sees(f, [nvml_gpu(full, 0, 0), nvml_gpu(full, 0, 1)])
    all_on_cpu(facts)
    findings = diagnose(facts)
    warn = [f for f in only(findings, "GPU005") if f.severity == Severity.WARN]
    assert [f.ranks for f in warn] == [(0,), (1,), (2,), (3,)]
    assert warn[0].evidence["used"] == ["0", "1"] and warn[0].evidence["ignored"] == ["x", "3"]
    # 4 ranks, 2 usable GPUs: one cause (GPU001), not an ordinal error per rank.
    assert only(findings, "GPU001")[0].ranks == (0, 1, 2, 3)
    assert set(codes(findings)) == {"GPU005", "GPU001"}


@pytest.mark.parametrize("hidden", ["-1", ""])
def test_visible_devices_hiding_every_gpu_is_critical(hidden):
    facts = load("rtx5090x2_workstation_healthy.json")
    set_env(facts[1], CUDA_VISIBLE_DEVICES=hidden)
    sees(facts[1], [])
    all_on_cpu(facts)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU005"]
    assert findings[0].severity == Severity.CRITICAL and findings[0].ranks == (1,)
    assert findings[0].evidence == {"CUDA_VISIBLE_DEVICES": hidden, "nvml_gpus": 2}


def test_visible_devices_index_past_nvml_count_is_critical():
    """CUDA_VISIBLE_DEVICES=1,2 on a 2-GPU box: CUDA shows GPU 1 only."""
    facts = load("rtx5090x2_workstation_healthy.json")
    set_env(facts[1], CUDA_VISIBLE_DEVICES="1,2")
    sees(facts[1], [nvml_gpu(facts, 1, 1)])
    runs_on(facts[1], 0)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU005"]
    bad = findings[0]
    assert bad.severity == Severity.CRITICAL and bad.ranks == (1,)
    assert bad.title.endswith("does not have: 2")
    assert bad.evidence["nvml_gpus"] == 2 and bad.evidence["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_visible_devices_uuid_of_another_machine_is_critical():
    facts = load("rtx5090x2_workstation_healthy.json")
    elsewhere = uuid_of(load("h100x8_healthy.json"), 3)
    set_env(facts[1], CUDA_VISIBLE_DEVICES=f"{uuid_of(facts, 1)},{elsewhere}")
    sees(facts[1], [nvml_gpu(facts, 1, 1)])
    runs_on(facts[1], 0)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU005"]
    assert findings[0].ranks == (1,) and findings[0].severity == Severity.CRITICAL
    assert elsewhere in findings[0].title
    assert findings[0].evidence["nvml_uuids"] == [d["uuid"] for d in facts[1]["nvml"]["devices"]]


def test_visible_devices_uuid_prefix_is_accepted():
    """CUDA accepts a unique prefix of a GPU UUID."""
    facts = load("rtx5090x2_workstation_healthy.json")
    set_env(facts[1], CUDA_VISIBLE_DEVICES=uuid_of(facts, 1)[:12])
    sees(facts[1], [nvml_gpu(facts, 1, 1)])
    runs_on(facts[1], 0)
    assert codes(diagnose(facts)) == ["GPU000"]


def test_visible_devices_naming_only_missing_gpus_is_gpu005_not_a_driver_problem():
    facts = load("rtx5090x2_workstation_healthy.json")
    for f in facts.values():
        set_env(f, CUDA_VISIBLE_DEVICES="2,3")
        sees(f, [])
    all_on_cpu(facts)
    findings = diagnose(facts)
    assert [f.ranks for f in only(findings, "GPU005")] == [(0,), (1,)]
    assert "GPU008" not in codes(findings)


def test_local_rank_past_the_visible_gpus_is_critical():
    """Ranks 4-7 of a node got CUDA_VISIBLE_DEVICES=0,1,2,3: set_device(LOCAL_RANK) has no GPU 4-7."""
    facts = load("h100x8_healthy.json")
    for r in range(4, 8):
        set_env(facts[r], CUDA_VISIBLE_DEVICES="0,1,2,3")
        sees(facts[r], [nvml_gpu(facts, r, i) for i in range(4)])
    all_on_cpu(facts)
    findings = diagnose(facts)
    assert codes(findings) == ["GPU005"] * 4
    assert [f.ranks for f in findings] == [(4,), (5,), (6,), (7,)]
    assert findings[0].evidence == {"LOCAL_RANK": 4, "visible_gpus": 4, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert all(f.severity == Severity.CRITICAL and "invalid device ordinal" in f.why for f in findings)


# -- GPU006: Slurm ---------------------------------------------------------------------

def test_slurm_allocation_differs_from_what_torch_sees():
    findings = diagnose(load("h100x8_slurm_cvd_unset.json"))  # granted 4-7, CUDA_VISIBLE_DEVICES unset
    slurm = only(findings, "GPU006")
    # One finding for the node's ranks that see the same thing, not one per rank.
    assert [f.ranks for f in slurm] == [(0, 1, 2, 3)]
    assert slurm[0].title == "Slurm granted 4 GPUs on dgx-h100-01, but torch on ranks 0-3 sees 8"
    assert all(f.severity == Severity.WARN for f in slurm)
    assert slurm[0].evidence["SLURM_STEP_GPUS"] == "4,5,6,7" and slurm[0].evidence["torch_gpus"] == 8
    assert "CUDA_VISIBLE_DEVICES" not in slurm[0].evidence
    assert set(codes(findings)) == {"GPU006", "GPU002"}  # and 4 of the 8 GPUs it sees are idle


# -- GPU007: processes that are not ours ---------------------------------------------

def test_foreign_process_on_our_gpu_warns():
    facts = load("h100x8_foreign_process_on_gpu5.json")
    findings = diagnose(facts)
    assert codes(findings) == ["GPU007"]
    assert findings[0].severity == Severity.WARN and findings[0].ranks == (5,)
    assert findings[0].evidence["foreign_processes"] == [
        {"gpu": uuid_of(facts, 5), "pid": 23911, "used_bytes": 32_212_254_720}]


def test_container_pid_namespace_hides_no_gpu007():
    """NVML lists host pids; ranks in a container know others: none of ours appear, so no judgement."""
    facts = load("h100x8_container_pid_namespace.json")
    listed = {p["pid"] for d in facts[0]["nvml"]["devices"] for p in d["processes"]}
    assert 23911 in listed and not listed & {f["pid"] for f in facts.values()}
    findings = diagnose(facts)
    assert codes(findings) == ["GPU000"] and findings[0].severity == Severity.OK


# -- GPU008: torch cannot use the node's GPUs ------------------------------------------

def test_cpu_only_torch_on_a_gpu_node():
    findings = diagnose(load("h100x8_cpu_only_torch.json"))
    assert codes(findings) == ["GPU008"]
    f = findings[0]
    assert f.severity == Severity.CRITICAL and f.ranks == tuple(range(8))
    assert "built without CUDA" in f.title
    assert f.evidence["nvml_gpus"] == 8 and f.evidence["torch_cuda"] is None


def test_driver_too_old_on_one_node():
    findings = diagnose(load("a100x8_2node_old_driver_on_node2.json"))
    gpu008 = only(findings, "GPU008")
    assert len(gpu008) == 1
    f = gpu008[0]
    assert f.ranks == tuple(range(8, 16)) and f.nodes == ("dgxa100-002",)
    # NVML's CUDA of the driver (11040: 11.4) against torch's (12.1): the title says which is older.
    assert f.title.endswith("its driver 470.223.02 (CUDA 11.4) is older than torch's CUDA 12.1"), f.title
    assert f.evidence["driver_version"] == "470.223.02" and f.evidence["driver_cuda"] == 11040
    assert f.evidence["torch_cuda"] == "12.1"
    assert f.evidence["reason"].startswith("The NVIDIA driver on your system is too old")
    # Slurm granted 8 GPUs there and torch sees none: said per rank, on that node only.
    assert sorted(r for g in only(findings, "GPU006") for r in g.ranks) == list(range(8, 16))
    assert set(codes(findings)) == {"GPU008", "GPU006"}


def test_cuda_unavailable_with_a_driver_new_enough_says_only_that():
    """torch's CUDA 12.1 on a driver for CUDA 12.4 that still fails (a container's libcuda, a GPU in a bad
    state): no claim about the driver's age."""
    facts = load("a100x8_2node_old_driver_on_node2.json")
    for f in facts.values():
        f["nvml"]["cuda_driver_version"] = 12040
    [f] = only(diagnose(facts), "GPU008")
    assert f.title.endswith("CUDA is unavailable") and "older" not in f.title


@pytest.mark.parametrize("driver, torch_cuda, old", [(11040, "12.1", True), (12080, "13.0", True), (12040, "12.4", False),
                                                     (12080, "12.4", False), (12020, "12.4", True), (None, "12.1", False),
                                                     (12040, None, False), ("n/a", "12.1", False)])
def test_a_driver_is_too_old_when_its_cuda_is_older_than_torchs(driver, torch_cuda, old):
    from ddpdoctor.core import cuda_version

    assert cuda_version.driver_too_old(driver, torch_cuda) is old


# -- GPU009: one rank ------------------------------------------------------------------

def test_one_rank_with_eight_gpus():
    findings = diagnose(load("h100x8_world1.json"))
    assert codes(findings) == ["GPU009"]
    assert findings[0].severity == Severity.WARN and findings[0].ranks == (0,)
    assert findings[0].evidence == {"world_size": 1, "visible_gpus": 8, "nvml_gpus": 8}
    assert "torchrun --nproc_per_node=8" in findings[0].fix


# -- robustness ------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.sampled_from(HEALTHY))
def test_any_visible_devices_text_is_judged_without_error(text, name):
    facts = load(name)
    set_env(facts[0], CUDA_VISIBLE_DEVICES=text)
    for f in diagnose(facts):
        assert f.code.startswith("GPU0") and isinstance(f.severity, Severity)
        json.dumps(f.to_json())


# -- cuda_visible.parse ------------------------------------------------------------------

def test_parse_indices():
    v = parse("0,1,3")
    assert v.entries == ("0", "1", "3") and v.ignored == () and v.problems == ()
    assert v.restricts and v.count == 3
    assert parse(" 2 , 0 ").entries == ("2", "0")


def test_parse_uuids_and_mig_ids():
    gpu = "GPU-8e3a7f2c-1b4d-4c6e-9f0a-2d5b7c9e1f3a"
    assert parse(gpu).entries == (gpu,)
    assert parse("GPU-8e3a").entries == ("GPU-8e3a",)  # a prefix is allowed
    mig_new = "MIG-c7384736-a75d-5afc-978f-d2f1294409fd"
    mig_old = f"MIG-{gpu}/1/0"
    v = parse(f"{mig_new},{mig_old}")
    assert v.entries == (mig_new, mig_old) and v.count == 2 and not v.problems


def test_parse_stops_at_the_first_unreadable_entry():
    v = parse("0,x,2")
    assert v.entries == ("0",) and v.ignored == ("x", "2") and v.count == 1
    assert len(v.problems) == 1 and "'x'" in v.problems[0]


def test_parse_duplicate_entry():
    v = parse("0,1,0,2")
    assert v.entries == ("0", "1") and v.ignored == ("0", "2")
    assert "twice" in v.problems[0]


@pytest.mark.parametrize("raw", ["", "-1"])
def test_parse_empty_and_minus_one_hide_all(raw):
    v = parse(raw)
    assert v.restricts and v.count == 0 and v.entries == ()
    assert v.problems == ("hides every GPU",)


def test_parse_unset_does_not_restrict():
    v = parse(None)
    assert not v.restricts and v.count is None and v.entries == () and v.problems == ()


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_any_text(raw):
    v = parse(raw)
    assert v.raw == raw and v.restricts
    assert v.count == len(v.entries) and len(set(v.entries)) == len(v.entries)
    assert bool(v.ignored) <= bool(v.problems)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["0", "1", "7", "x", "", "GPU-1a2b3c4d", "MIG-ab12", "-1", " 3"]), max_size=6))
def test_parse_lists_entries_in_order_up_to_the_first_bad_one(items):
    raw = ",".join(items)
    v = parse(raw)
    if raw.strip() in ("", "-1"):
        assert v.entries == v.ignored == () and v.count == 0
    else:
        assert list(v.entries) + list(v.ignored) == [t.strip() for t in raw.strip().split(",")]


# -- nvml -------------------------------------------------------------------------------

@pytest.fixture
def fresh_nvml(monkeypatch):
    """nvml keeps its initialisation per process; start each test from none, restore after."""
    monkeypatch.setitem(nvml._state, "initialised", False)
    monkeypatch.setitem(nvml._state, "error", None)
    return monkeypatch


def _no_driver_here() -> bool:
    return nvml.init() is not None


def test_query_without_a_driver_is_unknown_with_a_reason(fresh_nvml):
    if not _no_driver_here():
        pytest.skip("NVML works on this machine")
    for call in (("nvmlDeviceGetCount",), ("nvmlSystemGetDriverVersion",), ("nvmlDeviceGetHandleByIndex", 0),
                 ("nvmlNoSuchFunction",)):
        value = nvml.query(*call)
        assert isinstance(value, nvml.Unknown) and value.reason
        assert nvml.plain(value) == {"unknown": value.reason}
    facts = read_nvml()
    assert facts["available"] is False and facts["reason"] and facts["devices"] == []
    assert contexts_of(1234, facts) == {"unknown": facts["reason"]}


def test_plain():
    assert nvml.plain(nvml.Unknown("not supported")) == {"unknown": "not supported"}
    assert nvml.plain(12040) == 12040 and nvml.plain(None) is None


def test_missing_pynvml_is_unknown(fresh_nvml):
    def missing():
        raise ImportError("No module named 'pynvml'")

    fresh_nvml.setattr(nvml, "_module", missing)
    value = nvml.query("nvmlDeviceGetCount")
    assert value == nvml.Unknown("the pynvml module (package nvidia-ml-py) is not installed")


class _NVMLError(Exception):
    pass


class _FakePynvml:
    """Two GPUs of an H100 box, as the nvidia-ml-py functions read_nvml calls return them."""

    def __init__(self, fixture: dict[str, Any]):
        self.devices = fixture["nvml"]["devices"][:2]

    def nvmlInit(self):
        return None

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlSystemGetDriverVersion(self):
        return b"550.90.07"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]

    def nvmlDeviceGetPciInfo_v3(self, handle):
        return SimpleNamespace(busId=handle["pci_bus_id"].lower().encode())

    def nvmlDeviceGetName(self, handle):
        return handle["name"]

    def nvmlDeviceGetMigMode(self, handle):
        if handle["index"] == 1:
            raise _NVMLError("Not Supported")
        return (0, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_bytes"]) for p in handle["processes"]] + \
            [SimpleNamespace(pid=99, usedGpuMemory=None)]


def test_read_nvml_shapes_facts_as_the_fixtures(fresh_nvml):
    rank0 = load("h100x8_healthy.json")[0]
    fresh_nvml.setattr(nvml, "_module", lambda: _FakePynvml(rank0))
    facts = read_nvml()
    assert set(facts) == set(rank0["nvml"])
    assert facts["driver_version"] == "550.90.07" and facts["cuda_driver_version"] == 12040
    assert facts["device_count"] == 2
    first, second = facts["devices"]
    assert set(first) == set(rank0["nvml"]["devices"][0])
    assert first["uuid"] == rank0["nvml"]["devices"][0]["uuid"]
    assert first["pci_bus_id"] == "00000000:18:00.0"  # upper-cased, as torch's form
    assert first["mig_mode"] == 0
    assert second["mig_mode"] == {"unknown": "nvmlDeviceGetMigMode: Not Supported"}
    assert first["processes"] == [{"pid": rank0["pid"], "used_bytes": rank0["nvml"]["devices"][0]["processes"][0]
                                   ["used_bytes"]}, {"pid": 99, "used_bytes": None}]
    assert contexts_of(rank0["pid"], facts) == [rank0["torch"]["current"]["uuid"]]
