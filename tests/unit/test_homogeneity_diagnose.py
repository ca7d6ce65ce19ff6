"""homogeneity's diagnosis on node snapshots, and on variants that differ in one value.

The snapshots in tests/fixtures/homogeneity are modeled from public DGX H100 / DGX A100
facts, not recorded on GPUs (see the README there), except cpu_vm_2core_recorded.json.
They load through ddpdoctor.snapshot.load_inputs, as `ddpdoctor diagnose` loads them.
Each variant here changes one value in a copy, the way the machine would really read
after that fault: a power cap lowers the enforced limit too, a 40GB board has its own
name and memory size.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import re
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdoctor.measure import gpu_health
from ddpdoctor.measure import host as host_facts
from ddpdoctor.measure import nvml
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.probes import RunView
from ddpdoctor.probes.homogeneity.probe import Homogeneity
from ddpdoctor.snapshot import diagnose_inputs, load_inputs
from ddpdoctor.measure.throughput import MatmulThroughput

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "homogeneity"
H100, H100_2 = "dgx_h100_healthy.json", "dgx_h100_healthy_node2.json"
A100, A100_2 = "dgx_a100_80g_healthy.json", "dgx_a100_80g_healthy_node2.json"
CPU = "cpu_vm_2core_recorded.json"
MODELED = (H100, H100_2, A100, A100_2)
A100_40GB = ("NVIDIA A100-SXM4-40GB", 40960 * 2**20)
TORCH_251 = ("2.5.1+cu124", "a8d6afb511a69687bbb2b7e88a3cf67917e1697e")  # v2.5.1 tag; its wheel pins NCCL 2.21.5
Facts = dict[int, dict[str, Any]]


# -- helpers ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _loaded(names: tuple[str, ...]) -> Facts:
    return load_inputs([str(FIXTURES / n) for n in names]).facts["homogeneity"]


def load(*names: str) -> Facts:
    """Fixture files as one job's facts (ranks renumbered file by file); a copy to change."""
    return copy.deepcopy(_loaded(names))


def entries(name: str) -> list[dict[str, Any]]:
    return json.loads((FIXTURES / name).read_text())["probes"]["homogeneity"]


def another_node(name: str, host: str) -> list[dict[str, Any]]:
    """One more node of the fixture's machine type: its own host name and GPU UUIDs."""
    out = copy.deepcopy(entries(name))
    for i, e in enumerate(out):
        e["host"] = host
        if e.get("gpu"):
            e["gpu"]["uuid"] = f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{host}/{i}')}"
    return out


def join(facts: Facts, *nodes: list[dict[str, Any]]) -> Facts:
    for node in nodes:
        base = len(facts)
        for i, e in enumerate(node):
            facts[base + i] = dict(e, rank=base + i)
    return facts


def three_nodes(kind: str = "h100") -> Facts:
    if kind == "h100":
        return join(load(H100, H100_2), another_node(H100, "dgx-h100-03"))
    return join(load(A100, A100_2), another_node(A100, "dgx-a100-03"))


def view(facts: Facts, **settings: Any) -> RunView:
    return RunView(world_size=len(facts), hosts={r: str(f.get("host", "?")) for r, f in facts.items()}, settings=settings)


def diagnose(facts: Facts, **settings: Any) -> list[Finding]:
    return Homogeneity().diagnose(facts, view(facts, **settings))


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def only(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def one(findings: list[Finding], code: str) -> Finding:
    found = only(findings, code)
    assert len(found) == 1, [(f.code, f.severity.label, f.title) for f in findings]
    return found[0]


def no_trouble(findings: list[Finding]) -> bool:
    return all(f.severity < Severity.WARN for f in findings)


def on_node(facts: Facts, host: str) -> list[int]:
    return sorted(r for r, f in facts.items() if f["host"] == host)


def scale_speed(f: dict[str, Any], factor: float) -> None:
    mm = f["measured"]["matmul"]
    mm["flops_per_s"] *= factor
    mm["round_flops_per_s"] = [x * factor for x in mm["round_flops_per_s"]]
    mm["median_ms"] /= factor


def gpu_label(f: dict[str, Any]) -> str:
    return f"{f['host']} GPU {f['gpu']['pci_bus_id']} ({f['gpu']['name']})"


def cpu_ranks(n: int, threads: int, cpus: int, source: str = "rank", omp: str | None = None) -> Facts:
    """n live CPU ranks on one host, each torch with `threads` compute threads, from the recorded entry."""
    base = entries(CPU)[0]
    facts: Facts = {}
    for r in range(n):
        f = copy.deepcopy(base)
        f.update(rank=r, local_rank=r, local_world_size=n, world_size=n, source=source)
        f["host_hw"].update(torch_threads=threads, cpus_usable=cpus, cpu_affinity=f"0-{cpus - 1}",
                            cpu_logical_cores=cpus, cpu_physical_cores=cpus)
        if omp is not None:
            f["env"]["OMP_NUM_THREADS"] = omp
        facts[r] = f
    return facts


# -- the fixtures themselves -----------------------------------------------------------

def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("build_modeled", FIXTURES / "build_modeled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_modeled_files_are_what_the_committed_generator_builds():
    build = _build_module()
    assert sorted(name for name, _, _ in build.FILES) == sorted(MODELED)
    for name, machine, host in build.FILES:
        assert json.loads((FIXTURES / name).read_text()) == build.snapshot(machine, host), name


def _gpu_shape(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The GPU facts' keys as node_facts builds them: CUDA's view, then every NVML leaf."""
    props = SimpleNamespace(name="GPU", uuid="1234", total_memory=1, major=9, minor=0, multi_processor_count=1)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: props)
    cuda = host_facts.read_torch_gpu(0)
    monkeypatch.setattr(nvml, "query", lambda *a, **k: nvml.Unknown("not here"))
    return dict(cuda) | gpu_health._read_handle(object(), 0)


def test_every_file_has_the_shape_take_snapshot_writes(monkeypatch):
    recorded = json.loads((FIXTURES / CPU).read_text())  # written by the real take_snapshot
    rec = recorded["probes"]["homogeneity"][0]
    shape = _gpu_shape(monkeypatch)
    composites = {"ecc_mode": {"current", "pending"}, "remapped_rows": set(gpu_health._remapped_rows((0, 0, 0, 0))),
                  "clock_event_reasons": {"mask", "active"}}
    matmul_keys = [f.name for f in dataclasses.fields(MatmulThroughput)]
    for name in MODELED + (CPU,):
        data = json.loads((FIXTURES / name).read_text())
        assert list(data) == list(recorded) and data["schema"] == "ddpdoctor.snapshot/1", name
        assert list(data["probes"]) == ["homogeneity"], name
        for i, e in enumerate(data["probes"]["homogeneity"]):
            where = f"{name} entry {i}"
            assert list(e) == list(rec), where
            assert list(e["software"]) == list(rec["software"]) and list(e["host_hw"]) == list(rec["host_hw"]), where
            assert list(e["measured"]) == ["matmul"] and list(e["measured"]["matmul"]) == matmul_keys, where
            assert len(e["measured"]["matmul"]["round_flops_per_s"]) == 8, where
            assert e["source"] == "snapshot" and e["rank"] == e["local_rank"] == i, where
            assert e["host"] == data["host"] and e["world_size"] == e["local_world_size"], where
            if name == CPU:
                assert e["gpu"] is None and e["device"] == "cpu"
                continue
            assert e["device"] == f"cuda:{i}" and e["gpu"]["nvml_index"] == i, where
            assert list(e["gpu"]) == list(shape), where
            for key, value in shape.items():
                if isinstance(value, dict) and "unknown" not in value:
                    assert set(e["gpu"][key]) == set(value), f"{where} gpu.{key}"
            for key, keys in composites.items():
                assert set(e["gpu"][key]) == keys, f"{where} gpu.{key}"


def test_modeled_gpus_have_one_uuid_each_and_one_bus_id_per_node():
    all_uuids: list[str] = []
    for name in MODELED:
        gpus = [e["gpu"] for e in entries(name)]
        assert len(gpus) == 8
        assert len({g["pci_bus_id"] for g in gpus}) == 8, name
        assert all(g["uuid"].startswith("GPU-") and g["pci_bus_id"].startswith("00000000:") for g in gpus), name
        all_uuids += [g["uuid"] for g in gpus]
    assert len(set(all_uuids)) == len(all_uuids) == 32
    assert len({entries(n)[0]["host"] for n in MODELED}) == 4


@pytest.mark.parametrize("name, gpu, cc, sms, watts, clocks, cpu, cores, ram, tflops", [
    (H100, ("NVIDIA H100 80GB HBM3", 85520809984), "9.0", 132, 700.0, (1980, 2619, 1980, 2619),
     "Intel(R) Xeon(R) Platinum 8480C", (112, 224), 2 * 2**40, 700),
    (A100, ("NVIDIA A100-SXM4-80GB", 85899345920), "8.0", 108, 400.0, (1410, 1593, 1275, 1593),
     "AMD EPYC 7742 64-Core Processor", (128, 256), 2**40, 280),
])
def test_modeled_values_are_the_documented_ones(name, gpu, cc, sms, watts, clocks, cpu, cores, ram, tflops):
    for e in entries(name):
        g = e["gpu"]
        assert (g["name"], g["memory_total_bytes"], g["compute_capability"], g["sm_count"]) == (gpu + (cc, sms))
        assert g["power"]["limit_w"] == g["power"]["default_w"] == g["power"]["enforced_w"] == watts
        c = g["clocks"]
        assert (c["max_sm_mhz"], c["max_mem_mhz"], c["app_sm_mhz"], c["app_mem_mhz"]) == clocks
        assert (c["default_app_sm_mhz"], c["default_app_mem_mhz"]) == clocks[2:]
        assert g["ecc_mode"]["current"] is True and g["persistence_mode"] is True
        hw = e["host_hw"]
        assert (hw["cpu_model"], (hw["cpu_physical_cores"], hw["cpu_logical_cores"]), hw["ram_bytes"]) == (cpu, cores, ram)
        assert hw["node_gpus"] == 8
        sw = e["software"]
        assert (sw["torch"], sw["cuda_runtime"], sw["nccl"], sw["driver"], sw["cuda_driver"]) == (
            "2.4.1+cu124", "12.4", "2.20.5", "550.54.15", "12.4")
        mm = e["measured"]["matmul"]
        assert (mm["dtype"], mm["size"]) == ("bfloat16", 8192)
        assert all(abs(x / 1e12 - tflops) < 0.01 * tflops for x in mm["round_flops_per_s"])
        assert abs(mm["median_ms"] - 2e3 * 8192**3 / mm["flops_per_s"]) < 1e-3


# -- healthy: no false alarm -----------------------------------------------------------

@pytest.mark.parametrize("names, nodes", [
    ((H100,), ("dgx-h100-01",)),
    ((H100, H100_2), ("dgx-h100-01", "dgx-h100-02")),
    ((A100,), ("dgx-a100-01",)),
    ((A100, A100_2), ("dgx-a100-01", "dgx-a100-02")),
])
def test_healthy_nodes_give_exactly_one_ok(names, nodes):
    facts = load(*names)
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000"] and no_trouble(findings)
    ok = findings[0]
    assert ok.severity == Severity.OK
    assert ok.ranks == tuple(range(8 * len(names))) and ok.nodes == nodes
    assert ok.title.startswith(f"{8 * len(names)} ranks on {len(nodes)} node")
    gpu = facts[0]["gpu"]["name"]
    assert gpu in ok.title and "NCCL 2.20.5" in ok.title and "NVIDIA driver 550.54.15" in ok.title
    assert "torch 2.4.1+cu124 (ee1b6804)" in ok.title
    unit = re.search(r"within (\d+)% \((\d+)-(\d+) TFLOP/s\)", ok.title)
    assert unit and unit[1] in ("0", "1"), ok.title  # the modeled GPUs are within about 1% of each other
    assert int(unit[3]) - int(unit[2]) <= 8 and 0.98 < int(unit[2]) / int(unit[3]) <= 1


def test_healthy_snapshots_through_diagnose_inputs_exit_zero():
    inputs = load_inputs([str(FIXTURES / n) for n in (H100, H100_2)])
    diagnosis = diagnose_inputs(inputs)
    assert diagnosis.exit_code == 0 and codes(diagnosis.findings) == ["HOM000"]
    assert diagnosis.nodes() == ["dgx-h100-01", "dgx-h100-02"]


def test_recorded_cpu_snapshot_alone_gives_no_warning():
    findings = diagnose(load(CPU))
    assert codes(findings) == ["HOM000"] and no_trouble(findings)
    assert findings[0].ranks == (0,) and findings[0].nodes == ("vm",)
    assert "CPU AMD EPYC" in findings[0].title and "torch 2.13.0+cpu" in findings[0].title
    assert "NCCL" not in findings[0].title  # unknown on a CPU wheel: not shown as a value


def test_one_rank_is_said_in_the_singular():
    assert diagnose(load(CPU))[0].title.startswith("1 rank on 1 node agree")


def test_no_facts_no_findings():
    assert diagnose({}) == []


# -- HOM001: GPU hardware --------------------------------------------------------------

def test_one_node_of_40gb_a100s_among_80gb_ones_is_named_by_node():
    facts = three_nodes("a100")
    for r in on_node(facts, "dgx-a100-03"):
        facts[r]["gpu"]["name"], facts[r]["gpu"]["memory_total_bytes"] = A100_40GB
    findings = diagnose(facts)
    hw = one(findings, "HOM001")
    assert hw.severity == Severity.WARN
    assert hw.ranks == tuple(range(16, 24)) and hw.nodes == ("dgx-a100-03",)
    assert hw.title == ("GPU hardware differs: GPU model: nodes dgx-a100-01,dgx-a100-02 on NVIDIA A100-SXM4-80GB; "
                        "node dgx-a100-03 on NVIDIA A100-SXM4-40GB")
    assert hw.evidence == {
        "GPU model": "nodes dgx-a100-01,dgx-a100-02 on NVIDIA A100-SXM4-80GB; node dgx-a100-03 on NVIDIA A100-SXM4-40GB",
        "GPU memory": "nodes dgx-a100-01,dgx-a100-02 on 80.0 GiB; node dgx-a100-03 on 40.0 GiB",
    }
    assert "HOM000" not in codes(findings)
    assert not only(findings, "HOM006")  # 40GB and 80GB boards are not each other's speed peers


def test_one_odd_gpu_inside_a_node_is_named_by_rank():
    facts = load(A100, A100_2)
    facts[5]["gpu"]["name"], facts[5]["gpu"]["memory_total_bytes"] = A100_40GB
    hw = one(diagnose(facts), "HOM001")
    assert hw.ranks == (5,) and hw.nodes == ("dgx-a100-01",)
    assert hw.evidence["GPU model"] == "ranks 0-4,6-15 on NVIDIA A100-SXM4-80GB; rank 5 on NVIDIA A100-SXM4-40GB"


def test_ecc_disabled_on_one_node_is_a_hardware_difference():
    facts = three_nodes()
    for r in on_node(facts, "dgx-h100-02"):
        facts[r]["gpu"]["ecc_mode"] = {"current": False, "pending": False}
    hw = one(diagnose(facts), "HOM001")
    assert hw.ranks == tuple(range(8, 16)) and hw.nodes == ("dgx-h100-02",)
    assert hw.evidence == {"ECC mode": "nodes dgx-h100-01,dgx-h100-03 on True; node dgx-h100-02 on False"}


# -- HOM002: library versions ----------------------------------------------------------

def test_different_torch_and_nccl_on_one_node_is_critical():
    facts = three_nodes()
    for r in on_node(facts, "dgx-h100-03"):
        facts[r]["software"].update(torch=TORCH_251[0], torch_git=TORCH_251[1], nccl="2.21.5")
    findings = diagnose(facts)
    lib = one(findings, "HOM002")
    assert lib.severity == Severity.CRITICAL
    assert lib.ranks == tuple(range(16, 24)) and lib.nodes == ("dgx-h100-03",)
    assert lib.evidence == {
        "torch": "nodes dgx-h100-01,dgx-h100-02 on 2.4.1+cu124 (ee1b6804); node dgx-h100-03 on 2.5.1+cu124 (a8d6afb5)",
        "NCCL": "nodes dgx-h100-01,dgx-h100-02 on 2.20.5; node dgx-h100-03 on 2.21.5",
    }
    assert lib.title.startswith("Library versions differ: torch: ")
    assert "HOM000" not in codes(findings)


def test_only_nccl_differs_on_one_node():
    facts = three_nodes()
    for r in on_node(facts, "dgx-h100-02"):
        facts[r]["software"]["nccl"] = "2.18.1"  # a conda NCCL loaded ahead of the wheel's
    lib = one(diagnose(facts), "HOM002")
    assert lib.severity == Severity.CRITICAL and set(lib.evidence) == {"NCCL"}
    assert lib.ranks == tuple(range(8, 16)) and lib.nodes == ("dgx-h100-02",)


def test_a_local_torch_build_with_the_same_version_string_is_told_apart():
    facts = load(H100)
    facts[3]["software"]["torch_git"] = "0123456789abcdef0123456789abcdef01234567"
    lib = one(diagnose(facts), "HOM002")
    assert lib.ranks == (3,)
    assert lib.evidence["torch"] == "ranks 0-2,4-7 on 2.4.1+cu124 (ee1b6804); rank 3 on 2.4.1+cu124 (01234567)"


# -- HOM003: driver --------------------------------------------------------------------

def test_older_driver_on_one_node_is_named_by_node():
    facts = three_nodes()
    for r in on_node(facts, "dgx-h100-02"):
        facts[r]["software"].update(driver="535.161.08", cuda_driver="12.2")
    findings = diagnose(facts)
    drv = one(findings, "HOM003")
    assert drv.severity == Severity.WARN
    assert drv.ranks == tuple(range(8, 16)) and drv.nodes == ("dgx-h100-02",)
    assert drv.evidence == {
        "NVIDIA driver": "nodes dgx-h100-01,dgx-h100-03 on 550.54.15; node dgx-h100-02 on 535.161.08",
        "CUDA driver API": "nodes dgx-h100-01,dgx-h100-03 on 12.4; node dgx-h100-02 on 12.2",
    }
    assert not only(findings, "HOM002") and "HOM000" not in codes(findings)


# -- HOM004: harmless ------------------------------------------------------------------

@pytest.mark.parametrize("section, key, value, label, shown", [
    ("software", "kernel", "5.15.0-1053-nvidia", "kernel", "5.15.0-1053-nvidia"),
    ("host_hw", "ram_bytes", 2 * 2**40, "host RAM", "2048.0 GiB"),
])
def test_harmless_difference_alone_is_info_beside_ok(section, key, value, label, shown):
    facts = three_nodes("a100")
    for r in on_node(facts, "dgx-a100-03"):
        facts[r][section][key] = value
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000", "HOM004"]
    info = findings[1]
    assert info.severity == Severity.INFO and info.ranks == tuple(range(16, 24)) and info.nodes == ("dgx-a100-03",)
    assert list(info.evidence) == [label] and info.evidence[label].endswith(f"node dgx-a100-03 on {shown}")


# -- HOM005: distributed settings ------------------------------------------------------

def test_nccl_algo_differing_on_one_rank_warns():
    facts = load(H100, H100_2)
    for f in facts.values():
        f["env"]["NCCL_ALGO"] = "Ring"
    facts[11]["env"]["NCCL_ALGO"] = "Tree"
    findings = diagnose(facts)
    env = one(findings, "HOM005")
    assert env.severity == Severity.WARN and env.ranks == (11,) and env.nodes == ("dgx-h100-02",)
    assert env.evidence == {"NCCL_ALGO": "ranks 0-10,12-15 have Ring; rank 11 has Tree"}
    assert env.title == "Distributed settings differ across ranks: NCCL_ALGO"
    assert "HOM000" not in codes(findings)


def test_a_setting_only_one_rank_has_counts_as_unset_elsewhere():
    facts = load(H100)
    facts[2]["env"]["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    env = one(diagnose(facts), "HOM005")
    assert env.severity == Severity.WARN and env.ranks == (2,)
    assert env.evidence == {"TORCH_NCCL_BLOCKING_WAIT": "ranks 0-1,3-7 have unset; rank 2 has 1"}


def test_socket_ifname_differing_by_node_is_info():
    facts = load(H100, H100_2)
    for r, f in facts.items():
        f["env"]["NCCL_SOCKET_IFNAME"] = "enp27s0np0" if r < 8 else "^lo,docker0"
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000", "HOM005"]
    env = findings[1]
    assert env.severity == Severity.INFO
    assert env.evidence == {"NCCL_SOCKET_IFNAME": "node dgx-h100-01 with enp27s0np0; node dgx-h100-02 with ^lo,docker0"}
    assert env.ranks == tuple(range(16))  # two nodes, neither the majority: both named


def test_variables_outside_the_compared_prefixes_are_not_compared():
    facts = load(H100)
    facts[1]["env"]["OMP_NUM_THREADS"] = "4"
    facts[2]["env"]["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    assert codes(diagnose(facts)) == ["HOM000"]


# -- HOM006: the slow rank -------------------------------------------------------------

def test_a_gpu_25_percent_slower_is_flagged_by_rank_and_bus_id():
    facts = load(H100, H100_2)
    scale_speed(facts[5], 0.75)
    findings = diagnose(facts)
    slow = one(findings, "HOM006")
    assert slow.severity == Severity.WARN and slow.ranks == (5,) and slow.nodes == ("dgx-h100-01",)
    assert slow.title.startswith("Rank 5 computes 25% slower than the median of its 15 peers on identical hardware")
    assert "dgx-h100-01 GPU 00000000:C3:00.0" in slow.title
    assert abs(slow.evidence["slower_than_peers_pct"][5] - 25) < 1.5
    assert slow.evidence["threshold_pct"] == 10.0
    assert slow.evidence["hardware"] == "NVIDIA H100 80GB HBM3"
    speeds = slow.evidence["throughput_TFLOP_per_s_by_rank"]
    assert set(speeds) == set(range(16)) and 515 < speeds[5] < 535 and all(690 < speeds[r] < 710 for r in speeds if r != 5)
    assert "HOM000" not in codes(findings)


def test_every_gpu_of_one_node_slower_is_named_as_that_node():
    # Three H100 nodes; every GPU of the second one computes 30% slower (a node capped by its
    # power or cooling, not one bad board): one finding that names the node, not 8 ranks.
    facts = three_nodes()
    slow_host = facts[8]["host"]
    for r in on_node(facts, slow_host):
        scale_speed(facts[r], 0.7)
    slow = one(diagnose(facts), "HOM006")
    assert slow.ranks == tuple(on_node(facts, slow_host)) and slow.nodes == (slow_host,)
    assert slow.title.startswith(f"Node {slow_host} (ranks 8-15) computes up to 3"), slow.title
    assert all(29 < pct < 32 for pct in slow.evidence["slower_than_peers_pct"].values()), slow.evidence


def test_a_gpu_5_percent_slower_is_within_the_default():
    facts = load(H100)
    scale_speed(facts[5], 0.95)
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000"]


def test_a_stricter_threshold_flags_the_5_percent_gpu():
    facts = load(H100)
    scale_speed(facts[5], 0.95)
    slow = one(diagnose(facts, slow_threshold_pct=3), "HOM006")
    assert slow.ranks == (5,) and slow.evidence["threshold_pct"] == 3.0


def test_the_threshold_reaches_the_diagnosis_through_diagnose_inputs():
    inputs = load_inputs([str(FIXTURES / H100)])
    scale_speed(inputs.facts["homogeneity"][6], 0.95)
    assert "HOM006" not in codes(diagnose_inputs(inputs).findings)
    inputs.settings["slow_threshold_pct"] = 3
    diagnosis = diagnose_inputs(inputs)
    assert one(diagnosis.findings, "HOM006").ranks == (6,) and diagnosis.exit_code == 1


def test_only_the_rounds_that_were_all_slow_count():
    """A burst of noise spoils one round, not the verdict: a rank is judged by its best round."""
    facts = load(H100)
    rounds = facts[4]["measured"]["matmul"]["round_flops_per_s"]
    facts[4]["measured"]["matmul"]["round_flops_per_s"] = [x * 0.5 if i else x for i, x in enumerate(rounds)]
    assert "HOM006" not in codes(diagnose(facts))


def _two_cpu_snapshots(tmp_path: Path) -> Facts:
    second = tmp_path / "other.json"
    second.write_text((FIXTURES / CPU).read_text())
    return copy.deepcopy(load_inputs([str(FIXTURES / CPU), str(second)]).facts["homogeneity"])


def test_cpu_default_threshold_is_20_percent(tmp_path):
    facts = _two_cpu_snapshots(tmp_path)
    assert facts[1]["host"] == "vm (other.json)"
    scale_speed(facts[1], 0.85)
    assert "HOM006" not in codes(diagnose(facts))
    scale_speed(facts[1], 0.75 / 0.85)
    slow = one(diagnose(facts), "HOM006")
    assert slow.ranks == (1,) and slow.nodes == ("vm (other.json)",)
    assert slow.evidence["threshold_pct"] == 20.0
    assert slow.title.startswith("Rank 1 computes 25% slower than its peer on identical hardware")
    assert slow.evidence["hardware"] == "CPU AMD EPYC, 2 threads per rank"
    assert set(slow.evidence["throughput_GFLOP_per_s_by_rank"]) == {0, 1}


def test_cpu_ranks_with_different_thread_counts_are_not_peers(tmp_path):
    facts = _two_cpu_snapshots(tmp_path)
    facts[1]["host_hw"]["torch_threads"] = 1
    scale_speed(facts[1], 0.5)
    assert "HOM006" not in codes(diagnose(facts))


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=1e-3, max_value=1e3), st.sampled_from([(H100,), (H100, H100_2), (A100, A100_2)]))
def test_scaling_every_rank_alike_never_makes_a_slow_rank(factor, names):
    facts = load(*names)
    for f in facts.values():
        scale_speed(f, factor)
    assert codes(diagnose(facts)) == ["HOM000"]


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=15), st.floats(min_value=0.05, max_value=0.86),
       st.floats(min_value=0.93, max_value=1.5))
def test_one_rank_slowed_past_the_threshold_is_the_one_named(rank, slow_factor, fine_factor):
    facts = load(H100, H100_2)
    scale_speed(facts[rank], fine_factor)
    assert "HOM006" not in codes(diagnose(facts))
    scale_speed(facts[rank], slow_factor / fine_factor)
    assert one(diagnose(facts), "HOM006").ranks == (rank,)


# -- HOM007: memory errors -------------------------------------------------------------

def test_volatile_uncorrectable_ecc_warns_on_that_gpu():
    facts = load(H100, H100_2)
    facts[11]["gpu"]["ecc_uncorrected"] = {"volatile": 2, "aggregate": 2}
    findings = diagnose(facts)
    mem = one(findings, "HOM007")
    assert mem.severity == Severity.WARN and mem.ranks == (11,) and mem.nodes == ("dgx-h100-02",)
    label = gpu_label(facts[11])
    assert label == "dgx-h100-02 GPU 00000000:61:00.0 (NVIDIA H100 80GB HBM3)"
    assert mem.evidence == {label: "2 uncorrectable ECC errors since the last reset"}
    assert mem.title == f"GPU memory errors on {label}: 2 uncorrectable ECC errors since the last reset"
    assert "HOM000" not in codes(findings)


def test_failed_row_remapping_is_critical():
    facts = load(A100)
    facts[4]["gpu"]["remapped_rows"] = {"correctable": 0, "uncorrectable": 8, "pending": False, "failed": True}
    mem = one(diagnose(facts), "HOM007")
    assert mem.severity == Severity.CRITICAL and mem.ranks == (4,)
    assert mem.evidence == {gpu_label(facts[4]): "row remapping FAILED; 8 rows remapped for uncorrectable errors"}


def test_pending_row_remap_warns():
    facts = load(A100)
    facts[1]["gpu"]["remapped_rows"] = {"correctable": 0, "uncorrectable": 1, "pending": True, "failed": False}
    mem = one(diagnose(facts), "HOM007")
    assert mem.severity == Severity.WARN and mem.ranks == (1,)
    assert "pending until the GPU is reset" in mem.evidence[gpu_label(facts[1])]


def test_lifetime_errors_only_are_info():
    facts = load(H100)
    facts[0]["gpu"]["ecc_uncorrected"] = {"volatile": 0, "aggregate": 3}
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000", "HOM007"]
    assert findings[1].severity == Severity.INFO and findings[1].ranks == (0,)
    assert findings[1].evidence == {
        gpu_label(facts[0]): "3 uncorrectable ECC errors in its lifetime (none since the last reset)"}


def test_unknown_error_counts_are_not_findings():
    facts = load(H100)
    for f in facts.values():
        f["gpu"]["ecc_uncorrected"] = {"volatile": {"unknown": "nvmlDeviceGetTotalEccErrors: Not Supported"},
                                       "aggregate": {"unknown": "nvmlDeviceGetTotalEccErrors: Not Supported"}}
        f["gpu"]["remapped_rows"] = {"unknown": "nvmlDeviceGetRemappedRows: Not Supported"}
    assert codes(diagnose(facts)) == ["HOM000"]


def test_two_ranks_on_one_gpu_make_one_entry_naming_both():
    facts = load(H100)
    facts[3]["gpu"]["ecc_uncorrected"] = {"volatile": 1, "aggregate": 1}
    facts[4]["gpu"] = copy.deepcopy(facts[3]["gpu"])  # rank 4 runs on rank 3's GPU
    facts[4]["device"] = facts[3]["device"]
    mem = one(diagnose(facts), "HOM007")
    assert mem.ranks == (3, 4) and list(mem.evidence) == [gpu_label(facts[3])]
    assert "and 1 more" not in mem.title


def test_two_bad_gpus_are_two_entries_of_one_finding():
    facts = load(H100, H100_2)
    facts[2]["gpu"]["ecc_uncorrected"] = {"volatile": 1, "aggregate": 1}
    facts[9]["gpu"]["remapped_rows"] = {"correctable": 0, "uncorrectable": 2, "pending": False, "failed": True}
    mem = one(diagnose(facts), "HOM007")
    assert mem.severity == Severity.CRITICAL  # the worst of the two
    assert mem.ranks == (2, 9) and mem.nodes == ("dgx-h100-01", "dgx-h100-02")
    assert list(mem.evidence) == [gpu_label(facts[2]), gpu_label(facts[9])]
    # The worst GPU names the finding.
    assert mem.title.startswith(f"GPU memory errors on {gpu_label(facts[9])} and 1 more: row remapping FAILED")
    assert mem.evidence[gpu_label(facts[2])] == "1 uncorrectable ECC error since the last reset"


# -- HOM008, HOM009, HOM010, HOM014: per-GPU state ---------------------------------------

def test_power_limit_below_default_warns():
    facts = load(H100)
    facts[6]["gpu"]["power"].update(limit_w=500.0, enforced_w=500.0)
    findings = diagnose(facts)
    cap = one(findings, "HOM008")
    assert cap.severity == Severity.WARN and cap.ranks == (6,) and cap.nodes == ("dgx-h100-01",)
    assert cap.evidence == {gpu_label(facts[6]): "power limit 500 W, default 700 W (71%)"}
    assert "HOM000" not in codes(findings)


def test_power_limit_at_default_is_not_a_finding():
    facts = load(H100)
    facts[6]["gpu"]["power"].update(limit_w=699.0, enforced_w=699.0)  # within 2%
    assert codes(diagnose(facts)) == ["HOM000"]


def test_application_clock_below_default_warns():
    facts = load(H100)
    facts[2]["gpu"]["clocks"].update(app_sm_mhz=1410, sm_mhz=1410)
    clk = one(diagnose(facts), "HOM009")
    assert clk.severity == Severity.WARN and clk.ranks == (2,)
    assert clk.evidence == {gpu_label(facts[2]): "application SM clock 1410 MHz, default 1980 MHz"}


def test_thermal_slowdown_warns_with_the_temperature():
    facts = load(H100)
    facts[7]["gpu"]["clock_event_reasons"] = {"mask": 0x40, "active": ["hw_thermal_slowdown"]}
    facts[7]["gpu"]["temperature_c"] = 91
    findings = diagnose(facts)
    hot = one(findings, "HOM010")
    assert hot.severity == Severity.WARN and hot.ranks == (7,)
    assert hot.evidence == {gpu_label(facts[7]): "hw_thermal_slowdown at 91 C"}
    assert "HOM000" not in codes(findings)


def test_power_cap_throttling_alone_is_info():
    facts = load(H100)
    facts[1]["gpu"]["clock_event_reasons"] = {"mask": 0x4, "active": ["sw_power_cap"]}
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000", "HOM010"]
    assert findings[1].severity == Severity.INFO and findings[1].ranks == (1,)


def test_an_idle_gpu_is_not_throttled():
    facts = load(H100)
    for f in facts.values():
        f["gpu"]["clock_event_reasons"] = {"mask": 0x1, "active": ["gpu_idle"]}
    assert codes(diagnose(facts)) == ["HOM000"]


def test_persistence_mode_off_is_info():
    facts = load(A100, A100_2)
    facts[12]["gpu"]["persistence_mode"] = False
    findings = diagnose(facts)
    assert codes(findings) == ["HOM000", "HOM014"]
    pm = findings[1]
    assert pm.severity == Severity.INFO and pm.ranks == (12,) and pm.nodes == ("dgx-a100-02",)
    assert pm.evidence == {gpu_label(facts[12]): "persistence mode off"}


# -- HOM011, HOM012, HOM013: host sizing -----------------------------------------------

def test_little_ram_for_eight_gpus_warns_on_that_node():
    facts = load(H100, H100_2)
    for r in on_node(facts, "dgx-h100-02"):
        facts[r]["host_hw"]["ram_bytes"] = 64 * 2**30
    findings = diagnose(facts)
    ram = one(findings, "HOM011")
    assert ram.severity == Severity.WARN
    assert ram.ranks == tuple(range(8, 16)) and ram.nodes == ("dgx-h100-02",)
    assert ram.evidence["dgx-h100-02"] == "64 GiB RAM for 8 GPUs (8.0 GiB each)"
    assert "dgx-h100-01" not in ram.evidence


def test_16_gib_per_gpu_is_enough():
    facts = load(H100)
    for f in facts.values():
        f["host_hw"]["ram_bytes"] = 128 * 2**30
    assert "HOM011" not in codes(diagnose(facts))


def test_live_cpu_ranks_oversubscribing_the_cores_warn():
    facts = cpu_ranks(4, threads=8, cpus=8)
    findings = diagnose(facts)
    threads = one(findings, "HOM012")
    assert threads.severity == Severity.WARN and threads.ranks == (0, 1, 2, 3) and threads.nodes == ("vm",)
    assert threads.evidence == {"vm": "4 ranks with 32 compute threads between them on 8 CPUs, OMP_NUM_THREADS unset"}


def test_omp_num_threads_set_is_not_oversubscription():
    findings = diagnose(cpu_ranks(4, threads=2, cpus=8, omp="2"))
    assert "HOM012" not in codes(findings) and "HOM013" not in codes(findings)


def test_snapshot_entries_are_never_judged_for_threads():
    findings = diagnose(cpu_ranks(4, threads=8, cpus=8, source="snapshot"))
    assert "HOM012" not in codes(findings) and "HOM013" not in codes(findings)


def test_crowded_cpu_ranks_are_not_compared_for_speed():
    facts = cpu_ranks(4, threads=8, cpus=8)
    scale_speed(facts[2], 0.5)
    findings = diagnose(facts)
    crowded = one(findings, "HOM013")
    assert crowded.severity == Severity.INFO and crowded.ranks == (0, 1, 2, 3) and crowded.nodes == ("vm",)
    assert crowded.evidence == {"hosts": {"vm": {"ranks": "0-3", "threads": 32, "cores": 8}}}
    assert not only(findings, "HOM006")


def test_uncrowded_cpu_ranks_are_compared_for_speed():
    facts = cpu_ranks(4, threads=2, cpus=8, omp="2")
    scale_speed(facts[2], 0.5)
    findings = diagnose(facts)
    assert one(findings, "HOM006").ranks == (2,) and not only(findings, "HOM013")


def _two_hosts_one_machine(machines: tuple[str, str]) -> Facts:
    """The full suite's false alarm (tests/ranks/test_multinode_e2e.py, 2 simulated nodes of 2 ranks,
    one thread each, on a 2-core VM): best rounds 38.57, 69.9, 65.88 and 53.28 GFLOP/s."""
    facts = cpu_ranks(4, threads=1, cpus=2, omp="1")
    for r, f in facts.items():
        f["host"], f["machine"] = (f"node{r // 2}", machines[r // 2])
        mm = f["measured"]["matmul"]
        scale_speed(f, [38.57, 69.9, 65.88, 53.28][r] * 1e9 / max(mm["round_flops_per_s"]))
    return facts


def test_nodes_on_one_machine_are_judged_for_its_cores_together():
    findings = diagnose(_two_hosts_one_machine(("boot-a", "boot-a")))
    crowded = one(findings, "HOM013")
    assert crowded.ranks == (0, 1, 2, 3) and crowded.nodes == ("node0", "node1")
    assert crowded.evidence == {"hosts": {"node0, node1": {"ranks": "0-3", "threads": 4, "cores": 2}}}
    assert not only(findings, "HOM006")


def test_nodes_on_two_machines_are_compared_as_before():
    findings = diagnose(_two_hosts_one_machine(("boot-a", "boot-b")))
    assert one(findings, "HOM006").ranks == (0,) and not only(findings, "HOM013")


# -- robustness and the verdict ---------------------------------------------------------

def _without(facts: Facts, *keys: str) -> Facts:
    for f in facts.values():
        for key in keys:
            f.pop(key, None)
    return facts


@pytest.mark.parametrize("make", [
    lambda: _without(load(H100), "gpu"),
    lambda: _without(load(H100), "measured"),
    lambda: _without(load(H100), "software", "host_hw", "env"),
    lambda: {r: {"host": f["host"]} for r, f in load(H100, H100_2).items()},
    lambda: {0: {}, 1: {}},
    lambda: {r: dict(f, gpu=None, measured=None, software=None, host_hw=None, env=None) for r, f in load(CPU).items()},
    lambda: {r: dict(f, gpu={"uuid": f["gpu"]["uuid"], "unknown": "NVML: GPU is lost"}) for r, f in load(H100).items()},
    lambda: {r: dict(f, measured={"matmul": {"error": "timed out"}}) for r, f in load(H100).items()},
], ids=["no-gpu", "no-measured", "no-software-host-env", "host-only", "empty", "all-none", "gpu-lost",
        "matmul-error"])
def test_missing_sections_never_raise(make):
    facts = make()
    findings = diagnose(facts)
    assert all(isinstance(f, Finding) for f in findings)
    assert not only(findings, "HOM006")


def test_a_cpu_rank_beside_gpu_ranks_is_a_hardware_difference():
    facts = load(H100)
    facts[7]["gpu"] = None  # CUDA failed on that rank: it ran on the CPU
    hw = one(diagnose(facts), "HOM001")
    assert hw.ranks == (7,) and hw.evidence["GPU model"] == "ranks 0-6 on NVIDIA H100 80GB HBM3; rank 7 on none"


TOP_KEYS = ("device", "software", "host_hw", "gpu", "env", "measured", "host", "source", "local_world_size")
GPU_KEYS = ("name", "uuid", "pci_bus_id", "memory_total_bytes", "ecc_mode", "ecc_uncorrected", "remapped_rows",
            "power", "clocks", "clock_event_reasons", "persistence_mode", "temperature_c")


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_any_keys_missing_never_raise(data):
    facts = load(H100, H100_2)
    for f in facts.values():
        for key in data.draw(st.lists(st.sampled_from(TOP_KEYS), unique=True, max_size=4)):
            f.pop(key, None)
        if f.get("gpu"):
            for key in data.draw(st.lists(st.sampled_from(GPU_KEYS), unique=True, max_size=5)):
                f["gpu"].pop(key, None)
    findings = diagnose(facts)
    assert all(isinstance(f, Finding) for f in findings)


def _ecc(f: dict[str, Any]) -> None:
    f["gpu"]["ecc_uncorrected"] = {"volatile": 1, "aggregate": 1}


def _lifetime_ecc(f: dict[str, Any]) -> None:
    f["gpu"]["ecc_uncorrected"] = {"volatile": 0, "aggregate": 1}


def _capped(f: dict[str, Any]) -> None:
    f["gpu"]["power"].update(limit_w=450.0, enforced_w=450.0)


def _power_cap_throttled(f: dict[str, Any]) -> None:
    f["gpu"]["clock_event_reasons"] = {"mask": 0x4, "active": ["sw_power_cap"]}


def _persistence_off(f: dict[str, Any]) -> None:
    f["gpu"]["persistence_mode"] = False


def _kernel(f: dict[str, Any]) -> None:
    f["software"]["kernel"] = "5.15.0-1060-nvidia"


def _slow(f: dict[str, Any]) -> None:
    scale_speed(f, 0.6)


def _nccl(f: dict[str, Any]) -> None:
    f["software"]["nccl"] = "2.19.3"


MUTATIONS: list[Callable[[dict[str, Any]], None]] = [_ecc, _lifetime_ecc, _capped, _power_cap_throttled,
                                                    _persistence_off, _kernel, _slow, _nccl]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(min_value=0, max_value=7)), max_size=4))
def test_ok_appears_exactly_when_nothing_warns(changes):
    facts = load(H100)
    for mutate, rank in changes:
        mutate(facts[rank])
    findings = diagnose(facts)
    warned = any(f.severity >= Severity.WARN for f in findings)
    assert ("HOM000" in codes(findings)) == (not warned)
    if not warned:
        assert codes(findings)[0] == "HOM000" and codes(findings).count("HOM000") == 1
    assert (not changes) == (codes(findings) == ["HOM000"])


def test_ranks_pinned_to_their_own_cpus_are_not_oversubscribed():
    # srun --ntasks-per-node=4 --cpus-per-task=2 on an 8-CPU node: each rank sees 2 CPUs, 2 threads.
    facts = cpu_ranks(4, threads=2, cpus=2)
    for r, f in facts.items():
        f["host_hw"]["cpu_affinity"] = f"{2 * r}-{2 * r + 1}"
    codes = {f.code for f in diagnose(facts)}
    assert "HOM012" not in codes and "HOM013" not in codes
    # The same 4 ranks all pinned to CPUs 0-1 do compete.
    for f in facts.values():
        f["host_hw"]["cpu_affinity"] = "0-1"
    codes = {f.code for f in diagnose(facts)}
    assert "HOM012" in codes and "HOM013" in codes


@pytest.mark.parametrize("pinned, slower, flagged, threshold", [
    (False, 0.70, False, None),   # 30% on cores both may use: the scheduler's vCPU, not the rank
    (False, 0.50, True, 40.0),    # half speed is the rank's even there
    (True, 0.70, True, 20.0),     # pinned apart, each on its own cores: 30% is the rank's
])
def test_cpu_ranks_floating_over_shared_cores_need_a_larger_gap(pinned, slower, flagged, threshold):
    facts = cpu_ranks(2, threads=1, cpus=2)
    if pinned:
        facts[0]["host_hw"]["cpu_affinity"], facts[1]["host_hw"]["cpu_affinity"] = "0", "1"
    scale_speed(facts[1], slower)
    slow = only(diagnose(facts), "HOM006")
    assert bool(slow) == flagged, codes(diagnose(facts))
    if flagged:
        assert slow[0].ranks == (1,) and slow[0].evidence["threshold_pct"] == threshold


# -- HOM015: a host busy with other processes ------------------------------------------

def _with_load(facts: Facts, host: str, cpus: int, busy: float, all_busy: float) -> Facts:
    first = min(on_node(facts, host))
    facts[first]["host_load"] = {"interval_s": 4.0, "cpus": cpus, "foreign_cpus_busy": busy, "cpus_busy": all_busy,
                                 "top": [{"pid": 4242, "name": "python", "cpu_pct": 190}]}
    return facts


def test_a_saturated_node_is_named_with_the_other_processes():
    facts = _with_load(load(H100, H100_2), "dgx-h100-02", cpus=224, busy=130.0, all_busy=220.0)
    busy = one(diagnose(facts), "HOM015")
    assert busy.severity == Severity.WARN and busy.nodes == ("dgx-h100-02",)
    assert busy.ranks == tuple(range(8, 16))
    assert busy.evidence["by_host"] == {
        "dgx-h100-02": "220.0 of 224 CPUs busy, 130.0 of them with other processes (pid 4242 python 190%)"}
    assert busy.title.startswith("Host dgx-h100-02 is saturated, partly by other processes")


@pytest.mark.parametrize("cpus, foreign, all_busy, flagged", [
    (2, 0.85, 2.0, True),      # 2 cores: two spinning processes share them with our 2 ranks
    (2, 0.4, 2.0, False),      # saturated by our own ranks: nothing to blame on others
    (2, 1.0, 1.2, False),      # others busy, but the host had room
    (224, 100.0, 150.0, False),  # a big node with idle cores left
    (224, 60.0, 210.0, True),
])
def test_saturated_means_nearly_every_cpu_busy_with_a_real_share_from_others(cpus, foreign, all_busy, flagged):
    facts = _with_load(load(H100), "dgx-h100-01", cpus=cpus, busy=foreign, all_busy=all_busy)
    assert ("HOM015" in codes(diagnose(facts))) == flagged
