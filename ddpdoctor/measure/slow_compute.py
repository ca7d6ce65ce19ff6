"""The injected `slow` fault inside a model: forward and backward really take longer.

A slow rank must be slow where real slowness lives, in its compute, so that every way of
seeing it works: its forward and backward times grow, it arrives late at the gradient
all-reduce, and its compute-only steps (no collective) are slower too. Sleeping after the
step would show none of that. The extra time is spent busy on this rank's CPU (after a
device sync on GPU), as a slower device or a CPU hog sharing its core would spend it.
"""

from __future__ import annotations

import time
from typing import Any


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SlowCompute:
    """Hooks that stretch a module's forward and backward by `factor`.

    Backward's length is known only when it ends, so its stretch uses the previous
    step's measured backward compute (`observe_backward`), else twice the forward (the
    shared workload, whose backward time includes the all-reduce wait, never tells it).
    """

    def __init__(self, factor: float, device: Any) -> None:
        self.factor = factor
        self.device = device
        self.spun_s = 0.0  # in total, for the record
        self._forward_started = 0.0
        self._forward_s = 0.0
        self._backward_s = 0.0  # pure compute, our own spin excluded
        self._spun_in_backward = 0.0

    def install(self, module: Any) -> list[Any]:
        if self.factor <= 1.0:
            return []
        return [module.register_forward_pre_hook(self._before_forward),
                module.register_forward_hook(self._after_forward)]

    def take_spun_ms(self) -> float:
        ms, self.spun_s = self.spun_s * 1e3, 0.0
        return ms

    def observe_backward(self, seconds: float) -> None:
        """The backward compute just measured, our spin included; keeps the pure part."""
        self._backward_s = max(0.0, seconds - self._spun_in_backward)

    def _sync(self) -> None:
        if getattr(self.device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _stretch(self, seconds: float) -> float:
        extra = seconds * (self.factor - 1.0)
        spin(extra)
        self.spun_s += extra
        return extra

    def _before_forward(self, module: Any, args: Any) -> None:
        self._sync()
        self._forward_started = time.perf_counter()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        self._sync()
        self._forward_s = time.perf_counter() - self._forward_started
        self._stretch(self._forward_s)
        if getattr(output, "requires_grad", False):
            output.register_hook(self._backward_begins)

    def _backward_begins(self, grad: Any) -> None:
        # Runs when backward reaches the model's output: before any gradient bucket is ready,
        # so the rank really arrives late at the all-reduce.
        self._spun_in_backward = self._stretch(self._backward_s or 2.0 * self._forward_s)
