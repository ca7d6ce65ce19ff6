"""The DDP comm hook that times each step's wait for its last gradient all-reduce.

Its own module because it runs inside DDP's backward pass, not in `Doctor`'s step flow, and
because the hook must stay unannotated (see `wait_hook`), which a reader of the flow should not
have to know. DOC011 (a wait that goes unmeasured) is decided here too: it is this hook's absence.
"""

from __future__ import annotations

import time
from typing import Any, Optional


class WaitTimer:
    """DDP comm hook state: an ordinary all-reduce, with the wait for the last bucket timed."""

    def __init__(self, group: Any, size: int) -> None:
        self.group = group  # DDP's own process group: a subgroup's gradients stay in the subgroup
        self.size = size
        self.last_launch = 0.0
        self.last_done = 0.0

    def take_ms(self) -> float:
        ms = max(0.0, self.last_done - self.last_launch) * 1e3 if self.last_launch else 0.0
        self.last_launch = self.last_done = 0.0
        return ms


def wait_hook(state, bucket):
    # Unannotated on purpose: DDP's register_comm_hook compares the hook's annotations with
    # GradBucket and Future[Tensor] objects, and under `from __future__ import annotations`
    # they are strings, so an annotated hook is refused and the wait goes unmeasured (DOC011).
    import torch.distributed as dist

    state.last_launch = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(state.size)

    def done(fut: Any) -> Any:
        value = fut.value()[0]  # raises if the all-reduce failed: still pending, for the hang's record
        state.last_done = time.perf_counter()
        return value

    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(done)


def install_wait_timer(model: Any, measure_comm: bool, distributed: bool, world_size: int) -> Optional[WaitTimer]:
    """The comm hook that times each step's gradient all-reduce wait, or None where it cannot be ours.

    Only DDP's comm hook has the (state, bucket) form the timer is: FSDP's register_comm_hook
    takes another signature, and its hook would fail inside the user's backward pass."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel) and measure_comm
            and distributed):
        return None
    group = getattr(model, "process_group", None)
    timer = WaitTimer(group, dist.get_world_size(group) if group is not None else world_size)
    try:
        model.register_comm_hook(timer, wait_hook)
    except Exception:  # the job has a comm hook of its own: step times only
        return None
    return timer


def unmeasured_wait(model: Any, is_ddp: bool, timer: Optional[WaitTimer], measure_comm: bool,
                    distributed: bool) -> Optional[str]:
    """The wrapper whose collectives go untimed (DOC011 names it), or None where the wait is measured
    or there is no data-parallel wrapper to time."""
    from torch.nn.parallel import DistributedDataParallel

    if not (is_ddp and timer is None and distributed):
        return None
    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, DistributedDataParallel):
        return type(inner).__name__
    return ("DistributedDataParallel (measure_comm=False)" if not measure_comm
            else "DistributedDataParallel (the job has its own comm hook)")
