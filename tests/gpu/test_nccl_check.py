"""GPU tier: the NCCL path for real. Skipped where torch sees no CUDA device (CI, this machine)."""

from __future__ import annotations

import pytest
import torch

from tests.ranks.harness import assert_nothing_left, probe_section, run_check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here"),
]


def test_check_on_gpus_uses_nccl_and_is_healthy(tmp_path):
    nproc = torch.cuda.device_count()  # one rank per GPU, as `ddpdoctor check` does by default
    run = run_check(tmp_path, "--nproc", str(nproc))
    assert run.returncode == 0, run.explain()
    assert run.report["backend"] == "nccl" and run.report["device"] == "cuda"
    facts = probe_section(run.report, "ddp-smoke")["facts"]
    assert all(f["device"].startswith("cuda:") for f in facts.values())
    assert len({f["device"] for f in facts.values()}) == nproc, "each rank on its own GPU"
    assert all(f["peak_mem_bytes"] > 0 for f in facts.values())
    assert_nothing_left(run)
