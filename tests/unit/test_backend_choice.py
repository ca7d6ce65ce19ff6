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
