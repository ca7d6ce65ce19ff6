"""GPU tier: the NVML reading, the bf16 matmul and the NCCL bench on a real GPU.

Skipped where torch sees no CUDA device. Written without a GPU at hand: these are the
checks a session that is lent one runs first (`python -m pytest tests/gpu`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.ranks.harness import assert_nothing_left, probe_section, run_check, run_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here"),
]


def _known(value) -> bool:
    return not (isinstance(value, dict) and set(value) == {"unknown"})


def test_homogeneity_reads_the_gpu_through_nvml_and_measures_it(tmp_path):
    run = run_check(tmp_path, "--nproc", str(torch.cuda.device_count()), "--probes", "homogeneity")
    assert run.returncode in (0, 1), run.explain()  # a real GPU may really throttle (warn)
    facts = probe_section(run.report, "homogeneity")["facts"]["0"]
    gpu = facts["gpu"]
    assert gpu["name"] == torch.cuda.get_device_name(0)
    assert gpu["uuid"].startswith("GPU-") and gpu["sm_count"] > 0
    for key in ("memory_total_bytes", "compute_capability", "power", "clocks", "persistence_mode", "pcie"):
        assert _known(gpu[key]), (key, gpu[key])
    assert gpu["power"]["default_w"] > 0 and gpu["clocks"]["max_sm_mhz"] > 0
    assert _known(facts["software"]["driver"]) and facts["software"]["cuda_runtime"]
    mm = facts["measured"]["matmul"]
    assert mm["dtype"] in ("bfloat16", "float16") and mm["flops_per_s"] > 1e12
    assert_nothing_left(run)


def test_snapshot_of_a_gpu_node(tmp_path):
    out = tmp_path / "snap.json"
    subprocess.run([sys.executable, "-m", "ddpdoctor", "snapshot", "--out", str(out)], check=True, timeout=120)
    snap = json.loads(out.read_text())
    entries = snap["probes"]["homogeneity"]
    assert len(entries) == torch.cuda.device_count()
    assert all(e["device"].startswith("cuda:") and e["gpu"]["name"] for e in entries)


def test_allreduce_bench_with_nccl(tmp_path):
    report = tmp_path / "bw.json"
    nproc = max(1, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "ddpdoctor", "allreduce-bench", "--nproc", str(nproc), "--no-live",
           "--max-bytes", "64M", "--json", str(report)]
    run = run_command(cmd, tmp_path, report_name="bw.json", timeout_s=300)
    assert run.returncode == 0, run.explain()
    assert run.report["backend"] == "nccl"
    results = probe_section(run.report, "allreduce")["facts"]["0"]["results"]
    assert all(e["wrong"] == 0 for e in results)
    assert_nothing_left(run)
