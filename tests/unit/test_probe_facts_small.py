"""Typed facts of the gpu-count, ddp-smoke and init-hang probes: the wire format is unchanged.

Every snapshot fixture of these probes reads into its facts type and writes back byte for byte;
values that are missing, null or of the wrong JSON kind read as defaults without raising; a
freshly built object writes its keys in the order collect always has (the recorded fixtures
were written by the real collect); init-hang's collect, on a stubbed context, writes exactly
what its rank recorded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddpdoctor.core import keys
from ddpdoctor.probes import RunView, get_probe
from ddpdoctor.probes.ddp_smoke import DdpSmokeFacts, StepFacts
from ddpdoctor.probes.gpu_count.facts import GpuCountFacts, NvmlDevice, NvmlFacts, TorchDevice, TorchFacts
from ddpdoctor.probes.init_hang import InitHang, InitHangFacts, Interface, Route
from ddpdoctor.runtime.workload import StepTiming, WorkloadResult

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GPU_COUNT = sorted((FIXTURES / "gpu_count").glob("*.json"))
INIT_HANG = sorted((FIXTURES / "init_hang").glob("*.json"))
RECORDED_GPU = json.loads((FIXTURES / "gpu_count" / "cpu_vm_2ranks_recorded.json").read_text())["0"]
RECORDED_INIT = json.loads((FIXTURES / "init_hang" / "cpu_vm_2rank_recorded.json").read_text())["facts"]


def rewritten(text: str, per_rank: dict[str, Any]) -> str:
    """The file as json.dumps writes it (indent 1), with `per_rank` in place of the ranks' facts."""
    return json.dumps(per_rank, indent=1) + ("\n" if text.endswith("\n") else "")


# -- round trip ------------------------------------------------------------------------

@pytest.mark.parametrize("path", GPU_COUNT, ids=lambda p: p.name)
def test_gpu_count_fixtures_round_trip_byte_for_byte(path):
    text = path.read_text()
    raw = json.loads(text)
    assert rewritten(text, raw) == text  # the fixture's own format, so the comparison below is of bytes
    typed = {rank: GpuCountFacts.from_json(f) for rank, f in raw.items()}
    assert all(isinstance(t.torch, TorchFacts) and isinstance(t.nvml, NvmlFacts) for t in typed.values())
    assert rewritten(text, {rank: t.to_json() for rank, t in typed.items()}) == text


@pytest.mark.parametrize("path", INIT_HANG, ids=lambda p: p.name)
def test_init_hang_fixtures_round_trip_byte_for_byte(path):
    text = path.read_text()
    raw = json.loads(text)
    assert rewritten(text, raw) == text
    typed = {rank: InitHangFacts.from_json(f) for rank, f in raw["facts"].items()}
    assert all(isinstance(t.route, Route) for t in typed.values())
    assert rewritten(text, dict(raw, facts={rank: t.to_json() for rank, t in typed.items()})) == text


def test_the_fixtures_read_into_typed_values():
    h100 = GpuCountFacts.from_json(json.loads((FIXTURES / "gpu_count" / "h100x8_healthy.json").read_text())["3"])
    assert h100.local_rank == 3 and h100.on_cuda and h100.cuda_count == 8
    assert isinstance(h100.torch.current, TorchDevice) and h100.torch.current_uuid == h100.torch.devices[3].uuid
    assert h100.nvml.count == 8 and isinstance(h100.nvml.devices[0], NvmlDevice)
    assert h100.nvml.devices[3].processes is not None and h100.nvml.devices[3].processes[0].pid == h100.pid
    vm = InitHangFacts.from_json(RECORDED_INIT["1"])
    assert vm.route.interface == "lo" and vm.known_interfaces["eth0"].usable
    assert not vm.known_interfaces["ifb0"].usable and vm.socket_ifname["GLOO_SOCKET_IFNAME"].selects == ["lo"]
    assert vm.rendezvous_s == 1.9664 and vm.backend == "gloo"


def test_ddp_smoke_facts_round_trip_byte_for_byte():
    result = WorkloadResult(device="cpu", backend="gloo", parameters=10, gradient_bytes=40, batch_size=32,
                            steps=[StepTiming(0.2, 1.9, 4.6, 2.4, 0.8, 7.6 + i) for i in range(3)],
                            comm_calls=6, param_sha256="ab" * 32, param_sum=-1.5, loss_last=float("nan"))
    wire = dataclasses.asdict(result)
    facts = DdpSmokeFacts.from_json(json.loads(json.dumps(wire)))
    assert json.dumps(facts.to_json()) == json.dumps(wire)
    assert [s.step_ms for s in facts.steps] == [7.6, 8.6, 9.6] and isinstance(facts.steps[0], StepFacts)


# -- tolerant reading ------------------------------------------------------------------

@pytest.mark.parametrize("junk", [None, [], "text", 3])
def test_anything_that_is_not_an_object_reads_as_defaults(junk):
    assert GpuCountFacts.from_json(junk) == GpuCountFacts()
    assert InitHangFacts.from_json(junk) == InitHangFacts()
    assert DdpSmokeFacts.from_json(junk) == DdpSmokeFacts()


def test_missing_null_and_wrong_kind_values_read_as_defaults():
    gpu = GpuCountFacts.from_json({"local_rank": "3", "device": 5, "env": None, "torch": [1], "nvml": "down",
                                   "pid": None})
    assert (gpu.local_rank, gpu.device, gpu.env, gpu.pid) == (0, "", {}, -1)
    assert gpu.torch == TorchFacts() and gpu.nvml == NvmlFacts() and gpu.nvml.count is None
    torch = TorchFacts.from_json({"cuda_available": 1, "device_count": None, "current": "cuda:0", "devices": {}})
    assert torch == TorchFacts() and torch.current_uuid is None
    smoke = DdpSmokeFacts.from_json({"comm_calls": "14", "loss_last": None, "steps": [{"step_ms": "x"}, None],
                                     "param_sha256": 7})
    assert (smoke.comm_calls, smoke.loss_last, smoke.param_sha256) == (0, 0.0, "")
    assert smoke.steps == [StepFacts(), StepFacts()]
    init = InitHangFacts.from_json({"route": None, "interfaces": {"unknown": "psutil failed"}, "socket_ifname": [],
                                    "resolved": {"unknown": "no such name"}, "hostname_resolves_to": None})
    assert init.route == Route() and init.known_interfaces == {} and init.socket_ifname == {}
    assert init.resolved == [] and init.hostname_resolves_to == []
    assert Interface.from_json({"ipv4": None, "ipv6": "::1"}) == Interface()


def test_diagnose_takes_typed_facts_and_plain_dicts_alike():
    raw = json.loads((FIXTURES / "gpu_count" / "h100x8_nproc2.json").read_text())
    view = RunView(world_size=2, hosts={0: "dgx-h100-01", 1: "dgx-h100-01"})
    probe = get_probe("gpu-count")
    plain = probe.diagnose({int(r): f for r, f in raw.items()}, view)
    typed = probe.diagnose({int(r): GpuCountFacts.from_json(f) for r, f in raw.items()}, view)
    assert [f.code for f in plain] == [f.code for f in typed] == ["GPU002"]


# -- key order of freshly built facts --------------------------------------------------

def test_fresh_gpu_count_facts_write_keys_in_collects_order():
    assert list(GpuCountFacts().to_json()) == list(RECORDED_GPU)
    assert list(TorchFacts().to_json()) == list(RECORDED_GPU["torch"])
    assert list(NvmlFacts(reason="no driver").to_json()) == list(RECORDED_GPU["nvml"])  # NVML unavailable
    h100 = json.loads((FIXTURES / "gpu_count" / "h100x8_healthy.json").read_text())["0"]
    nvml = NvmlFacts(available=True, driver_version="550.90.07", cuda_driver_version=12040, device_count=0)
    assert list(nvml.to_json()) == list(h100["nvml"])
    device = NvmlDevice(index=0, uuid="GPU-x", pci_bus_id="b", name="n", mig_mode=0, processes=[])
    assert list(device.to_json()) == list(h100["nvml"]["devices"][0])
    assert list(NvmlDevice(index=1, error="Unknown Error").to_json()) == ["index", "error"]  # read_nvml's failed handle
    assert list(TorchDevice().to_json()) == list(h100["torch"]["devices"][0])


def test_fresh_ddp_smoke_facts_write_keys_in_collects_order():
    result = WorkloadResult(device="cpu", backend="gloo", parameters=1, gradient_bytes=4, batch_size=1,
                            steps=[StepTiming(0, 0, 0, 0, 0, 0)])
    wire = dataclasses.asdict(result)
    assert list(DdpSmokeFacts().to_json()) == list(wire)
    assert list(StepFacts().to_json()) == list(wire["steps"][0])


def test_fresh_init_hang_facts_write_the_keys_before_rendezvous_writes():
    before = [k for k in RECORDED_INIT["0"] if k not in ("rendezvous_s", "init_s", "backend")]
    assert list(InitHangFacts().to_json()) == before  # the last three are collect's, once known
    every = InitHangFacts(rendezvous_s=0.1, init_s=0.2, backend="gloo")
    assert list(every.to_json()) == list(RECORDED_INIT["0"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_init_hang_collect_completes_the_published_facts_as_recorded(rank):
    recorded = RECORDED_INIT[rank]
    published = {k: v for k, v in recorded.items() if k not in ("rendezvous_s", "init_s", "backend")}
    stores = {keys.result("init-hang", int(rank)): json.loads(json.dumps(published))}
    timeline = [stage("rendezvous", recorded["rendezvous_s"]), stage("ddp", 9.0), stage("init", recorded["init_s"])]
    ctx = SimpleNamespace(rank=int(rank), backend="gloo", channel=SimpleNamespace(get=stores.get),
                          state=SimpleNamespace(timeline=timeline))
    assert json.dumps(InitHang().collect(ctx)) == json.dumps(recorded)


def stage(name: str, took: float) -> SimpleNamespace:
    """A finished stage of the rank's timeline, `took` seconds long."""
    return SimpleNamespace(name=name, started=0.0, ended=took)
