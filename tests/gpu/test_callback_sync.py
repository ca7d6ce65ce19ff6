"""GPU tier: the callback never makes the GPU's host wait, proven with torch's CUDA sync debug mode.

A one-rank NCCL job on the first GPU: an MLP trained with plain SGD (no `.item()` in the user's step).
First the bare DDP loop runs under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
synchronising call: it proves the loop and DDP themselves make none. Then the same loop with a
`Doctor` at its defaults but checking at every 5th step, under the same mode: step_begin, step_end
and the checks (the gather read one check late, the fingerprint copied without waiting) must not
raise either. Skipped where torch sees no CUDA device (CI, the 2-core VM); run first whenever a GPU
is at hand (docs/callback.md, "What it costs").
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here"),
]


@pytest.fixture
def nccl_one_rank(tmp_path):
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def _loop(model, opt, steps: int, doctor=None, nan_at: int = -1) -> None:
    x = torch.randn(256, 512, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    for i in range(steps):
        if doctor is not None:
            doctor.step_begin((x, y))
        loss = torch.nn.functional.cross_entropy(model(x if i != nan_at else x * float("nan")), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if doctor is not None:
            doctor.step_end(loss)  # the loss watched too (callback/loss_watch.py): a copy on the device, no read


def test_the_callback_makes_no_synchronising_call(nccl_one_rank):
    from torch.nn.parallel import DistributedDataParallel

    from ddpdoctor.callback.doctor import Doctor

    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                                        torch.nn.Linear(1024, 10)).cuda(), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _loop(model, opt, 20)  # warm-up: cuBLAS handles, NCCL's communicator, the caching allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The bare loop, over iteration 100, which DDP's reducer samples (its timers synchronise on their
        # own events then): if this raised, the test could not tell ours apart from DDP's.
        _loop(model, opt, 100)
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode("default")
        pytest.skip(f"the bare DDP loop itself synchronises on this torch: {exc}")
    torch.cuda.set_sync_debug_mode("default")
    doctor = Doctor(model, opt, every=5, check_every_s=0)
    try:
        _loop(model, opt, 3, doctor)  # the first check (step 1) outside the mode: its setup reads once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _loop(model, opt, 60, doctor)  # 12 checks, the NCCL gather and the fingerprint among them
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert doctor._steps == 63 and doctor.wait_measured
    finally:
        doctor.close()
    assert all(f.severity.label in ("ok", "info") for f in doctor.report()), doctor.report()


def test_a_nan_loss_is_dated_to_its_step_a_check_late_without_a_synchronising_call(nccl_one_rank):
    from torch.nn.parallel import DistributedDataParallel

    from ddpdoctor.callback.loss_watch import LossWatch

    model = DistributedDataParallel(torch.nn.Linear(512, 10).cuda(), device_ids=[0])
    watch = LossWatch()
    x = torch.randn(64, 512, device="cuda")
    for step in range(1, 3):  # the ring and its positions made outside the mode
        watch.see(torch.nn.functional.cross_entropy(model(x), torch.zeros(64, dtype=torch.long, device="cuda")), step)
    watch.take(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3, 31):
            inputs = x * float("nan") if step == 17 else x
            loss = torch.nn.functional.cross_entropy(model(inputs), torch.zeros(64, dtype=torch.long, device="cuda"))
            watch.see(loss, step)
            if step % 10 == 0:  # the scans launched; one read only once complete (the NaN's, launched at 20)
                assert watch.take(step) in ((None,) if step < 30 else (None, 17))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert watch.take(31) == 17
