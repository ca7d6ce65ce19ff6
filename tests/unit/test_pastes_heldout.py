"""Held-out pastes (tests/fixtures/pastes/heldout/, sources and judgements in its README.md): real
`nvidia-smi topo -m` pastes collected after the reader and the topology checks were tuned on
tests/fixtures/pastes/, and not used to tune them. Every one must be read (exit code other than 3,
no traceback); where ddpdoctor's judgement was found right, its key finding is pinned here, and
where it was found wrong the right answer is a strict xfail naming what is wrong.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import pytest

from ddpdoctor import cli

HELDOUT = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "pastes" / "heldout"
A100_NODE = "sysuest_smi_then_topo_2xa100pcie_node_mlx5.txt"
V100_HYBRID = "sysuest_smi_then_topo_4xv100sxm2_nv_hybrid_mlx5.txt"
GDR_TWO_HOSTS = "gdr114_run_cmd_topo_2xv100_sys_two_hosts.txt"
TRP64 = "kinghorn_trp64_topo_2x4090_sys_one_socket.txt"
PHB_5090 = "club3090_1229_topo_2x5090_phb.txt"
NCCL_667 = "nccl_667_topo_4gpu_pxb_pix_sys.txt"
ALL = (A100_NODE, V100_HYBRID, GDR_TWO_HOSTS, TRP64, PHB_5090, NCCL_667)


def diagnose(name: str, tmp_path: pathlib.Path) -> tuple[int, str, dict]:
    """`ddpdoctor diagnose FILE --json OUT` through the CLI's own entry point, in this process (a subprocess a
    file cost a second each; the subprocess path is tests/unit/test_pastes.py's): exit code, stderr, diagnosis.
    A traceback would fail the test as the exception itself."""
    out = tmp_path / "diagnosis.json"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["diagnose", str(HELDOUT / name), "--json", str(out)])
    return code, err.getvalue(), json.loads(out.read_text()) if out.exists() else {}


def found(diagnosis: dict, code: str) -> list[dict]:
    return [f for f in diagnosis["findings"] if f["code"] == code]


def loud(diagnosis: dict) -> list[str]:
    return sorted(f["code"] for f in diagnosis["findings"] if f["severity"] in ("warn", "critical"))


def test_every_heldout_file_is_listed():
    assert sorted(p.name for p in HELDOUT.glob("*.txt")) == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
def test_every_heldout_paste_is_read(name, tmp_path):
    code, stderr, diagnosis = diagnose(name, tmp_path)
    assert code != 3 and "Traceback" not in stderr, stderr
    assert found(diagnosis, "INP001") and diagnosis["unreadable"] == []


# -- judged right: the key finding is pinned -----------------------------------------------------

def test_2xa100_pcie_under_one_numa_node_with_near_nic_is_healthy(tmp_path):
    """SYSU-SCC/SYSuEST: `$ nvidia-smi` then `$ nvidia-smi topo -m`, 2x A100 PCIe NODE, mlx5_0 NODE."""
    code, _, diagnosis = diagnose(A100_NODE, tmp_path)
    assert code == 0 and loud(diagnosis) == [] and diagnosis["world_size"] == 2
    assert found(diagnosis, "TOP011") == [] and found(diagnosis, "TOP012") == []


def test_4xv100_sxm2_hybrid_nvlink_is_healthy(tmp_path):
    """SYSU-SCC/SYSuEST: 4x V100 SXM2 (NV2/NV1, two pairs NODE), a PIX NIC pair per GPU pair."""
    code, _, diagnosis = diagnose(V100_HYBRID, tmp_path)
    assert code == 0 and loud(diagnosis) == [] and diagnosis["world_size"] == 4


def test_run_cmd_paste_of_2xv100_across_sockets_warns(tmp_path):
    """A `run_cmd "nvidia-smi topo -m"` paste: GPU0 on NUMA 0, GPU1 on NUMA 1, SYS between them."""
    code, _, diagnosis = diagnose(GDR_TWO_HOSTS, tmp_path)
    assert code == 1 and loud(diagnosis) == ["TOP011"]
    [top011] = found(diagnosis, "TOP011")
    assert top011["severity"] == "warn" and top011["evidence"]["sys_pairs"] == ["0-1"]
    assert found(diagnosis, "TOP012") == []  # each GPU has two PHB NICs of its own


def test_2x4090_sys_pair_warns(tmp_path):
    """`kinghorn@trp64:...$ nvidia-smi topo -m`: 2x RTX 4090 meeting only through SYS (the machine hung in P2P)."""
    code, _, diagnosis = diagnose(TRP64, tmp_path)
    assert code == 1 and loud(diagnosis) == ["TOP011"]
    [top011] = found(diagnosis, "TOP011")
    assert top011["severity"] == "warn" and top011["evidence"]["sys_pairs"] == ["0-1"]


def test_2x5090_phb_is_healthy(tmp_path):
    """noonghunna/club-3090#1229: 2x RTX 5090 under one host bridge (PHB), one NUMA node."""
    code, _, diagnosis = diagnose(PHB_5090, tmp_path)
    assert code == 0 and loud(diagnosis) == [] and found(diagnosis, "TOP011") == []


def test_4gpu_two_per_socket_is_information_not_a_warning(tmp_path):
    """NVIDIA/nccl#667: GPU0-1 PXB on NUMA 0, GPU2-3 PIX on NUMA 1, SYS between the halves."""
    code, _, diagnosis = diagnose(NCCL_667, tmp_path)
    assert code == 0 and loud(diagnosis) == []
    [top011] = found(diagnosis, "TOP011")
    assert top011["severity"] == "info" and top011["evidence"]["sys_pairs_total"] == 4


# -- judged wrong: strict xfails ------------------------------------------------------------------

@pytest.mark.xfail(strict=True, reason="the run_cmd paste holds two hosts' matrices (s114, s116), each after a "
                                       "'<date> <host> nvidia-smi topo -m' line; ddpdoctor reads one matrix on "
                                       "'node' and drops the second host")
def test_run_cmd_paste_reads_both_hosts(tmp_path):
    _, _, diagnosis = diagnose(GDR_TWO_HOSTS, tmp_path)
    assert diagnosis["world_size"] == 4 and len(diagnosis["nodes"]) == 2
    assert found(diagnosis, "TOP011")[0]["nodes"] == diagnosis["nodes"]


@pytest.mark.xfail(strict=True, reason="trp64 is a one-socket Threadripper Pro (CPU Affinity 0-127 for both GPUs, "
                                       "NUMA Affinity N/A); the TOP011 title says the GPUs meet 'across the CPU "
                                       "sockets', which this machine does not have")
def test_sys_pair_on_one_socket_is_not_called_a_socket_crossing(tmp_path):
    _, _, diagnosis = diagnose(TRP64, tmp_path)
    assert "CPU sockets" not in found(diagnosis, "TOP011")[0]["title"]


def test_nvlink_bottleneck_text_has_no_none(tmp_path):
    """Found wrong on the held-out run ("NVLink (NVML version code None) x2": a pasted matrix shows no NVLink
    version), fixed after it (judge/link_model.nvlink_label)."""
    _, _, diagnosis = diagnose(V100_HYBRID, tmp_path)
    bottleneck = found(diagnosis, "TOP007")[0]["evidence"]["bottleneck"]
    assert "None" not in bottleneck and "version not shown" in bottleneck, bottleneck
