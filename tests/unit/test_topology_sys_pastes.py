"""Two real `nvidia-smi topo -m` pastes from 2-socket hosts (tests/fixtures/gpu_outputs, sources in
its README.md and truth.json), read and judged beyond the healthy/keyword check that
test_ingest_topology_outputs.py makes of every topo-m entry of truth.json:

- topo_rtx4090x8_sys_2numa_nics_healthy.txt (NVIDIA/go-gpuallocator#17): every pair SYS, GPUs 0-3 on
  NUMA node 0 and 4-7 on node 1, two NICs behind GPU 6's host bridge. No GPU is worse placed than
  another, so nothing is loud; the PCIe rates are not in topo -m, so the all-reduce is not modelled.
- topo_t4x4_gpu0_alone_sys.txt (NVIDIA/nccl#428): GPU 0 alone on the first socket (SYS to all), GPUs
  1-3 at NODE on the second: TOP003 names GPU 0 and the SYS path.
"""

from __future__ import annotations

import json
import pathlib

from ddpdoctor import cli
from ddpdoctor.ingest import topo_matrix

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gpu_outputs"
RTX4090 = "topo_rtx4090x8_sys_2numa_nics_healthy.txt"
T4 = "topo_t4x4_gpu0_alone_sys.txt"


def node_of(name: str):
    out = topo_matrix.read(name, (FIXTURES / name).read_text())
    return out.gpus[min(out.gpus)]["topology"].node


def diagnose(name: str, tmp_path: pathlib.Path, capsys) -> tuple[int, dict]:
    path = tmp_path / "output.txt"
    path.write_text((FIXTURES / name).read_text())
    out = tmp_path / "diagnosis.json"
    code = cli.main(["diagnose", str(path), "--json", str(out)])
    capsys.readouterr()
    return code, json.loads(out.read_text())


def test_the_4090_paste_reads_two_numa_nodes_sys_pairs_and_two_nics():
    node = node_of(RTX4090)
    assert [g.index for g in node.gpus.gpus] == list(range(8))
    assert [g.numa_node for g in node.gpus.gpus] == [0] * 4 + [1] * 4
    assert node.gpus.gpus[0].cpu_affinity == "0-55,112-167" and node.gpus.gpus[6].cpu_affinity == "56-111,168-223"
    assert len(node.gpus.pairs) == 28 and {p.level for p in node.gpus.pairs} == {"SYS"}
    assert [n.name for n in node.nics] == ["NIC0", "NIC1"]  # no NIC legend pasted: the column names
    assert node.nics[0].gpu_paths == {**{str(g): "SYS" for g in range(8)}, "6": "PHB"}


def test_the_4090_machine_is_not_faulted_but_says_what_crossing_the_sockets_costs(tmp_path, capsys):
    """Issue 41: this machine was judged healthy with no word of what SYS costs. Now TOP011 says the
    all-reduce crosses the sockets, with the busbw a SYS hop allows per PCIe generation (topo -m has
    no link rate), and TOP012 that GPUs 0-5 and 7 reach both NICs only across them (the NICs are PHB
    to GPU 6 alone): information on one node, so still exit 0."""
    code, diagnosis = diagnose(RTX4090, tmp_path, capsys)
    assert code == 0
    assert [f for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")] == []
    assert not [f for f in diagnosis["findings"] if f["code"] == "TOP003"]  # every GPU's closest peer is SYS
    [sockets] = [f for f in diagnosis["findings"] if f["code"] == "TOP011"]
    assert sockets["severity"] == "info"  # no 8 GPUs without a SYS pair: nothing better to choose
    assert sockets["title"] == ("The all-reduce crosses the CPU sockets on node: 28 of 28 GPU pairs meet only across "
                                "them (SYS): GPU 0-3 on NUMA node 0, GPU 4-7 on NUMA node 1")
    assert sockets["evidence"]["expected_busbw_gbps_per_sys_hop"] == {"Gen3 x16": 6.3, "Gen4 x16": 12.6,
                                                                      "Gen5 x16": 25.2}
    assert sockets["evidence"]["gpus_without_crossing"] is None
    [nics] = [f for f in diagnosis["findings"] if f["code"] == "TOP012"]
    assert nics["severity"] == "info" and nics["evidence"]["gpus_far_from_every_nic"] == [0, 1, 2, 3, 4, 5, 7]
    assert nics["evidence"]["nics_near_gpus"] == {"NIC0": [6], "NIC1": [6]}
    assert nics["title"] == "GPU 0-5,7 on node reach the NICs (NIC0, NIC1) only across NUMA nodes (SYS)"
    top007 = next(f for f in diagnosis["findings"] if f["code"] == "TOP007")
    assert top007["severity"] == "info"
    assert "not modelled" in top007["title"] and "SYS (PCIe link unknown)" in top007["title"]
    assert top007["evidence"]["expected_busbw_gbps"] is None


def test_the_t4_paste_reads_gpu0_on_its_own_socket():
    node = node_of(T4)
    levels = {(p.a, p.b): p.level for p in node.gpus.pairs}
    assert levels == {(0, 1): "SYS", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "NODE", (1, 3): "NODE", (2, 3): "NODE"}
    assert [g.cpu_affinity for g in node.gpus.gpus] == ["0-15,32-47"] + ["16-31,48-63"] * 3
    assert [g.numa_node for g in node.gpus.gpus] == [None] * 4  # no NUMA Affinity column: not known


def test_the_t4_gpu0_is_named_for_reaching_the_others_only_across_sockets(tmp_path, capsys):
    code, diagnosis = diagnose(T4, tmp_path, capsys)
    assert code == 1
    loud = [f for f in diagnosis["findings"] if f["severity"] in ("warn", "critical")]
    assert [f["code"] for f in loud] == ["TOP003"]
    top003 = loud[0]
    assert top003["title"] == "GPU 0 on node reaches the other GPUs only through SYS; the others have NODE"
    assert top003["ranks"] == [0]
    assert top003["evidence"]["closest_peer_path"] == "SYS" and top003["evidence"]["others_closest_path"] == "NODE"
    assert top003["evidence"]["row"] == {"1": "SYS", "2": "SYS", "3": "SYS"}
    top007 = next(f for f in diagnosis["findings"] if f["code"] == "TOP007")
    assert "SYS (PCIe link unknown)" in top007["title"]  # the ring's first hop, GPU 0 to GPU 1
