"""homogeneity's typed facts: the wire format is unchanged, reading is tolerant, collect writes as before.

Every snapshot fixture reads into `HomogeneityFacts` and writes back byte for byte; values that are
missing, null or of the wrong JSON kind read as defaults without raising; a freshly built object
writes its keys in the order `collect` always has; and `collect` itself, with its readings
stubbed, writes the very dict (and publishes the very partial result) the untyped code wrote.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from ddpdoctor.core.facts import FactsError
from ddpdoctor.probes.homogeneity import probe as probe_module
from ddpdoctor.probes.homogeneity.facts import (
    GpuFacts,
    HomogeneityFacts,
    HostHwFacts,
    HostLoadFacts,
    MatmulFacts,
    MeasuredFacts,
    SoftwareFacts,
)
from ddpdoctor.probes.homogeneity.probe import Homogeneity

from ddpdoctor.measure.throughput import MatmulThroughput

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "homogeneity"
FILES = sorted(FIXTURES.glob("*.json"))
H100 = FIXTURES / "dgx_h100_healthy.json"
CPU = FIXTURES / "cpu_vm_2core_recorded.json"


def _entries(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["probes"]["homogeneity"]


def _round_trip(entry: Any) -> Any:
    return HomogeneityFacts.from_json(entry).to_json()


# -- the wire format -------------------------------------------------------------------

def test_there_are_fixtures_to_round_trip():
    assert {p.name for p in FILES} >= {H100.name, CPU.name} and len(FILES) == 5


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_fixture_round_trips_byte_for_byte(path):
    text = path.read_text()
    data = json.loads(text)
    data["probes"]["homogeneity"] = [_round_trip(e) for e in data["probes"]["homogeneity"]]
    assert json.dumps(data, indent=2) + "\n" == text  # as core.files.atomic_write_json writes it


def _gpu_lost(e: dict[str, Any]) -> None:
    e["gpu"] = {"name": e["gpu"]["name"], "uuid": e["gpu"]["uuid"], "unknown": "NVML: GPU is lost"}


def _composites_unknown(e: dict[str, Any]) -> None:
    for key in ("ecc_mode", "remapped_rows", "clock_event_reasons"):
        e["gpu"][key] = {"unknown": f"{key}: Not Supported"}


def _host_load(e: dict[str, Any]) -> None:
    e["host_load"] = {"interval_s": 4.0, "cpus": 224, "foreign_cpus_busy": 130.0, "cpus_busy": 220.0,
                      "top": [{"pid": 4242, "name": "python", "cpu_pct": 190}, "not a process"]}


def _odd_values(e: dict[str, Any]) -> None:
    e.update(software=None, measured={"matmul": {"error": "timed out"}, "later_key": True})
    e["host_hw"]["torch_threads"] = "many"
    e["gpu"]["clock_event_reasons"]["active"] = "hw_slowdown"
    e["a_key_from_a_newer_version"] = {"x": [1, None]}


@pytest.mark.parametrize("change", [_gpu_lost, _composites_unknown, _host_load, _odd_values],
                         ids=["gpu-lost", "composites-unknown", "host-load", "odd-values"])
def test_variants_round_trip_too(change):
    entry = copy.deepcopy(_entries(H100)[3])
    change(entry)
    assert json.dumps(_round_trip(entry)) == json.dumps(entry)


# -- tolerant reading ------------------------------------------------------------------

@pytest.mark.parametrize("raw", [None, [], "facts", {}, {k: None for k in
                                                      [f.name for f in dataclasses.fields(HomogeneityFacts)]}])
def test_nothing_usable_reads_as_defaults(raw):
    f = HomogeneityFacts.from_json(raw)
    assert f.software == SoftwareFacts() and f.host_hw == HostHwFacts() and f.env == {}
    assert f.gpu is None and f.measured is None and f.host_load is None and f.host is None and f.rank is None
    assert not f.has_gpu and f.matmul is None and f.step_ms is None


def test_wrong_kinds_inside_the_parts_read_as_defaults_and_readings_stay_as_read():
    f = HomogeneityFacts.from_json({
        "software": None, "measured": {"matmul": 5, "step_ms": None}, "host_load": {"top": "x", "cpus": 8},
    })
    assert f.software == SoftwareFacts() and f.env == {}
    assert f.measured == MeasuredFacts() and f.matmul is None
    assert f.host_load is not None and f.host_load.top == [] and f.host_load.cpus == 8


@pytest.mark.parametrize("field_name, value", [("software", []), ("host_hw", "big"), ("gpu", "H100"), ("env", 3),
                                               ("measured", 5), ("env", [1, 2])])
def test_a_top_level_fact_of_the_wrong_kind_is_refused_not_judged_as_a_default(field_name, value):
    """A snapshot whose homogeneity facts are not objects is a file to regenerate (`ddpdoctor
    diagnose` says so in one line: tests/unit/test_fuzz_inputs.py), as the untyped judging refused it."""
    with pytest.raises(FactsError, match=field_name):
        HomogeneityFacts.from_json({field_name: value})


def test_a_gpu_read_by_parts():
    gpu = GpuFacts.from_json({"name": "GPU", "ecc_mode": {"unknown": "Not Supported"}, "power": None,
                              "clock_event_reasons": {"mask": 4, "active": None},
                              "ecc_uncorrected": {"volatile": {"unknown": "Not Supported"}, "aggregate": 2}})
    assert gpu.ecc_mode.current is None and gpu.ecc_mode.unknown == "Not Supported"
    assert gpu.power.limit_w is None and gpu.clocks.app_sm_mhz is None and gpu.remapped_rows.failed is None
    assert gpu.clock_event_reasons.mask == 4 and gpu.clock_event_reasons.active == []
    assert gpu.ecc_uncorrected.volatile == {"unknown": "Not Supported"} and gpu.ecc_uncorrected.aggregate == 2


def test_an_empty_gpu_object_is_no_gpu():
    assert not HomogeneityFacts.from_json({"gpu": {}}).has_gpu
    assert HomogeneityFacts.from_json({"gpu": {"name": None}}).has_gpu


def test_diagnose_takes_plain_dicts_and_typed_facts_alike():
    entries = _entries(H100)
    as_dicts = Homogeneity().diagnose(dict(enumerate(entries)), _view(entries))
    typed = {r: HomogeneityFacts.from_json(e) for r, e in enumerate(entries)}
    assert Homogeneity().diagnose(typed, _view(entries)) == as_dicts
    assert [f.code for f in as_dicts] == ["HOM000"]


def _view(entries: list[dict[str, Any]]) -> Any:
    from ddpdoctor.probes import RunView

    return RunView(world_size=len(entries), hosts={r: e["host"] for r, e in enumerate(entries)})


# -- key order of freshly built facts ---------------------------------------------------

def test_fresh_facts_write_their_keys_in_collects_order():
    recorded = _entries(CPU)[0]  # written by the real read_device_facts + take_snapshot
    modeled = _entries(H100)[0]
    assert list(HomogeneityFacts().to_json()) == [k for k in recorded if k != "measured"]
    full = HomogeneityFacts(measured=MeasuredFacts(), host_load=HostLoadFacts()).to_json()
    assert list(full) == list(recorded) + ["host_load"]
    assert list(SoftwareFacts().to_json()) == list(recorded["software"])
    assert list(HostHwFacts().to_json()) == list(recorded["host_hw"])
    assert list(GpuFacts().to_json()) == list(modeled["gpu"])
    for key in ("ecc_mode", "ecc_uncorrected", "retired_pages", "remapped_rows", "power", "clocks",
                "clock_event_reasons", "pcie"):
        assert list(getattr(GpuFacts(), key).to_json()) == list(modeled["gpu"][key]), key
    assert list(MatmulFacts().to_json()) == [f.name for f in dataclasses.fields(MatmulThroughput)]
    assert list(MeasuredFacts().to_json()) == ["matmul", "step_ms", "forward_ms"]
    assert list(HostLoadFacts().to_json()) == ["interval_s", "cpus", "foreign_cpus_busy", "cpus_busy", "top"]


# -- collect writes what it always wrote -----------------------------------------------

MATMUL = MatmulThroughput(device="cuda:0", dtype="bfloat16", size=8192, reps=160, median_ms=1.5,
                          flops_per_s=7e14, round_flops_per_s=[6.9e14, 7e14])
LOAD = {"interval_s": 4.0, "cpus": 8, "foreign_cpus_busy": 1.5, "cpus_busy": 7.5,
        "top": [{"pid": 1, "name": "x", "cpu_pct": 150}]}


def _old_collect(device: dict[str, Any], state: dict[str, Any], load_start: bool,
                 load: Optional[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What collect wrote before the facts were typed (partial result, final facts), and the machine's
    boot id since (issue 40: ranks share cores by machine, not by host name)."""
    facts = copy.deepcopy(device)
    facts.update(host="node-a", machine="boot-x", rank=3, local_rank=1, local_world_size=2, world_size=4, source="rank")
    partial = json.loads(json.dumps(facts))
    facts["measured"] = {"matmul": MATMUL.to_json()}
    if facts.get("gpu"):
        facts["gpu"].update(state)
    facts["measured"]["step_ms"] = 12.0
    facts["measured"]["forward_ms"] = 4.0
    if load_start:
        facts["host_load"] = load
    return partial, facts


class _Published:
    """A context's publish_partial: what went on the wire, as the channel serializes it."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, str]] = []

    def __call__(self, probe: str, facts: Any) -> None:
        self.sets.append((probe, json.dumps(facts.to_json() if hasattr(facts, "to_json") else facts)))


@pytest.mark.parametrize("fixture, load_start, load", [
    (H100, False, None), (H100, True, LOAD), (H100, True, None), (CPU, True, LOAD), (CPU, False, None),
], ids=["gpu", "gpu-host-load", "gpu-host-load-unreadable", "cpu-host-load", "cpu"])
def test_collect_writes_the_dict_it_always_wrote(monkeypatch, fixture, load_start, load):
    entry = _entries(fixture)[0]
    device = {k: entry[k] for k in ("device", "software", "host_hw", "gpu", "env")}
    state = {"clocks": dict(entry["gpu"]["clocks"], sm_mhz=1200), "temperature_c": 71} if entry["gpu"] else {}
    steps = [SimpleNamespace(step_ms=v, forward_ms=v / 3) for v in (11.0, 12.0, 13.0)]
    monkeypatch.setattr(probe_module, "read_device_facts", lambda d: copy.deepcopy(device))
    monkeypatch.setattr(probe_module, "boot_id", lambda: "boot-x")
    monkeypatch.setattr(probe_module, "read_gpu_state", lambda uuid: copy.deepcopy(state) if uuid else {})
    monkeypatch.setattr(probe_module, "_measure_matmul", lambda ctx: (MATMUL, None))
    monkeypatch.setattr(probe_module, "run_workload", lambda ctx: SimpleNamespace(steps=steps))
    monkeypatch.setattr(probe_module, "_foreign_load",
                        lambda ctx: HostLoadFacts.from_json(load) if load is not None else None)
    published = _Published()
    ctx = SimpleNamespace(device="cuda:0", rank=3, world_size=4, publish_partial=published,
                          env=SimpleNamespace(hostname="node-a", local_rank=1, local_world_size=2),
                          shared=SimpleNamespace(host_load_start=object() if load_start else None))
    partial, expected = _old_collect(device, state, load_start, load)
    out = Homogeneity().collect(ctx)
    assert json.dumps(out) == json.dumps(expected)
    assert published.sets == [("homogeneity", json.dumps(partial))]


def test_the_probe_names_its_facts_type():
    assert Homogeneity.facts_type is HomogeneityFacts


def test_diagnose_safely_reads_report_keyed_facts_into_the_type():
    from ddpdoctor.probes.base import diagnose_safely

    entries = _entries(H100)
    found = diagnose_safely(Homogeneity(), {str(r): e for r, e in enumerate(entries)}, _view(entries))
    assert [f.code for f in found] == ["HOM000"] and found[0].ranks == tuple(range(len(entries)))
