"""`nvidia-smi topo -m` (with `topo -p2p` matrices) and `nvidia-smi nvlink --status` read into the
topology probe's facts, and judged by its diagnosis as `check` would judge the node.

Real outputs: tests/fixtures/gpu_outputs/topo_*.txt (sources in its README.md and truth.json),
and ../shared/reference/gpu-outputs/15 and 17 read in place where that folder is here.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from ddpdoctor import cli
from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest import nvlink_status, topo_matrix
from ddpdoctor.ingest.load import read_tool_output
from ddpdoctor.probes.topology.checks import node_views
from ddpdoctor.probes.topology.facts import GpuPair, TopologyFacts

from ddpdoctor.probes.base import RunView

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gpu_outputs"
TRUTH = json.loads((FIXTURES / "truth.json").read_text())
OURS = [f for f in TRUTH["files"] if f["kind"] in ("topo-m", "nvlink-status")]
SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference" / "gpu-outputs"
NVLINK_A100 = SHARED / "17_nvlink_a100x8_healthy.txt"
TOPO_P2P_NS = SHARED / "15_topo_2080ti_x2_p2p_not_supported.txt"
needs_shared = pytest.mark.skipif(not NVLINK_A100.exists(), reason="../shared/reference/gpu-outputs is not here")


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def node_of(out):
    """The node facts a reader put on the first GPU's topology facts."""
    return out.gpus[min(out.gpus)]["topology"].node


def diagnose(tmp_path: pathlib.Path, capsys, *texts: str) -> tuple[int, dict, str]:
    paths = []
    for i, text in enumerate(texts):
        path = tmp_path / f"output{i}.txt"
        path.write_text(text)
        paths.append(str(path))
    out = tmp_path / "diagnosis.json"
    code = cli.main(["diagnose", *paths, "--json", str(out)])
    err = capsys.readouterr().err
    return code, (json.loads(out.read_text()) if out.exists() else {}), err


def loud(diagnosis: dict) -> list[dict]:
    return [f for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")]


# -- the real outputs of tests/fixtures/gpu_outputs -------------------------------------------

@pytest.mark.parametrize("case", OURS, ids=[f["file"] for f in OURS])
def test_a_real_output_is_judged_as_its_truth_says(case, tmp_path, capsys):
    code, diagnosis, _ = diagnose(tmp_path, capsys, fixture(case["file"]))
    assert code != 3 and diagnosis
    titles = [f["title"].lower() for f in loud(diagnosis)]
    if case["healthy"]:
        assert titles == []
    else:
        assert any(re.search(r"\b" + re.escape(k), t) for k in case["keywords"] for t in titles), titles
    assert any(f["code"] == "INP001" and case["kind"] in f["title"] for f in diagnosis["findings"])


def test_every_gpu_row_gives_its_numa_node_cpus_and_every_pair_its_path():
    out = topo_matrix.read("h100.txt", fixture("topo_h100x8_nv18_nics_healthy.txt"))
    node = node_of(out)
    assert sorted(out.gpus) == list(range(8))
    assert [g.numa_node for g in node.gpus.gpus] == [0] * 4 + [1] * 4
    assert node.gpus.gpus[5].cpu_affinity == "48-95,144-191"
    assert len(node.gpus.pairs) == 28 and {p.level for p in node.gpus.pairs} == {"NV18"}
    assert [n.name for n in node.nics] == [f"mlx5_{i}" for i in range(8)]  # by the NIC legend
    assert [out.gpus[i]["topology"].gpu_index for i in range(8)] == list(range(8))
    assert all(out.gpus[i]["topology"].node is None for i in range(1, 8))  # the node's once, as a live run


def test_the_nic_legend_names_every_nic_column():
    node = node_of(topo_matrix.read("a100.txt", fixture("topo_a100x8_nv12_nics_healthy.txt")))
    assert len(node.nics) == 17 and node.nics[-1].name == "mlx5_bond_0"
    assert {p.level for p in node.gpus.pairs} == {"NV12"}


def test_an_old_matrix_with_tabs_soc_and_a_nic_named_by_its_device():
    out = topo_matrix.read("k40.txt", fixture("topo_k40mx4_soc_mlx4_healthy.txt"))
    node = node_of(out)
    levels = {(p.a, p.b): p.level for p in node.gpus.pairs}
    assert levels[(0, 1)] == "PHB" and levels[(0, 2)] == "SYS"  # SOC is SYS's name before NODE existed
    assert [n.name for n in node.nics] == ["mlx4_0"]
    assert [g.numa_node for g in node.gpus.gpus] == [None] * 4  # no NUMA Affinity column: not known
    assert node.gpus.gpus[2].cpu_affinity == "6-11"


def test_a_terminal_copy_with_the_headers_underline_escapes_reads_the_same():
    plain = fixture("topo_1080ti_x2_phb_healthy.txt")
    underlined = plain.replace("        GPU0    GPU1    CPU Affinity    NUMA Affinity",
                               "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\x1b[0m")
    assert underlined != plain
    read = node_of(topo_matrix.read("t.txt", underlined))
    assert read.to_json() == node_of(topo_matrix.read("t.txt", plain)).to_json()


def test_numa_affinity_na_is_not_known():
    node = node_of(topo_matrix.read("1080.txt", fixture("topo_1080ti_x2_phb_healthy.txt")))
    assert [g.numa_node for g in node.gpus.gpus] == [None, None]
    assert node.gpus.pairs[0].level == "PHB"


def test_what_topo_m_cannot_show_is_said_not_guessed():
    out = topo_matrix.read("a10.txt", fixture("topo_a10x4_sys_healthy.txt"))
    assert any("NVLink" in c for c in out.cannot_show) and any("peer-to-peer" in c for c in out.cannot_show)
    facts = out.gpus[0]["topology"]
    assert facts.gpu_uuid is None and facts.node.gpus.gpus[0].name is None
    assert facts.placement.unknown == "not known from topo-m"


# -- peer-to-peer: the -p2p matrices ---------------------------------------------------------

P2P_READ_CNS = """
$ nvidia-smi topo -p2p r
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7
 GPU0   X       CNS     OK      OK      OK      OK      OK      OK
 GPU1   CNS     X       OK      OK      OK      OK      OK      OK
 GPU2   OK      OK      X       OK      OK      OK      OK      OK
 GPU3   OK      OK      OK      X       OK      OK      OK      OK
 GPU4   OK      OK      OK      OK      X       OK      OK      OK
 GPU5   OK      OK      OK      OK      OK      X       DR      OK
 GPU6   OK      OK      OK      OK      OK      DR      X       OK
 GPU7   OK      OK      OK      OK      OK      OK      OK      X

Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
"""


def test_a_p2p_read_matrix_fills_each_pairs_read_status():
    """A real A100 matrix with a -p2p r block added by this test (CNS on 0-1, DR on 5-6)."""
    out = topo_matrix.read("a100.txt", fixture("topo_a100x8_nv12_nics_healthy.txt") + P2P_READ_CNS)
    pairs = {(p.a, p.b): p for p in node_of(out).gpus.pairs}
    assert pairs[(0, 1)].p2p_read == "CNS" and pairs[(0, 1)].level == "NV12"
    assert pairs[(5, 6)].p2p_read == "DISABLED"  # DR: NVML's DISABLED_BY_REGKEY, as a live run writes it
    assert pairs[(2, 3)].p2p_read == "OK" and pairs[(2, 3)].p2p_pci is None


def test_p2p_not_supported_where_nvlink_allows_it_is_a_warning(tmp_path, capsys):
    code, diagnosis, _ = diagnose(tmp_path, capsys, fixture("topo_a100x8_nv12_nics_healthy.txt") + P2P_READ_CNS)
    p2p = [f for f in loud(diagnosis) if f["code"] == "TOP004"]
    assert code == 1 and len(p2p) == 1 and "peer-to-peer" in p2p[0]["title"]
    assert {p["gpus"] for p in p2p[0]["evidence"]["pairs"]} == {"0-1", "5-6"}


def test_p2p_not_supported_across_a_host_bridge_is_not_a_fault(tmp_path, capsys):
    p2p = "$ nvidia-smi topo -p2p r\n        GPU0    GPU1\n GPU0   X       CNS\n GPU1   CNS     X\n"
    text = fixture("topo_1080ti_x2_phb_healthy.txt") + p2p
    assert node_of(topo_matrix.read("t.txt", text)).gpus.pairs[0].p2p_read == "CNS"
    code, diagnosis, _ = diagnose(tmp_path, capsys, text)
    assert code == 0 and loud(diagnosis) == []  # PHB: NCCL would not use P2P there anyway


def test_a_p2p_matrix_without_its_command_is_read_as_not_known():
    bare = P2P_READ_CNS.replace("$ nvidia-smi topo -p2p r\n", "")
    out = topo_matrix.read("a100.txt", fixture("topo_a100x8_nv12_nics_healthy.txt") + bare)
    pairs = node_of(out).gpus.pairs
    assert all(p.p2p_read is None and p.p2p_pci is None for p in pairs)
    assert any("which peer-to-peer capability" in c for c in out.cannot_show)


@pytest.mark.skipif(not TOPO_P2P_NS.exists(), reason="../shared/reference/gpu-outputs is not here")
def test_the_shared_2080ti_p2p_p_matrix_lands_on_the_pci_capability():
    out = topo_matrix.read("15.txt", TOPO_P2P_NS.read_text())
    pair = node_of(out).gpus.pairs[0]
    assert (pair.level, pair.p2p_pci, pair.p2p_read) == ("PIX", "NS", None)
    assert [g.numa_node for g in node_of(out).gpus.gpus] == [1, 1]


# -- bad input: one line naming the file --------------------------------------------------

def test_a_row_cut_short_is_one_line_naming_the_file():
    text = fixture("topo_h100x8_nv18_nics_healthy.txt")
    cut = text[:text.index("GPU5    NV18") + 30]
    with pytest.raises(UsageError) as err:
        topo_matrix.read("node07/topo.txt", cut)
    message = str(err.value)
    assert "node07/topo.txt" in message and "GPU5" in message and "cut short" in message and "\n" not in message


def test_missing_gpu_rows_and_a_row_without_its_affinity_are_cut_short():
    text = fixture("topo_a10x4_sys_healthy.txt")
    with pytest.raises(UsageError, match="no row for GPU2, GPU3"):
        topo_matrix.read("t.txt", text[:text.index("GPU2    SYS")])
    with pytest.raises(UsageError, match="lacks its NUMA Affinity"):
        topo_matrix.read("t.txt", text.replace("0-127   0               N/A", "0-127", 1))


def test_a_cut_file_exits_3_and_the_other_files_are_still_judged(tmp_path, capsys):
    text = fixture("topo_h100x8_nv18_nics_healthy.txt")
    code, diagnosis, err = diagnose(tmp_path, capsys, text[:text.index("GPU3    NV18") + 20],
                                    fixture("topo_a10x4_sys_healthy.txt"))
    assert code == 3
    assert len(err.strip().splitlines()) == 1 and "output0.txt" in err and "cut short" in err
    assert [f for f in diagnosis["findings"] if f["code"] == "INP001" and "output1.txt" in f["title"]]


# -- nvlink --status ----------------------------------------------------------------------

NVLINK_TWO_DOWN = """GPU 0: Tesla V100-SXM2-32GB (UUID: GPU-0e5a4f2c-1111-2222-3333-444455556666)
         Link 0: 25.781 GB/s
         Link 1: 25.781 GB/s
         Link 2: 25.781 GB/s
         Link 3: 25.781 GB/s
         Link 4: 25.781 GB/s
         Link 5: 25.781 GB/s
GPU 3: Tesla V100-SXM2-32GB (UUID: ...)
         Link 0: 25.781 GB/s
         Link 1: 25.781 GB/s
         Link 2: 25.781 GB/s
         Link 3: <inactive>
         Link 4: 25.781 GB/s
         Link 5: <inactive>
"""


def test_each_link_is_up_with_its_speed_and_down_when_inactive():
    out = nvlink_status.read("nv.txt", NVLINK_TWO_DOWN)
    gpus = {g.index: g for g in node_of(out).gpus.gpus}
    assert [link.active for link in gpus[3].nvlinks] == [True, True, True, False, True, False]
    assert gpus[0].uuid.startswith("GPU-0e5a") and gpus[3].uuid is None  # "..." is no UUID
    assert out.gpus[3]["topology"].gpu_index == 3 and out.gpus[0]["topology"].gpu_uuid == gpus[0].uuid
    assert gpus[3].nvlinks[0].remote_type == {"unknown": "not known from nvlink-status"}


def test_a_gpu_with_links_down_while_its_peer_has_all_up_is_a_warning(tmp_path, capsys):
    code, diagnosis, _ = diagnose(tmp_path, capsys, NVLINK_TWO_DOWN)
    down = [f for f in loud(diagnosis) if f["code"] == "TOP002"]
    assert code == 1 and [f["title"] for f in down] == ["GPU 3 on node: 4 of 6 NVLinks active"]
    assert down[0]["evidence"]["inactive_links"] == [3, 5] and down[0]["ranks"] == [1]


def test_a_gpu_whose_links_are_all_inactive_ends_a_listing_without_being_cut():
    text = NVLINK_TWO_DOWN + ("GPU 4: Tesla V100-SXM2-32GB (UUID: GPU-0e5a4f2c-1111-2222-3333-444455557777)\n"
                              "\t NVML: Unable to retrieve NVLink information as all links are inActive\n")
    assert node_of(nvlink_status.read("nv.txt", text)).gpus.gpus[-1].nvlinks == []


def test_an_unbridged_board_ends_a_real_listing_with_an_unindented_nvml_line():
    out = nvlink_status.read("a6000.txt", fixture("nvlink_a6000x3_one_unbridged_healthy.txt"))
    gpus = node_of(out).gpus.gpus
    assert [len(g.nvlinks) for g in gpus] == [4, 4, 0] and all(link.active for link in gpus[0].nvlinks)


def test_drivers_that_print_no_uuid_are_detected_and_matched_by_index(tmp_path, capsys):
    old = ("nvidia-smi nvlink --status\n\nGPU 0: Tesla V100-SXM2-32GB\n\t Link 0: 25.781 GB/s\n\t Link 1: 25.781 GB/s\n"
           "GPU 1: Tesla V100-SXM2-32GB\n\t Link 0: 25.781 GB/s\n\t Link 1: <inactive>\n"
           "GPU 2: Tesla V100-PCIE-16GB\n\t (Not supported)\n")
    out = read_tool_output("old.txt", old.encode())
    assert out.kind == "nvlink-status" and out.gpus[1]["topology"].gpu_uuid is None
    code, diagnosis, _ = diagnose(tmp_path, capsys, old)
    assert [f["title"] for f in loud(diagnosis)] == ["GPU 1 on node: 1 of 2 NVLinks active"]


def test_a_listing_cut_after_a_gpu_line_or_mid_link_is_one_line():
    with pytest.raises(UsageError, match="GPU 4 lists no NVLink .* cut short"):
        nvlink_status.read("nv.txt", NVLINK_TWO_DOWN + "GPU 4: Tesla V100-SXM2-32GB (UUID: GPU-0e5a4f2c-1)\n")
    with pytest.raises(UsageError, match="nv.txt: line 14 .*cut short"):
        nvlink_status.read("nv.txt", NVLINK_TWO_DOWN.rstrip("\n").rsplit(": ", 1)[0] + ": 25.7")


def test_nvlink_counters_are_another_output_not_link_states(tmp_path, capsys):
    counters = ("GPU 0: A100-PCIE-40GB (UUID: GPU-f41a1a93-42ec-1dc1-e936-03c617b58fd4)\n"
                "         Link 0: Data Tx: 8299479 KiB\n         Link 0: Data Rx: 7492431 KiB\n")
    code, _, err = diagnose(tmp_path, capsys, counters, fixture("topo_a10x4_sys_healthy.txt"))
    assert code == 3 and "is not a link state" in err and len(err.strip().splitlines()) == 1


@needs_shared
def test_the_shared_a100_listing_has_twelve_links_up_on_each_gpu():
    out = nvlink_status.read("17.txt", NVLINK_A100.read_text())
    gpus = node_of(out).gpus.gpus
    assert len(gpus) == 8 and all(len(g.nvlinks) == 12 and all(link.active for link in g.nvlinks) for g in gpus)


@needs_shared
def test_topo_and_nvlink_of_one_node_merge_gpu_by_gpu(tmp_path, capsys):
    code, diagnosis, _ = diagnose(tmp_path, capsys, fixture("topo_a100x8_nv12_nics_healthy.txt"),
                                  NVLINK_A100.read_text())
    assert code == 0 and loud(diagnosis) == [] and diagnosis["world_size"] == 8
    assert diagnosis["nodes"] == ["node"]


# -- the wire format of a live run does not change ----------------------------------------

def test_fresh_facts_write_no_key_only_a_tool_output_fills():
    assert "gpu_index" not in TopologyFacts(rank=0, host="h").to_json()
    assert "p2p_pci" not in GpuPair(a=0, b=1, level="PIX", p2p_read="OK").to_json()
    read = TopologyFacts.from_json({"rank": 0, "gpu_uuid": "GPU-a"})
    assert read.to_json() == {"rank": 0, "gpu_uuid": "GPU-a"}


def test_a_uuid_match_wins_over_an_index():
    node = {"gpus": {"gpus": [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}], "pairs": []}}
    facts = {0: {"host": "h", "gpu_uuid": "GPU-b", "gpu_index": 0, "node": node},
             1: {"host": "h", "gpu_index": 1}, 2: {"host": "h", "gpu_index": 9}}
    view = node_views(facts, RunView(world_size=3))[0]
    assert view.rank_gpu == {0: 1, 1: 1}  # rank 2 names no GPU of the node


def test_a_paste_with_its_prompt_line_is_read_and_an_unknown_link_is_said_not_modelled_once(tmp_path, capsys):
    """A user's paste starts with their shell prompt and command (issue 41: once "not valid JSON"); the
    PCIe link behind SYS is not in `topo -m`, so the all-reduce is not modelled, said once, not twice."""
    text = "user@node:~$ nvidia-smi topo -m\n" + fixture("topo_a10x4_sys_healthy.txt")
    code, diagnosis, _ = diagnose(tmp_path, capsys, text)
    assert code == 0, diagnosis
    top007 = next(f for f in diagnosis["findings"] if f["code"] == "TOP007")
    assert top007["title"].count("not modelled") == 1, top007["title"]
    assert top007["title"].startswith("All-reduce bandwidth not modelled: SYS"), top007["title"]
