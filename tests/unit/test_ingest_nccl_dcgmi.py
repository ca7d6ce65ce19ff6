"""nccl-tests output read into the allreduce facts and `dcgmi diag` (table and -j JSON) into the
homogeneity facts, and judged by those probes' diagnoses.

Real outputs: tests/fixtures/gpu_outputs/nccl_*.txt and dcgmi_*.txt (sources in its README.md
and truth.json), and ../shared/reference/gpu-outputs/18, 19 and 20 read in place where that
folder is here. Bad input costs one line naming the file, and the other files are still read.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

import pytest

from ddpdoctor import cli
from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest import dcgmi_diag, nccl_tests
from ddpdoctor.ingest.load import read_tool_output
from ddpdoctor.probes import RunView, get_probe
from ddpdoctor.probes.homogeneity.facts import HomogeneityFacts
from tests.unit.test_ingest_real_outputs import _keyword_in, diagnose_as_the_bar_does

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gpu_outputs"
TRUTH = json.loads((FIXTURES / "truth.json").read_text())
OURS = [f for f in TRUTH["files"] if f["kind"] in ("nccl-tests", "dcgmi-diag")]
SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference" / "gpu-outputs"
PCIE_2080TI = SHARED / "18_nccl_2080ti_x2_pcie_4gbps.txt"
H100_2NODES = SHARED / "19_nccl_h100x16_2node_healthy.txt"
THERMAL = SHARED / "20_dcgmi_diag_r2_gpu0_thermal.txt"
TOPO_P2P_NS = SHARED / "15_topo_2080ti_x2_p2p_not_supported.txt"
needs_shared = pytest.mark.skipif(not PCIE_2080TI.exists(), reason="../shared/reference/gpu-outputs is not here")

HEADER = ("# nThread 1 nGpus 2 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 "
          "agg iters: 1 validation: 1 graph: 0\n#\n# Using devices\n")
COLUMNS = ("#                                                              out-of-place                       in-place\n"
           "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw"
           "   busbw #wrong\n"
           "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)"
           "  (GB/s)\n")


def _two_gpus(name: str, rows: str, host: str = "box") -> str:
    ranks = "".join(f"#  Rank  {r} Group  0 Pid  7 on {host} device  {r} [0x1{r}] {name}\n" for r in (0, 1))
    return HEADER + ranks + "#\n" + COLUMNS + rows + "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 1\n#\n"


# 2 ranks of all_reduce: busbw = algbw; 128 MiB in 33554 us is 4 GB/s, in 1342 us 100 GB/s.
SLOW_ROW = ("   134217728      33554432     float     sum      -1    33554    4.00    4.00      0    33554    4.00    4.00      0"
            "\n")
FAST_ROW = ("   134217728      33554432     float     sum      -1   1342.0  100.01  100.01      0   1342.0  100.01  100.01      0"
            "\n")


def _diagnose_text(tmp_path: pathlib.Path, capsys, text: str) -> tuple[int, dict]:
    """`text` diagnosed as the bar does, in a folder of its own (a test may diagnose several)."""
    folder = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))
    source = folder / "pasted.txt"
    source.write_text(text)
    return diagnose_as_the_bar_does(source, folder, capsys)


def _loud(diagnosis: dict) -> list[dict]:
    return [f for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")]


# -- the real outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", OURS, ids=[f["file"] for f in OURS])
def test_our_real_outputs_are_read_with_the_right_findings(case, tmp_path, capsys):
    code, diagnosis = diagnose_as_the_bar_does(FIXTURES / case["file"], tmp_path, capsys)
    assert code != 3 and diagnosis, f"{case['file']} was not read (exit {code})"
    loud = _loud(diagnosis)
    if case["healthy"]:
        assert not loud, [f["title"] for f in loud]
    else:
        said = [f["title"].lower() for f in loud]
        assert any(_keyword_in(k, t) for k in case["keywords"] for t in said), (case["keywords"], said)


def test_our_real_outputs_cover_both_kinds_healthy_and_not():
    kinds = {(f["kind"], f["healthy"]) for f in OURS}
    assert {("dcgmi-diag", True), ("dcgmi-diag", False), ("nccl-tests", True)} <= kinds


# -- nccl-tests: reading -------------------------------------------------------------------------

def test_two_nodes_become_two_outputs_of_eight_ranks_each_with_the_nccl_ranks_hosts():
    text = (FIXTURES / "nccl_a100x16_2node_healthy.txt").read_text()
    out = nccl_tests.read("a.txt", text)
    parts = out.parts()
    assert [p.host for p in parts] == ["nccl-allreduce-job0-mpiworker-0", "nccl-allreduce-job0-mpiworker-1"]
    assert [sorted(p.gpus) for p in parts] == [list(range(8))] * 2
    facts = parts[1].gpus[3]["allreduce"]
    assert (facts.rank, facts.local_rank, facts.world_size, facts.device) == (11, 3, 16, "cuda:3")
    assert (facts.op, facts.dtype, facts.iters, facts.warmup, facts.gpu_name) == (
        "all_reduce", "float32", 20, 5, "NVIDIA A100-SXM4-40GB")
    largest = [e for e in facts.results if e.size_bytes == 8589934592]
    assert [(e.in_place, e.times_s) for e in largest] == [(False, [0.067689]), (True, [0.067811])]
    # nccl-tests sums #wrong over ranks: it is put on the first rank only.
    assert all(e.wrong == 0 for e in parts[0].gpus[0]["allreduce"].results)
    assert all(e.wrong is None for e in facts.results)


def test_busbw_comes_out_as_nccl_tests_printed_it():
    from ddpdoctor.probes.allreduce.probe import merge_results

    out = nccl_tests.read("a.txt", (FIXTURES / "nccl_a100x16_2node_healthy.txt").read_text())
    facts = {r: f for r, f in enumerate(p.gpus[g]["allreduce"] for p in out.parts() for g in sorted(p.gpus))}
    top = [r for r in merge_results(facts) if r.size_bytes == 8589934592 and not r.in_place][0]
    assert top.busbw_gbps == pytest.approx(237.94, abs=0.05)


def test_an_old_version_without_group_root_or_wrong_columns_is_read():
    text = ("# nThread 1 nGpus 1 minBytes 32 maxBytes 65536 step: 2(factor) warmup iters: 5 iters: 20 validation: 1\n"
            "#\n# Using devices\n"
            "#   Rank  0 Pid 1821213 on AI-A100-Beethoven01 device  0 [0x00] NVIDIA A100-SXM4-40GB\n"
            "#   Rank  1 Pid 1821214 on AI-A100-Beethoven01 device  1 [0x00] NVIDIA A100-SXM4-40GB\n"
            "#\n#                                                     out-of-place                       in-place\n"
            "#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error\n"
            "#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n"
            "       65536         16384   float     sum    20.00    3.28    3.28  0e+00    21.00    3.12    3.12  0e+00\n"
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 3.2\n")
    facts = nccl_tests.read("old.txt", text).gpus[1]["allreduce"]
    assert facts.host == "AI-A100-Beethoven01" and [(e.in_place, e.times_s, e.wrong) for e in facts.results] == [
        (False, [20e-6], None), (True, [21e-6], None)]


def test_mpirun_tags_and_the_collective_named_in_the_output_are_read():
    text = _two_gpus("NVIDIA L4", SLOW_ROW.replace("sum      -1", "none     -1"))
    tagged = "# Collective test starting: all_gather_perf\n" + "".join(
        f"[1,0]<stdout>:{line}\n" for line in text.splitlines())
    facts = nccl_tests.read("ag.txt", tagged).gpus[0]["allreduce"]
    assert facts.op == "all_gather" and facts.host == "box" and len(facts.results) == 2


def test_a_collective_ddpdoctor_does_not_model_is_judged_as_one_with_its_bus_factor_and_says_so():
    out = nccl_tests.read("r.txt", "./build/reduce_perf -g 2\n" + _two_gpus("NVIDIA L4", SLOW_ROW.replace(
        "sum      -1", "sum       0")))
    assert out.gpus[0]["allreduce"].op == "broadcast"
    assert any("reduce as such" in said for said in out.cannot_show)


def test_wrong_elements_become_the_allreduce_probe_s_wrong_result_finding(tmp_path, capsys):
    bad = SLOW_ROW.replace("4.00      0    33554", "4.00     12    33554")
    code, diagnosis = _diagnose_text(tmp_path, capsys, _two_gpus("NVIDIA L4", bad))
    bw001 = [f for f in diagnosis["findings"] if f["code"] == "BW001"]
    assert code == 2 and bw001 and bw001[0]["severity"] == "critical" and "12 wrong elements" in bw001[0]["title"]


# -- nccl-tests: judging the bandwidth -----------------------------------------------------------

def test_a_slow_sweep_on_one_node_is_judged_against_what_its_gpus_model_allows(tmp_path, capsys):
    _, diagnosis = _diagnose_text(tmp_path, capsys, _two_gpus("NVIDIA GeForce RTX 3090", SLOW_ROW))
    bw006 = [f for f in _loud(diagnosis) if f["code"] == "BW006"]
    assert bw006 and "PCIe Gen4 x16 peer-to-peer" in bw006[0]["title"], diagnosis["findings"]
    assert bw006[0]["evidence"]["expected_busbw_gbps"] == pytest.approx(25.2)


def test_a_fast_sweep_or_an_unknown_model_or_several_nodes_gives_no_alarm(tmp_path, capsys):
    for text in (_two_gpus("NVIDIA GeForce RTX 3090", FAST_ROW), _two_gpus("Some Future GPU", SLOW_ROW)):
        _, diagnosis = _diagnose_text(tmp_path, capsys, text)
        assert not _loud(diagnosis), [f["title"] for f in _loud(diagnosis)]
    two_nodes = _two_gpus("NVIDIA GeForce RTX 3090", SLOW_ROW).replace(
        "#  Rank  1 Group  0 Pid  7 on box", "#  Rank  1 Group  0 Pid  7 on other")
    _, diagnosis = _diagnose_text(tmp_path, capsys, two_nodes)
    assert diagnosis["nodes"] == ["box", "other"] and not _loud(diagnosis)


def test_a_live_run_s_facts_name_no_gpu_and_are_judged_as_before():
    facts = nccl_tests.read("x.txt", _two_gpus("NVIDIA GeForce RTX 3090", SLOW_ROW)).gpus
    live = {r: dataclasses.replace(facts[r]["allreduce"], gpu_name=None) for r in facts}
    assert "gpu_name" not in live[0].to_json()
    findings = get_probe("allreduce").diagnose(live, RunView(world_size=2, hosts={0: "box", 1: "box"}))
    assert [f.code for f in findings] == ["BW000"]


@needs_shared
def test_the_2080ti_sweep_is_slow_and_the_healthy_2_node_h100_sweep_is_not(tmp_path, capsys):
    _, slow = diagnose_as_the_bar_does(PCIE_2080TI, tmp_path, capsys)
    assert [f["code"] for f in _loud(slow)] == ["BW006"]
    (tmp_path / "b").mkdir()
    _, healthy = diagnose_as_the_bar_does(H100_2NODES, tmp_path / "b", capsys)
    assert healthy["nodes"] == ["ztan-mig-235z", "ztan-mig-gq73"] and healthy["world_size"] == 16
    assert not _loud(healthy) and "339 GB/s" in healthy["findings"][-1]["title"]


@needs_shared
def test_a_topo_m_read_beside_the_sweep_is_the_same_node(tmp_path, capsys):
    out = tmp_path / "d.json"
    code = cli.main(["diagnose", str(TOPO_P2P_NS), str(PCIE_2080TI), "--json", str(out)])
    capsys.readouterr()
    diagnosis = json.loads(out.read_text())
    assert code != 3 and diagnosis["nodes"] == ["autodl-container-xxxxx"] and diagnosis["world_size"] == 2


# -- nccl-tests: bad input -----------------------------------------------------------------------

def test_a_table_cut_mid_row_or_without_rows_is_one_line_naming_the_file():
    text = _two_gpus("NVIDIA L4", SLOW_ROW)
    cut = text[:text.index(SLOW_ROW) + 40]
    with pytest.raises(UsageError, match=r"^cut\.txt: an nccl-tests row has \d+ columns.*cut mid-row$"):
        nccl_tests.read("cut.txt", cut)
    with pytest.raises(UsageError, match="has no row"):
        nccl_tests.read("empty.txt", text.replace(SLOW_ROW, ""))
    with pytest.raises(UsageError, match="no table header"):
        read_tool_output("h.txt", b"# Avg bus bandwidth    : 3.2\n")


def test_a_bad_file_costs_one_line_and_exit_3_and_the_others_are_still_judged(tmp_path, capsys):
    good = tmp_path / "good.txt"
    good.write_text(_two_gpus("NVIDIA GeForce RTX 3090", SLOW_ROW))
    cut = tmp_path / "cut.txt"
    cut.write_text(_two_gpus("NVIDIA L4", SLOW_ROW)[:-120])
    dcgmi = tmp_path / "dcgmi.json"
    dcgmi.write_text("Successfully ran diagnostic for group.\n" + json.dumps(DCGM3_JSON)[:200])
    out = tmp_path / "d.json"
    code = cli.main(["diagnose", str(good), str(cut), str(dcgmi), "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 3 and "cut.txt" in err and "dcgmi.json" in err
    assert any(f["code"] == "BW006" for f in json.loads(out.read_text())["findings"])


# -- dcgmi diag ----------------------------------------------------------------------------------

def _tests(out, gpu: int) -> dict[str, tuple[str, list[str]]]:
    diagnostic = out.gpus[gpu]["homogeneity"].gpu.diagnostic
    return {t.name: (t.result, t.warnings) for t in diagnostic.tests}


@pytest.mark.skipif(not THERMAL.exists(), reason="../shared/reference/gpu-outputs is not here")
def test_the_wrapped_warning_is_joined_back_and_belongs_to_the_failing_gpu():
    out = dcgmi_diag.read("t.txt", THERMAL.read_text())
    assert sorted(out.gpus) == list(range(8))
    result, warnings = _tests(out, 0)["GPU Memory"]
    assert result == "Fail" and warnings == [
        "GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds into the test for GPU 0 Verify that "
        "the cooling on this machine is functional, including external, thermal material interface, fans, and any "
        "other components."]
    assert _tests(out, 5)["GPU Memory"] == ("Pass", [])


def test_metadata_sections_and_all_gpus_are_read_from_the_table():
    out = dcgmi_diag.read("h.txt", (FIXTURES / "dcgmi_diag_r3_h200x8_healthy.txt").read_text())
    assert sorted(out.gpus) == list(range(8))
    gpu = out.gpus[7]["homogeneity"]
    assert gpu.software.driver == "570.133.20" and gpu.gpu.diagnostic.dcgm_version == "3.3.9"
    tests = gpu.gpu.diagnostic.tests
    assert [(t.name, t.category, t.result) for t in tests if t.name in ("Diagnostic", "EUD Test", "Inforom")] == [
        ("Inforom", "Deployment", "Pass"), ("Diagnostic", "Hardware", "Pass"), ("EUD Test", "Stress", "Skip")]
    failing = dcgmi_diag.read("f.txt", (FIXTURES / "dcgmi_diag_r3_h100x8_cuda_init_fail.txt").read_text())
    assert failing.gpus[0]["homogeneity"].gpu.diagnostic.level == 3


DCGM3_JSON = {"DCGM GPU Diagnostic": {"test_categories": [
    {"category": "Deployment", "tests": [{"name": "Denylist", "results": [{"gpu_ids": "0,1", "status": "PASS"}]}]},
    {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": [
        {"gpu_ids": "0", "status": "PASS"},
        {"gpu_ids": "1", "status": "FAIL", "warnings": [{"warning": "GPU 1 had uncorrectable memory errors",
                                                          "error_id": 8}]}]}]}],
    "version": "3.3.5"}}
DCGM4_JSON = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "memory", "results": [
    {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Fail",
     "warnings": [{"message": "GPU 0 memory test found errors", "error_code": 8}]}]}]}]}}


def test_the_json_forms_are_read_per_gpu():
    out = dcgmi_diag.read("j.json", "Successfully ran diagnostic for group.\n" + json.dumps(DCGM3_JSON, indent=2))
    assert _tests(out, 0) == {"Denylist": ("Pass", []), "GPU Memory": ("Pass", [])}
    assert _tests(out, 1)["GPU Memory"] == ("Fail", ["GPU 1 had uncorrectable memory errors"])
    four = dcgmi_diag.read("k.json", json.dumps(DCGM4_JSON))
    assert _tests(four, 0) == {"memory": ("Fail", ["GPU 0 memory test found errors"])}


def test_a_failed_test_is_a_critical_finding_naming_the_gpu_the_test_and_dcgm_s_words():
    facts = {r: HomogeneityFacts.from_json(p["homogeneity"].to_json()) for r, p in
             dcgmi_diag.read("j.json", json.dumps(DCGM3_JSON)).gpus.items()}
    for f in facts.values():
        f.host = "node"
    findings = get_probe("homogeneity").diagnose(facts, RunView(world_size=2, hosts={0: "node", 1: "node"}))
    hom020 = [f for f in findings if f.code == "HOM020"]
    assert len(hom020) == 1 and hom020[0].severity.label == "critical" and hom020[0].ranks == (1,)
    assert hom020[0].title == ("DCGM diagnostic failed on node GPU 1: GPU Memory: Fail "
                               "(GPU 1 had uncorrectable memory errors)")


def test_a_passing_diagnostic_writes_no_key_a_live_gpu_has_none():
    assert "diagnostic" not in HomogeneityFacts.from_json({"gpu": {"name": "x"}}).to_json()["gpu"]


def test_bad_dcgmi_input_is_one_line_naming_the_file():
    text = json.dumps(DCGM3_JSON, indent=2)
    with pytest.raises(UsageError, match=r"^cut\.json: dcgmi diag -j output is not whole JSON .*cut short\?$"):
        dcgmi_diag.read("cut.json", text[:len(text) // 2])
    with pytest.raises(UsageError, match="before any test"):
        dcgmi_diag.read("w.txt", "| Diagnostic | Result |\n| Warning | GPU 0 hot |\n")
    with pytest.raises(UsageError, match="^b.bin is a binary file"):
        read_tool_output("b.bin", b"\x00\x01dcgmi diag")
