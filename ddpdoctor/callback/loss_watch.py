"""Which rank's loss went non-finite first, and at which step: watched without waiting for the GPU.

Why the loss: a NaN or inf loss on one rank becomes a NaN gradient on every rank at the next
all-reduce (DDP averages it in), so after that step every rank's gradients, and soon its weights,
are non-finite alike, and nothing says where it began. The loss is each rank's own, before the
all-reduce: the rank whose loss went non-finite first is where to look (its batch, its data, its
device), and ranks that went non-finite together point at what they share (the weights, the
learning rate). The callback is given the loss with `step_end(loss=...)` (the Lightning adapter
passes the step's output); without it this is not watched.

Cost per step: on CPU one read of a scalar (no wait there); on a GPU one copy kernel into a ring
of RING float32 values on the device. At each check the ring's window is scanned on the device
and the result copied to pinned memory, read at the next check (as the gather is: callback/gather.py,
waited for only if the GPU is a whole check interval behind), so a GPU rank's first non-finite step is
known one check late and every rank reports the same steps scanned.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from ddpdoctor.callback.gather import to_host_late

if TYPE_CHECKING:
    import torch

RING = 8192  # steps a GPU rank keeps between two checks (a check every 2 s covers steps of 0.25 ms and more)
NONE = 2**62  # "no non-finite step" in the device-side scan


class LossWatch:
    """One rank's losses: the first step whose loss was NaN or inf (sticky: the first is what matters)."""

    def __init__(self) -> None:
        self.first: Optional[int] = None
        self.off = False  # a loss of a kind it could not read: no longer watched (the job goes on)
        self._ring: Optional[torch.Tensor] = None
        self._positions: Optional[torch.Tensor] = None
        self._scanned = 0  # the last step the device-side scan covered
        self._pending: list[tuple[Any, Any]] = []  # (pinned host scalar, event) per scan in flight

    def see(self, loss: Any, step: int) -> None:
        """This step's loss (a tensor or a number); called from step_end, a few microseconds."""
        if self.first is not None or loss is None or self.off:
            return
        if isinstance(loss, (int, float)):
            if not math.isfinite(loss):
                self.first = step
            return
        detach = getattr(loss, "detach", None)
        if detach is None:
            return
        value = detach()
        if value.numel() != 1:
            value = value.sum()  # a NaN or inf anywhere stays non-finite in the sum
        if not value.is_cuda:
            if not math.isfinite(float(value)):  # a CPU tensor: reading it waits for nothing
                self.first = step
            return
        if self._ring is None:
            import torch

            self._ring = torch.zeros(RING, dtype=torch.float32, device=value.device)
            self._positions = torch.arange(RING, dtype=torch.int64, device=value.device)
        self._ring[step % RING] = value.reshape(())

    def take(self, step: int) -> Optional[int]:
        """At a check, on every rank: the first non-finite step known so far (a GPU's from earlier
        checks' scans, read once complete), and the scan of the steps since the last check launched."""
        if self._ring is None:
            return self.first
        import torch

        # Every scan in flight was launched at an earlier check: read now, waited for if the GPU is that far
        # behind (as the gather is), so every rank reports the same steps scanned at the same check.
        for host, event in self._pending:
            if not event.query():
                event.synchronize()
            found = int(host.item())  # complete: a read of pinned host memory
            if found < NONE and self.first is None:
                self.first = found
        self._pending = []
        if self.first is None and step > self._scanned:
            assert self._positions is not None
            # The step each slot holds in the window (step - RING, step]; slots of older steps are not this window's.
            steps = step - torch.remainder(step - self._positions, RING)
            candidates = torch.where((steps > self._scanned) & ~torch.isfinite(self._ring), steps,
                                     torch.full_like(steps, NONE))
            self._pending.append(to_host_late(candidates.min()))
            self._scanned = step
        return self.first


def loss_of(output: Any, bare_is_loss: bool) -> Any:
    """The loss in what a framework hands over, or None.

    `bare_is_loss`: Lightning's `training_step` returns the loss itself (or a dict holding it); a model's
    forward returns outputs, where a bare tensor is logits, never the loss, unless it is one 0-d value (a
    model that computes its own loss, as `ddpdoctor run` meets in plain loops: logits are never 0-d). A dict or a Hugging Face
    ModelOutput (both) gives its "loss"; an object its `.loss`; a tuple (a Hugging Face model with
    `return_dict=False` and labels) its first element when that is one value (logits never are).
    What comes back is watched by `LossWatch.see` (several values are summed there)."""
    import torch

    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, (tuple, list)):
        first = output[0] if output else None
        return first if isinstance(first, torch.Tensor) and first.numel() == 1 else None
    if bare_is_loss:
        return output
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 and output.is_floating_point() else None
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None
