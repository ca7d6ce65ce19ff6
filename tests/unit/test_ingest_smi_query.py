"""`nvidia-smi -q` (text) and `-q -x` (XML) read into the homogeneity facts (ddpdoctor/ingest/smi_query.py),
and the NVML side that records the same facts in a snapshot (measure/gpu_health.read_modes).

Real outputs: the shared ones in ../shared/reference/gpu-outputs (scored by test_ingest_real_outputs.py;
here, what was read from them) and ours in tests/fixtures/gpu_outputs (sources in its README.md and
truth.json), scored the same way. The driver generations' names are checked on small excerpts
written in each generation's layout; the snapshot/XML parity on a modeled pair.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from ddpdoctor import cli
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.findings import EXIT_WARNING
from ddpdoctor.ingest.load import read_tool_output
from ddpdoctor.ingest.smi_query import read_text, read_xml
from ddpdoctor.measure import gpu_health, node, nvml
from ddpdoctor.probes.homogeneity.facts import GpuFacts, HomogeneityFacts
from tests.unit.test_gpu_health import H100, fake_pynvml, gpu
from tests.unit.test_ingest_real_outputs import SHARED, TRUTH, _keyword_in, diagnose_as_the_bar_does

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gpu_outputs"
OURS = [f for f in json.loads((FIXTURES / "truth.json").read_text())["files"] if f["kind"].startswith("nvidia-smi-q")]
SHARED_FILES = {f["file"] for f in TRUTH["files"]}
PAIR_XML, PAIR_SNAPSHOT = FIXTURES / "smi_qx_modeled_a100x2.xml", FIXTURES / "smi_qx_modeled_a100x2.snapshot.json"


def _gpus(path: pathlib.Path) -> dict[int, GpuFacts]:
    out = read_tool_output(str(path), path.read_bytes())
    facts = {i: probes["homogeneity"] for i, probes in out.gpus.items()}
    assert all(isinstance(f, HomogeneityFacts) and f.gpu is not None for f in facts.values())
    return {i: f.gpu for i, f in facts.items() if f.gpu is not None}


def _shared(name: str) -> pathlib.Path:
    if name not in SHARED_FILES:
        pytest.skip("../shared/reference/gpu-outputs is not here")
    return SHARED / name


# -- our real outputs, scored as truth.json says -------------------------------------------------

def test_we_hold_our_own_real_outputs():
    assert len(OURS) >= 3 and sum(f["healthy"] for f in OURS) >= 2
    assert all((FIXTURES / f["file"]).is_file() and f["url"].startswith("https://github.com/") for f in OURS)


@pytest.mark.parametrize("case", OURS, ids=[f["file"] for f in OURS])
def test_a_real_output_from_a_public_source_is_read_with_the_right_findings(case, tmp_path, capsys):
    code, diagnosis = diagnose_as_the_bar_does(FIXTURES / case["file"], tmp_path, capsys)
    assert code != 3 and diagnosis, f"{case['file']} was not read (exit {code})"
    assert diagnosis["findings"][0]["code"] == "INP001"
    loud = [f["title"].lower() for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")]
    if case["healthy"]:
        assert not loud
    else:
        assert any(_keyword_in(k, t) for k in case["keywords"] for t in loud), (case["keywords"], loud)


# -- what is read from the shared real outputs --------------------------------------------------

def test_a10_remap_pending_is_read_field_by_field():
    gpu = _gpus(_shared("01_smi_q_a10_remap_pending.txt"))[0]
    assert (gpu.name, gpu.uuid, gpu.pci_bus_id) == ("NVIDIA A10", "GPU-73d12ef7-f589-f867-4259-c7090ab44736",
                                                     "00000000:07:00.0")
    assert gpu.remapped_rows.to_json() == {"correctable": 0, "uncorrectable": 4, "pending": True, "failed": False}
    assert gpu.memory_total_bytes == 23028 * 2**20 and gpu.performance_state == "P8"
    assert gpu.power.to_json() == {"limit_w": 150.0, "default_w": 150.0, "enforced_w": 150.0, "draw_w": 43.89}
    assert gpu.clock_event_reasons.active == ["gpu_idle"] and gpu.persistence_mode is True
    assert gpu.pcie.to_json() == {"gen": 4, "max_gen": 4, "width": 16, "max_width": 16}
    assert gpu.retired_pages.single_bit == {"unknown": "nvidia-smi says N/A"}


def test_an_excerpt_without_a_gpu_line_is_gpu_0_and_says_what_it_cannot_show():
    path = _shared("03_smi_q_ecc_sram_uncorrectable.txt")
    out = read_text(str(path), path.read_text())
    assert list(out.gpus) == [0]
    gpu = out.gpus[0]["homogeneity"].gpu
    assert gpu is not None and gpu.ecc_uncorrected.to_json() == {"volatile": 1, "aggregate": 5}
    assert gpu.name is None and gpu.power.limit_w is None  # not shown: unknown, never guessed
    assert "GPU model and UUID" in out.cannot_show and "power limits and draw" in out.cannot_show
    assert "ECC mode and error counts" not in out.cannot_show


def test_eight_gpus_keep_nvidia_smis_order_and_their_bus_ids():
    gpus = _gpus(_shared("04_smi_q_h100x8_hw_power_brake.txt"))
    assert sorted(gpus) == list(range(8)) and [g.nvml_index for g in gpus.values()] == list(range(8))
    assert [g.pci_bus_id for g in gpus.values()][:2] == ["00000000:19:00.0", "00000000:3B:00.0"]
    assert all(g.clock_event_reasons.active == ["hw_slowdown", "hw_power_brake_slowdown"] for g in gpus.values())


def test_mig_mode_and_a_narrow_link_are_read_from_the_xml():
    mig = _gpus(_shared("08_smi_qx_a100_mig.xml"))[0]
    assert mig.mig_mode is not None and mig.mig_mode.to_json() == {"current": True, "pending": True}
    assert mig.remapped_rows.unknown == "nvidia-smi says N/A"
    t4 = _gpus(_shared("09_smi_qx_t4_pcie_x8.xml"))[0]
    assert t4.pcie.to_json() == {"gen": 3, "max_gen": 3, "width": 8, "max_width": 16} and t4.performance_state == "P0"


# -- every driver generation's names ------------------------------------------------------------

OLD_TEXT = """==============NVSMI LOG==============

Driver Version                      : 390.116

Attached GPUs                       : 1
GPU 00000000:04:00.0
    Product Name                    : Tesla K80
    Clocks Throttle Reasons
        Idle                        : Not Active
        HW Slowdown                 : Active
        SW Thermal Slowdown         : Active
    ECC Errors
        Volatile
            Single Bit
                Device Memory       : 7
                Total               : 7
            Double Bit
                Device Memory       : 2
                Register File       : 0
                Total               : 2
        Aggregate
            Single Bit
                Total               : 9
            Double Bit
                Total               : 3
    Retired Pages
        Single Bit ECC              : 1
        Double Bit ECC              : 2
        Pending                     : Yes
    Power Readings
        Power Draw                  : 50.00 W
        Power Limit                 : 149.00 W
        Default Power Limit         : 149.00 W
        Enforced Power Limit        : 120.00 W
"""

R550_TEXT = """GPU 00000000:19:00.0
    Clocks Event Reasons
        Idle                              : Not Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Active
    ECC Errors
        Volatile
            SRAM Correctable              : 4
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 2
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 4
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 2
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 1
            SRAM Threshold Exceeded       : No
    GPU Power Readings
        Average Power Draw                : 71.00 W
        Instantaneous Power Draw          : 72.50 W
        Current Power Limit               : 700.00 W
        Requested Power Limit             : 700.00 W
        Default Power Limit               : 700.00 W
"""


def test_the_old_layout_single_and_double_bit_counters_and_enforced_limit():
    gpu = read_text("old.txt", OLD_TEXT).gpus[0]["homogeneity"].gpu
    assert gpu is not None
    assert gpu.ecc_uncorrected.to_json() == {"volatile": 2, "aggregate": 3}  # double bit: the uncorrectable ones
    assert gpu.retired_pages.to_json() == {"pending": True, "single_bit": 1, "double_bit": 2}
    assert gpu.power.to_json() == {"limit_w": 149.0, "default_w": 149.0, "enforced_w": 120.0, "draw_w": 50.0}
    assert gpu.clock_event_reasons.active == ["hw_slowdown", "sw_thermal_slowdown"]


def test_the_r550_layout_sums_parity_and_sec_ded_and_reads_event_reasons():
    gpu = read_text("r550.txt", R550_TEXT).gpus[0]["homogeneity"].gpu
    assert gpu is not None and gpu.pci_bus_id == "00000000:19:00.0"
    assert gpu.ecc_uncorrected.to_json() == {"volatile": 3, "aggregate": 4}
    assert gpu.power.to_json() == {"limit_w": 700.0, "default_w": 700.0, "enforced_w": 700.0, "draw_w": 72.5}
    assert gpu.clock_event_reasons.active == ["hw_thermal_slowdown"]


def test_throttle_and_event_reason_tags_of_the_xml_give_the_same_names():
    def reasons(family: str) -> list[str]:
        xml = (f"<nvidia_smi_log><gpu id='00000000:01:00.0'><clocks_{family}_reasons>"
               f"<clocks_{family}_reason_gpu_idle>Not Active</clocks_{family}_reason_gpu_idle>"
               f"<clocks_{family}_reason_hw_power_brake_slowdown>Active</clocks_{family}_reason_hw_power_brake_slowdown>"
               f"<clocks_{family}_reason_display_clocks_setting>Active</clocks_{family}_reason_display_clocks_setting>"
               f"</clocks_{family}_reasons></gpu></nvidia_smi_log>")
        gpu = read_xml("x.xml", xml).gpus[0]["homogeneity"].gpu
        assert gpu is not None
        return gpu.clock_event_reasons.active
    assert reasons("throttle") == reasons("event") == ["hw_power_brake_slowdown", "display_clock_setting"]


# -- a snapshot and an nvidia-smi -q -x of the same node say the same ---------------------------

def test_the_xml_holds_what_the_snapshot_recorded_for_the_same_gpus():
    xml = _gpus(PAIR_XML)
    snapshot = json.loads(PAIR_SNAPSHOT.read_text())["probes"]["homogeneity"]
    compared = 0
    for index, entry in enumerate(snapshot):
        for key, value in _leaves(xml[index].to_json()).items():
            if value is not None and not (isinstance(value, dict) and "unknown" in value):  # shown, and not N/A
                assert value == _leaves(entry["gpu"])[key], (index, key)
                compared += 1
    assert compared >= 30


def _leaves(facts: dict[str, object]) -> dict[str, object]:
    """`power.limit_w`-style keys: nested readings compared one by one."""
    out: dict[str, object] = {}
    for key, value in facts.items():
        if isinstance(value, dict) and "unknown" not in value:
            out |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            out[key] = value
    return out


def test_a_snapshot_and_the_xml_of_the_same_node_give_the_same_findings(tmp_path, capsys):
    folder = tmp_path / "a100-node-07"  # the snapshot's host: the XML's node is named by its folder
    folder.mkdir()
    shutil.copyfile(PAIR_XML, folder / "nvidia-smi-q.xml")

    def findings(path: pathlib.Path) -> list[tuple[str, str, str, object]]:
        out = tmp_path / f"{path.name}.diagnosis.json"
        assert cli.main(["diagnose", str(path), "--json", str(out)]) == EXIT_WARNING
        capsys.readouterr()
        return [(f["code"], f["severity"], f["title"], f["evidence"]) for f in json.loads(out.read_text())["findings"]
                if f["code"] != "INP001"]

    from_snapshot = findings(PAIR_SNAPSHOT)
    assert [f[0] for f in from_snapshot] == ["HOM007", "HOM010", "HOM016", "HOM017"]
    assert findings(folder) == from_snapshot


# -- bad input: one line, exit 3, the other files still read ------------------------------------

def test_a_truncated_xml_is_one_line_naming_the_file():
    text = (FIXTURES / "smi_qx_gtx1660ti_idle_healthy.xml").read_text()
    with pytest.raises(UsageError) as caught:
        read_tool_output("cut.xml", text[: len(text) // 2].encode())
    said = str(caught.value)
    assert "\n" not in said and said.startswith("cut.xml ") and "cut short" in said


@pytest.mark.parametrize("text, expected", [
    ("<nvidia_smi_log><driver_version>550.54.15</driver_version></nvidia_smi_log>", "no <gpu> element"),
    ('<!DOCTYPE x [<!ENTITY a "b">]><nvidia_smi_log><gpu>&a;</gpu></nvidia_smi_log>', "declares XML entities"),
    ("==============NVSMI LOG==============\n\nAttached GPUs : 1\n", "holds none of its GPU sections"),
])
def test_an_output_with_no_gpu_in_it_is_one_line(text, expected):
    with pytest.raises(UsageError) as caught:
        read_tool_output("bad.txt", text.encode())
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_file_exits_3_and_the_good_one_is_still_judged(tmp_path, capsys):
    cut = tmp_path / "cut.xml"
    cut.write_text((FIXTURES / "smi_qx_modeled_a100x2.xml").read_text()[:3000])
    out = tmp_path / "diagnosis.json"
    code = cli.main(["diagnose", str(cut), str(PAIR_XML), "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 3 and "cut.xml" in err
    assert "HOM016" in {f["code"] for f in json.loads(out.read_text())["findings"]}


# -- the snapshot's side: P-state and MIG mode through NVML -------------------------------------

@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(nvml, "_state", {"initialised": False, "error": None})
    fake = fake_pynvml([gpu()])
    fake.nvmlDeviceGetPerformanceState = lambda handle: 0
    fake.nvmlDeviceGetMigMode = lambda handle: [1, 0]
    monkeypatch.setattr(nvml, "_module", lambda: fake)
    return fake


def test_read_modes_gives_the_pstate_and_mig_mode_as_nvidia_smi_prints_them(fake_nvml):
    assert gpu_health.read_modes(H100["uuid"]) == {"performance_state": "P0",
                                                   "mig_mode": {"current": True, "pending": False}}
    assert gpu_health.read_modes("GPU-not-here") == {}


def test_an_unknown_pstate_and_a_gpu_without_mig_are_unknown(fake_nvml):
    fake_nvml.nvmlDeviceGetPerformanceState = lambda handle: 32  # NVML_PSTATE_UNKNOWN
    del fake_nvml.nvmlDeviceGetMigMode
    modes = gpu_health.read_modes(H100["uuid"])
    assert set(modes["performance_state"]) == {"unknown"} and "32" in modes["performance_state"]["unknown"]
    assert set(modes["mig_mode"]) == {"unknown"}


def test_the_pstate_is_read_again_after_load_with_the_clocks(fake_nvml):
    state = node.read_gpu_state(H100["uuid"])
    assert state["performance_state"] == "P0" and "mig_mode" not in state and "clocks" in state
