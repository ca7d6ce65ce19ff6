"""Pastes as users make them (issue 51, point 4): real `nvidia-smi topo -m` and nccl-tests pastes with
their shell prompts and command lines (tests/fixtures/pastes/, sources in its README.md), read and
judged; the same pastes with ANSI colours, CR line ends, a trailing prompt or another prompt style
read exactly as the originals; and a file that is no output at all costs one line and exit 3.

The 2-GPU machines whose one pair crosses the CPU sockets (SYS) were judged healthy (TOP011 info);
they are now a warning naming GPU0-GPU1 and what the crossing costs the all-reduce.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Callable

import pytest

from ddpdoctor import cli
from ddpdoctor.ingest.paste import clean, prompt, split, starts_with_prompt

PASTES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "pastes"
GPU_OUTPUTS = PASTES.parent / "gpu_outputs"
L4 = "llm_parallelism_topo_2xl4_sys_numa0_numa1.txt"
A100 = "nccl_tests_293_topo_2xa100pcie_sys_prompt.txt"
A100_TWO = "nccl_tests_293_topo_then_allreduce_two_outputs.txt"
V100_BRACKET = "gpushare_topo_8xv100_bracket_prompt.txt"
P4_TABS = "hami_99_topo_1xp4_prompt_tabs.txt"
REAL = (L4, A100, A100_TWO, V100_BRACKET, P4_TABS)


def diagnose_text(text: str, where: pathlib.Path, capsys) -> tuple[int, dict]:
    """`ddpdoctor diagnose` on the text saved as `paste.txt` (one name for every variant)."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "paste.txt"
    path.write_bytes(text.encode("utf-8"))
    out = where / "diagnosis.json"
    code = cli.main(["diagnose", str(path), "--json", str(out)])
    capsys.readouterr()
    return code, json.loads(out.read_text())


def diagnose(name: str, tmp_path: pathlib.Path, capsys) -> tuple[int, dict]:
    return diagnose_text((PASTES / name).read_text(), tmp_path / "original", capsys)


def found(diagnosis: dict, code: str) -> list[dict]:
    return [f for f in diagnosis["findings"] if f["code"] == code]


def loud(diagnosis: dict) -> list[str]:
    return sorted(f["code"] for f in diagnosis["findings"] if f["severity"] in ("warn", "critical"))


# -- the real pastes -----------------------------------------------------------------------------

def test_the_2xl4_pair_across_the_sockets_is_a_warning_with_its_cost_and_fix(tmp_path, capsys):
    """dudeperf3ct/llm-parallelism-pytorch: 2x L4, GPU0 on NUMA 0 and GPU1 on NUMA 1, SYS between; the
    author's first epoch hung in NCCL (P2P/CUMEM across the sockets) until NCCL_P2P_DISABLE=1."""
    code, diagnosis = diagnose(L4, tmp_path, capsys)
    assert code == 1 and loud(diagnosis) == ["TOP011"]
    [top011] = found(diagnosis, "TOP011")
    assert top011["severity"] == "warn" and top011["ranks"] == [0, 1]
    assert top011["title"].startswith("GPU0 and GPU1 on node meet only across the CPU sockets (SYS): GPU 0 on NUMA "
                                      "node 0, GPU 1 on NUMA node 1")
    assert "about 40% of the PCIe link" in top011["title"]
    evidence = top011["evidence"]
    assert evidence["sys_pairs"] == ["0-1"] and evidence["gpus_by_numa_node"] == {"0": [0], "1": [1]}
    assert evidence["expected_busbw_gbps_per_sys_hop"]["Gen4 x16"] == pytest.approx(12.6)
    assert evidence["expected_busbw_gbps_under_one_pcie_switch"]["Gen4 x16"] == pytest.approx(25.2)
    assert "12.6 at Gen4" in evidence["cost"] and "under one PCIe switch" in evidence["cost"]
    assert evidence["gpus_without_crossing"] is None  # two GPUs, two sockets: none to choose on this machine
    for words in ("two GPUs under one socket", "numactl --cpunodebind=N", "NCCL_P2P_LEVEL=SYS", "NCCL_P2P_DISABLE=1",
                  "GPU0-GPU1"):
        assert words in top011["fix"]
    # Each GPU has a NIC on its own NUMA node (NIC2 near GPU0, NIC0/NIC1 near GPU1): no TOP012.
    assert found(diagnosis, "TOP012") == []


def test_the_prompt_led_2xa100_paste_is_read_and_its_sys_pair_and_far_nic_judged(tmp_path, capsys):
    """NVIDIA/nccl-tests#293: `root@test1:/# nvidia-smi topo -m`, 2x A100 PCIe meeting only through SYS
    and the one HDR NIC SYS to both. On one node the far NIC costs nothing (info); the pair does."""
    code, diagnosis = diagnose(A100, tmp_path, capsys)
    assert code == 1 and loud(diagnosis) == ["TOP011"]
    [read] = found(diagnosis, "INP001")
    assert read["title"] == "Read 1 tool output(s): paste.txt as topo-m (node)"
    [top011] = found(diagnosis, "TOP011")
    assert top011["title"].startswith("GPU0 and GPU1 on node") and top011["evidence"]["sys_pairs"] == ["0-1"]
    [top012] = found(diagnosis, "TOP012")
    assert top012["severity"] == "info" and top012["evidence"]["gpus_far_from_every_nic"] == [0, 1]
    assert top012["title"] == "GPU 0-1 on node reach the NICs (mlx5_0) only across NUMA nodes (SYS)"
    assert top012["evidence"]["cost"].startswith("none while the job stays on one node")


def test_a_paste_of_topo_then_an_nccl_tests_run_is_read_part_by_part_on_the_hosts_it_names(tmp_path, capsys):
    """The same issue's description holds two outputs, each after its prompt: topo -m on test1, then
    all_reduce_perf across test1 and test2. Each part is read by its reader and named by its lines;
    the topo's prompt (`root@test1`) puts it on test1, which nccl-tests names; the job spans two
    nodes, so the NIC across the sockets is now a warning (the reporter's 1.1 GB/s without GDR)."""
    code, diagnosis = diagnose(A100_TWO, tmp_path, capsys)
    assert code == 1 and loud(diagnosis) == ["TOP011", "TOP012"]
    [read] = found(diagnosis, "INP001")
    assert read["title"] == ("Read 3 tool output(s): paste.txt (lines 1-19) as topo-m (test1); paste.txt (lines 20-112) "
                             "as nccl-tests (test1); paste.txt (lines 20-112) as nccl-tests (test2)")
    assert diagnosis["nodes"] == ["test1", "test2"]
    [top012] = found(diagnosis, "TOP012")
    assert top012["severity"] == "warn" and top012["evidence"]["job_across_nodes"] is True
    assert top012["nodes"] == ["test1"]
    [bench] = found(diagnosis, "BW000")  # the nccl-tests table was read: its peak as printed
    assert "6.44 GB/s" in bench["title"]


def test_a_bracket_prompt_paste_is_read_not_refused_as_json(tmp_path, capsys):
    """hellolijj/gpushare-scheduler-extender: `[root@iz8v... k8s-device-plugin]# nvidia-smi topo -m` on an
    8x V100 hybrid cube mesh. It starts with `[`, and was refused as "not valid JSON"."""
    code, diagnosis = diagnose(V100_BRACKET, tmp_path, capsys)
    assert code == 0 and loud(diagnosis) == [] and diagnosis["unreadable"] == []
    assert found(diagnosis, "INP001")[0]["title"] == "Read 1 tool output(s): paste.txt as topo-m (node)"
    assert diagnosis["world_size"] == 8
    [top011] = found(diagnosis, "TOP011")  # 8 GPUs need both sockets: information, not a warning
    assert top011["severity"] == "info" and top011["evidence"]["sys_pairs_total"] == 12


def test_a_one_gpu_prompt_paste_with_tabs_is_read(tmp_path, capsys):
    """Project-HAMi/HAMi#99: `root@controller-node-1:/# nvidia-smi topo -m`, tab-separated, one Tesla P4."""
    code, diagnosis = diagnose(P4_TABS, tmp_path, capsys)
    assert code == 0 and diagnosis["world_size"] == 1
    assert [f["code"] for f in diagnosis["findings"]] == ["INP001"]


def test_every_real_paste_splits_where_its_commands_start():
    assert [(p.first, p.last, p.host) for p in split((PASTES / A100_TWO).read_text())] == [(1, 19, "test1"),
                                                                                           (20, 112, "test1")]
    for name in (L4, A100, V100_BRACKET, P4_TABS):
        assert len(split((PASTES / name).read_text())) == 1, name


# -- variants made from the real pastes: read the same ------------------------------------------

def ansi(text: str) -> str:
    """A colour terminal's copy: the prompt in bold green, the header underlined, SYS cells in red."""
    lines = text.splitlines(keepends=True)
    out = []
    for line in lines:
        if prompt(line) is not None:
            line = "\x1b[01;32m" + line.rstrip("\n") + "\x1b[00m\n"
        elif line.lstrip().startswith("GPU0") and "CPU Affinity" in line:
            line = "\x1b[4m" + line.rstrip("\n") + "\x1b[0m\n"
        out.append(line.replace("SYS\t", "\x1b[31mSYS\x1b[0m\t").replace("SYS ", "\x1b[31mSYS\x1b[0m "))
    return "".join(out)


def crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def trailing_prompt(text: str) -> str:
    return text + "root@test1:/# \n"


def venv_prompt(text: str) -> str:
    """A conda/venv prompt on the command line (or a `$` prompt put before a paste that had none)."""
    first, _, rest = text.partition("\n")
    command = prompt(first)
    return f"(base) user@gpu-node01:~$ {command.command}\n{rest}" if command else f"(venv) $ nvidia-smi topo -m\n{text}"


VARIANTS: dict[str, Callable[[str], str]] = {"ansi": ansi, "crlf": crlf, "trailing prompt": trailing_prompt,
                                             "venv prompt": venv_prompt,
                                             "ansi+crlf": lambda text: crlf(ansi(text))}


def essence(diagnosis: dict) -> list[tuple]:
    return [(f["code"], f["severity"], f["title"], f["ranks"], f["nodes"]) for f in diagnosis["findings"]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", REAL)
def test_a_variant_of_a_real_paste_reads_as_the_original(name, variant, tmp_path, capsys):
    text = (PASTES / name).read_text()
    made = VARIANTS[variant](text)
    assert made != text
    code, original = diagnose_text(text, tmp_path / "original", capsys)
    made_code, diagnosis = diagnose_text(made, tmp_path / "variant", capsys)
    if variant == "venv prompt" and name == A100_TWO:
        # Its first prompt now names gpu-node01, which no other output names: the topo stays on "node",
        # judged as before, beside nccl-tests' test1 and test2.
        assert made_code == code and loud(diagnosis) == loud(original) == ["TOP011", "TOP012"]
        assert found(diagnosis, "TOP011")[0]["nodes"] == ["node"] and diagnosis["nodes"] == ["node", "test1", "test2"]
        return
    assert (made_code, essence(diagnosis)) == (code, essence(original))


def test_two_outputs_of_one_machine_in_one_file_are_both_read(tmp_path, capsys):
    """Made from siboehm/bench's real 3x A6000 pastes (tests/fixtures/gpu_outputs): its `> nvidia-smi
    topo -m` then its `> nvidia-smi nvlink -s`, one after the other in one file, as users paste them."""
    topo = (GPU_OUTPUTS / "topo_a6000x3_gpu2_unbridged_node.txt").read_text()
    nvlink = (GPU_OUTPUTS / "nvlink_a6000x3_one_unbridged_healthy.txt").read_text()
    code, diagnosis = diagnose_text(topo + nvlink, tmp_path / "two", capsys)
    [read] = found(diagnosis, "INP001")
    lines = len(topo.splitlines())
    assert read["title"] == (f"Read 2 tool output(s): paste.txt (lines 1-{lines}) as topo-m (node); paste.txt "
                             f"(lines {lines + 1}-{lines + len(nvlink.splitlines())}) as nvlink-status (node)")
    assert code == 1 and loud(diagnosis) == ["TOP003"]  # the topo's judgement, as when it is alone
    alone_code, alone = diagnose_text(topo, tmp_path / "alone", capsys)
    assert [f for f in essence(diagnosis) if f[0] != "INP001"] == [f for f in essence(alone) if f[0] != "INP001"]


# -- what is not a paste of an output ------------------------------------------------------------

@pytest.mark.parametrize("junk", [
    "hello world\nthis is not an output\n",
    "[user@host ~]$ ls\nfoo  bar\n[user@host ~]$ \n",
    "(venv) $ ls -l\ntotal 0\n",
    "user@gpu-node01:~$ nvidia-smi topo -m\nNVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
])
def test_a_file_that_is_no_output_is_one_line_and_exit_3(junk, tmp_path):
    path = tmp_path / "junk.txt"
    path.write_text(junk)
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "diagnose", str(path)], capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 3
    assert "Traceback" not in done.stderr + done.stdout
    [line] = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    assert line.startswith("ddpdoctor: error: ") and "junk.txt is not" in line


# -- the paste reading itself --------------------------------------------------------------------

@pytest.mark.parametrize("line, command, host", [
    ("user@gpu-node01:~$ nvidia-smi topo -m", "nvidia-smi topo -m", "gpu-node01"),
    ("[user@host ~]$ nvidia-smi nvlink -s", "nvidia-smi nvlink -s", "host"),
    ("(venv) $ nvidia-smi topo -m", "nvidia-smi topo -m", None),
    ("((python_venv3.12) ) [root@5900X ~]# nvidia-smi topo -m", "nvidia-smi topo -m", "5900X"),
    ("# nvidia-smi topo -m", "nvidia-smi topo -m", None),
    ("sh-5.1# /usr/bin/dcgmi diag --run 3", "/usr/bin/dcgmi diag --run 3", None),
    ("$nvidia-smi topo -m", "nvidia-smi topo -m", None),
    ("nvidia-smi topo --matrix", "nvidia-smi topo --matrix", None),
    ("root@test1:/# ", None, "test1"),
])
def test_prompts_and_command_lines_are_known(line, command, host):
    seen = prompt(line)
    assert seen is not None and (seen.command, seen.host) == (command, host)


@pytest.mark.parametrize("line", ["# Using devices", "#  Rank  0 Group  0 Pid   5425 on      test1 device  0",
                                  "GPU0     X      SYS     SYS", "  NV#  = Connection traversing a bonded set",
                                  "test1:5425:5425 [0] NCCL INFO Bootstrap : Using eno1:192.168.160.111<0>",
                                  '{"schema": "ddpdoctor.snapshot/1"}', "[1, 2, 3]"])
def test_output_lines_and_json_are_not_prompts(line):
    assert prompt(line) is None and not starts_with_prompt(line)


def test_clean_drops_colours_and_cr_line_ends():
    assert clean("\ufeff\x1b[01;32mu@h:~$\x1b[00m x\r\nGPU0\x1b[31mSYS\x1b[0m\r\n\x1b]0;title\x07end\r") == \
        "u@h:~$ x\nGPU0SYS\nend\n"
