"""The launcher's choice of backend and device, and its words when the machine cannot give them.

Issue 37: `allreduce-bench --nproc 2 --backend nccl` on a machine with one H100 said "--backend
nccl needs GPUs" (it has one): the error must say what is true, 2 ranks but 1 GPU, and why.
torch's view of the GPUs is set here (a CPU machine has none); the rule is the launcher's own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpdoctor.core.errors import UsageError
from ddpdoctor.runtime.config import CheckConfig
from ddpdoctor.session import launcher


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def have(count: int) -> None:
        monkeypatch.setattr(launcher, "no_gpu_here", lambda: count == 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(launcher, "check_torch_distributed", lambda backend: None)
    return have


def _cfg(**kw) -> CheckConfig:
    return CheckConfig(probes=("ddp-smoke",), **kw)


def test_two_ranks_on_one_gpu_with_nccl_say_so_and_what_allows_it(gpus):
    gpus(1)
    with pytest.raises(UsageError) as err:
        launcher.resolve_backend(_cfg(backend="nccl"), 2)
    assert str(err.value).startswith("2 ranks but 1 GPU: NCCL needs one GPU per rank")
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in str(err.value) and "--nproc 1" in str(err.value)


def test_nccl_without_any_gpu_says_torch_sees_none(gpus):
    gpus(0)
    with pytest.raises(UsageError, match="--backend nccl runs on GPUs, and torch sees none here"):
        launcher.resolve_backend(_cfg(backend="nccl"), 2)


def test_the_automatic_choice_is_nccl_on_enough_gpus_and_gloo_otherwise(gpus):
    gpus(2)
    assert launcher.resolve_backend(_cfg(), 2) == ("nccl", "cuda")
    assert launcher.resolve_backend(_cfg(backend="nccl"), 2) == ("nccl", "cuda")
    gpus(1)
    assert launcher.resolve_backend(_cfg(), 2) == ("gloo", "cpu")  # not asked for NCCL: CPU ranks


def test_the_gpus_left_unused_by_the_automatic_choice_are_recorded(gpus):
    """Issue 41: `allreduce-bench --nproc 2` on one H100 ran gloo on CPU and said OK."""
    gpus(1)
    cfg = _cfg()
    backend, device = launcher.resolve_backend(cfg, 2)
    assert launcher.cpu_instead_of_gpus(cfg, 2, device) == {"gpus": 1, "ranks": 2}
    assert launcher.cpu_instead_of_gpus(_cfg(backend="gloo"), 2, "cpu") is None  # asked for: nothing unused by us
    assert launcher.cpu_instead_of_gpus(cfg, 1, launcher.resolve_backend(cfg, 1)[1]) is None  # on the GPU
    gpus(0)
    assert launcher.cpu_instead_of_gpus(cfg, 2, "cpu") is None


def test_the_recorded_cpu_fallback_is_said_beside_the_figures():
    """The H100 record of that run (tests/fixtures/gpu_runs/h100x1_bench2.json), judged with what the
    launcher now records: BW009, and the verdict points to it instead of an OK."""
    import json
    from pathlib import Path

    from ddpdoctor.probes import RunView, get_probe
    from ddpdoctor.probes.base import diagnose_safely

    report = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "gpu_runs" / "h100x1_bench2.json").read_text())
    assert (report["backend"], report["verdict"]) == ("gloo", "ok")  # as it was
    [section] = [p for p in report["probes"] if p["name"] == "allreduce"]
    view = RunView(world_size=2, hosts={0: "vm", 1: "vm"}, settings={"cpu_instead_of_gpus": {"gpus": 1, "ranks": 2}})
    found = {f.code: f for f in diagnose_safely(get_probe("allreduce"), section["facts"], view)}
    assert found["BW009"].title.startswith("Measured gloo on CPU processes, not the GPUs: 2 ranks but 1 GPU here")
    assert found["BW000"].severity.label == "info" and found["BW000"].title.endswith("see BW009")
