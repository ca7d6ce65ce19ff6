"""The callback's step path touches nothing that could wait: proven with test doubles on CPU.

`Doctor.step_begin`/`step_end` run in every step of a user's loop, whose GPU steps take 1-3 ms.
Between checks they may read the CPU clock and append to lists, nothing else: no tensor read
(`.item()`, `.tolist()`, `.cpu()`), no CUDA call, no collective, and nothing inside DDP's backward
(no comm hook of ours). Here every such call is replaced by a double that records it, and a real
DDP loop on a one-rank gloo group runs 200 steps; only the checks (step 1, then every 50) may
call them. On a GPU, tests/gpu/test_callback_sync.py proves the same with torch's CUDA sync debug mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpdoctor.callback.doctor import Doctor

FORBIDDEN = [(torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
             (torch.Tensor, "to"), (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
             (torch.cuda.Event, "elapsed_time"), (torch.cuda.Event, "record"), (torch.cuda.Event, "query"),
             (dist, "all_reduce"), (dist, "all_gather_into_tensor"), (dist, "barrier"), (dist, "broadcast")]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_between_checks_the_step_path_calls_nothing_that_waits(one_rank, monkeypatch):
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    doctor = Doctor(model, opt, every=50, check_every_s=0)
    calls: list[str] = []
    in_check = [False]
    check = doctor._check

    def checking() -> None:
        in_check[0] = True
        try:
            check()
        finally:
            in_check[0] = False

    monkeypatch.setattr(doctor, "_check", checking)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    try:
        for step in range(200):
            loss = nn.functional.cross_entropy(model(x), y)  # the user's own step, outside the watch
            opt.zero_grad()
            loss.backward()
            opt.step()
            for owner, name in FORBIDDEN:
                real = getattr(owner, name)

                def double(*a, _real=real, _name=name, **k):
                    if not in_check[0]:
                        calls.append(_name)
                    return _real(*a, **k)

                monkeypatch.setattr(owner, name, double)
            doctor.step_begin((x, y))
            doctor.step_end()
            monkeypatch.undo()
            monkeypatch.setattr(doctor, "_check", checking)
    finally:
        doctor.close()
    assert calls == [], sorted(set(calls))
    assert doctor._steps == 200 and doctor._next_check == 250  # checked at 1, 50, 100, 150, 200
    # Nothing of ours inside DDP's backward: no comm hook registered (DDP's logger names one if set).
    assert "comm_hook" not in model._get_ddp_logging_data() and doctor.wait_measured


def test_the_check_itself_is_where_the_readings_happen(one_rank, monkeypatch):
    """The double above is not blind: the same doubles do see the check's own reads."""
    doctor = Doctor(DistributedDataParallel(nn.Linear(4, 2)), every=2, check_every_s=0)
    seen: list[str] = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: seen.append("tolist") or real(self))
    try:
        doctor.step_begin(torch.zeros(3, 4))
        doctor.step_end()  # step 1: a check
    finally:
        monkeypatch.undo()
        doctor.close()
    assert "tolist" in seen
