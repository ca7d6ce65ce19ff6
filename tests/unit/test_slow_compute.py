"""The injected `slow` fault really stretches forward and backward, before any gradient is ready."""

from __future__ import annotations

import time

import torch
from torch import nn

from ddpdoctor.measure.slow_compute import SlowCompute


def test_forward_and_backward_are_stretched_before_the_gradients_exist():
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    slow = SlowCompute(3.0, torch.device("cpu"))
    assert len(slow.install(model)) == 2
    seen_at_first_gradient: list[float] = []
    # The last layer's weight gradient is the first one backward produces (DDP's first bucket).
    model[2].weight.register_hook(lambda g: seen_at_first_gradient.append(slow.spun_s))
    started = time.perf_counter()
    out = model(torch.randn(64, 128))
    forward_s = time.perf_counter() - started
    after_forward = slow.spun_s
    assert 0 < after_forward <= forward_s  # (factor - 1) x the forward, inside the forward call
    out.sum().backward()
    assert seen_at_first_gradient and seen_at_first_gradient[0] > after_forward
    assert slow.take_spun_ms() > 0 and slow.spun_s == 0.0


def test_factor_one_installs_nothing():
    assert SlowCompute(1.0, torch.device("cpu")).install(nn.Linear(2, 2)) == []
