"""The callback's one collective, and the batch's fingerprint: read without waiting for the GPU.

On CPU (gloo) the gather is synchronous and cheap: its table is judged at once. Under NCCL
the gathered tensor lives on the GPU, and reading it (`.cpu()`, `.tolist()`) waits for every
kernel queued before it: on 2 ms steps that stall was most of what the callback cost
(docs/callback.md, "What it costs"). There the gather is launched at a check, its result is
copied into pinned host memory on the stream, and it is read at the *next* check, when it is
long complete (`Event.query()`). Every rank reads the same gather at the same check, so every
rank judges the same table and agrees on the next check's step (callback/schedule.py). In the
unlikely case that a whole check interval later the copy is still queued (the GPU is that far
behind, or stuck: then the step watchdog is already timing this step), it is waited for, so
that no rank judges a different table from its peers.

The batch's fingerprint reads a few thousand of its values: on the GPU the same way, one
check late.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

from ddpdoctor.runtime.workload import tensor_bytes

if TYPE_CHECKING:
    import torch

FINGERPRINT_VALUES = 4096  # of each of the batch's first FINGERPRINT_TENSORS tensors, strided
FINGERPRINT_TENSORS = 4


class Gather:
    """All ranks' packed rows, side by side: now on CPU, one check late on a GPU."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.late = device.type == "cuda"
        self._pending: deque[tuple[Any, Any]] = deque()  # (pinned host tensor, event) per gather in flight

    def exchange(self, values: list[float]) -> Optional[list[list[float]]]:
        """Send this rank's row; every rank's row from the gather to judge now (this one's on CPU,
        the previous check's on a GPU; None at a GPU's first check)."""
        import torch

        if not self.late:
            out = all_gathered(torch.tensor(values, dtype=torch.float64), self.world_size)
            return out.reshape(self.world_size, -1).tolist()
        ready = self._take_previous()
        sent = torch.tensor(values, dtype=torch.float64).pin_memory().to(self.device, non_blocking=True)
        # NCCL: queued on the stream; the CPU does not wait for it, nor for the copy to host.
        self._pending.append(to_host_late(all_gathered(sent, self.world_size)))
        return ready

    def flush(self) -> Optional[list[list[float]]]:
        """The gather still in flight, waited for (at close: off the step path)."""
        if not self._pending:
            return None
        host, event = self._pending.popleft()
        event.synchronize()
        return host.reshape(self.world_size, -1).tolist()

    def _take_previous(self) -> Optional[list[list[float]]]:
        if not self._pending:
            return None
        host, event = self._pending.popleft()
        if not event.query():  # a whole check interval behind: wait, so every rank judges this table
            event.synchronize()
        return host.reshape(self.world_size, -1).tolist()


def all_gathered(sent: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `sent` (float64), side by side on its device: the callback's collectives all go through here."""
    import torch
    import torch.distributed as dist

    out = torch.empty(world_size * sent.numel(), dtype=torch.float64, device=sent.device)
    # torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older torch has only that.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, sent)
    return out


def to_host_late(result: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A GPU result copied into pinned host memory on its stream, and the event that says the copy is done:
    read at a later check (after `event.query()`), so the step path never waits for the GPU."""
    import torch

    host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
    host.copy_(result, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(result.device))
    return host, event


class BatchPrint:
    """52 bits of a SHA-1 over strided samples of the batch's first tensors (exact in a float64).

    Several tensors, so a constant first one (a mask, say) does not make two ranks' batches look
    the same. Taken only at checks. A batch on the GPU is sampled there and copied to pinned
    memory without waiting; its fingerprint is the one `take` returns at the next check."""

    def __init__(self) -> None:
        self._pending: Optional[tuple[list[Any], Any]] = None

    def take(self, batch: Any) -> Optional[int]:
        """This batch's fingerprint (CPU), or the previous check's batch's (GPU); None when unknown."""
        from ddpdoctor.callback.user_objects import tensors

        found = tensors(batch)[:FINGERPRINT_TENSORS] if batch is not None else []
        if not any(t.is_cuda for t in found):
            return _digest([_sample(t) for t in found]) if found else None
        previous, self._pending = self._pending, None
        self._start(found)
        if previous is None or not previous[1].query():
            return None  # not complete: unknown this check rather than a wait
        return _digest(previous[0])

    def take_now(self, batch: Any) -> Optional[int]:
        """This batch's fingerprint, read now wherever it lives: at the end of the run, off the step path, where a
        GPU's copy may be waited for."""
        from ddpdoctor.callback.user_objects import tensors

        found = tensors(batch)[:FINGERPRINT_TENSORS] if batch is not None else []
        return _digest([_sample(t) for t in found]) if found else None

    def _start(self, found: list[torch.Tensor]) -> None:
        import torch

        copies = []
        for tensor in found:
            sample = _sample(tensor)
            host = torch.empty(sample.shape, dtype=sample.dtype, pin_memory=True)
            host.copy_(sample, non_blocking=True)
            copies.append(host)
        event = torch.cuda.Event()
        event.record()
        self._pending = (copies, event)


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    flat = tensor.detach().reshape(-1)
    stride = max(1, flat.numel() // FINGERPRINT_VALUES)
    return flat[::stride][:FINGERPRINT_VALUES].to(torch.float64).contiguous()


def _digest(samples: list[torch.Tensor]) -> Optional[int]:
    if not samples:
        return None
    digest = hashlib.sha1()
    for sample in samples:
        digest.update(tensor_bytes(sample.cpu()))
    return int.from_bytes(digest.digest()[:7], "big") >> 4 or 1
