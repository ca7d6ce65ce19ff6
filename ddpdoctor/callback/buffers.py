"""The model's buffers, read just after DDP's broadcast and compared across ranks at the checks.

Why just after the broadcast: with broadcast_buffers=True (DDP's default) DDP copies rank 0's
buffers to every rank at the start of each forward that syncs, and the module's forward then
changes them from the rank's own batch (BatchNorm's running statistics). Compared at a check, they
would always differ; read by a forward pre-hook on the wrapped module, after DDP's broadcast and
before the module runs, every buffer DDP broadcast is rank 0's. A buffer that differs there is one
DDP does not broadcast. Recorded on torch 2.13 (2 gloo ranks): a buffer registered after DDP(...)
on a model that had none when it was built is never broadcast (`will_sync_module_buffers` asks
for the buffers DDP found at construction; it reads the list again only when it broadcasts), while
on a model built with a BatchNorm the same late buffer is broadcast. Buffers DDP was told to
ignore are not broadcast either. Each rank then keeps its own values, and a checkpoint keeps rank 0's.

The two hooks are armed at a comparison (callback/replicas.py decides when one is due, every
rank alike), fire at the next forward and remove themselves: nothing runs at the other steps.
The digests are gathered at the next check where every rank read the same step's forward; on a
GPU the gather is read one check later, as the callback's own gather is (callback/gather.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ddpdoctor.callback.gather import all_gathered, to_host_late
from ddpdoctor.callback.weak_hooks import WeakHook
from ddpdoctor.measure import replica_digest as rd

if TYPE_CHECKING:
    import torch

MAX_BUFFERS = 512  # compared per buffer; a model with more compares its first MAX_BUFFERS


@dataclass
class BufferDiff:
    """What the gathered digests say: the buffers that differ and the ranks, grouped by equal values."""

    step: int
    names: list[str]
    groups: list[list[int]]  # the ranks by equal digests of the differing buffers, largest group first
    never_broadcast: bool  # DDP found no buffer when it was built: it broadcasts none
    ignored: list[str]  # of the names, those DDP was told to ignore


class BufferWatch:
    """One rank's side: arm, stash the digests after the broadcast, gather them, say what differs."""

    def __init__(self, ddp: Any, world_size: int, device: torch.device, late: bool) -> None:
        self.ddp = ddp
        self.world_size = world_size
        self.device = device
        self.late = late
        # Only where DDP broadcasts (the default): with broadcast_buffers=False they differ by design (DOC016).
        self.done = (ddp is None or world_size < 2 or not getattr(ddp, "broadcast_buffers", False)
                     or not hasattr(ddp, "_check_sync_bufs_pre_fwd"))
        self.stash_step: Optional[int] = None  # the step whose forward's buffers are stashed
        self.stash_count = -1
        self._stash: Optional[torch.Tensor] = None
        self._names: list[str] = []
        self._handles: list[Any] = []
        self._armed_step = 0
        self._will_sync = False
        self._pending: Optional[tuple[int, Any, Any, list[str]]] = None  # (step, pinned host, event, names)
        self._used_step: Optional[int] = None  # the last stash gathered (a GPU's table still shows it a check on)
        self.compared = 0  # comparisons judged (so a quiet run can show it compared)

    def arm(self, step: int) -> None:
        """At a due comparison: read the buffers at the next forward (the step after `step`)."""
        if self.done or self._handles or self.stash_step is not None:
            return
        if not list(self.ddp.module.buffers()):
            return  # nothing to compare (yet)
        self._armed_step = step + 1
        # Closures over a weak reference, not bound methods: a deepcopy or torch.save of the module between
        # a check and the next forward must not drag this watch (and the DDP wrapper) along.
        self._handles = [self.ddp.register_forward_pre_hook(WeakHook(self, "_before_ddp", on_error="_failed")),
                         self.ddp.module.register_forward_pre_hook(WeakHook(self, "_after_broadcast",
                                                                             on_error="_failed"))]

    def _failed(self) -> None:
        """A hook of ours failed: this rank keeps no stash, its row then differs from its peers', and every
        rank drops and reads again at a later comparison (callback/doctor.py)."""
        self.close()
        self._stash, self.stash_step, self.stash_count = None, None, -1

    def close(self) -> None:
        """At the Doctor's close: hooks still armed are removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_ddp(self, module: Any, args: Any) -> None:
        # What DDP's own _pre_forward will decide, read before it runs (nothing changes in between).
        self._will_sync = bool(self.ddp._check_sync_bufs_pre_fwd())

    def _after_broadcast(self, module: Any, args: Any) -> None:
        self.close()
        if not self._will_sync:
            # This forward did not broadcast (under no_sync(), after a forward without gradients): nothing is
            # promised equal. Where DDP never broadcasts (no buffer when it was built), the buffers are read anyway.
            if len(getattr(self.ddp, "modules_buffers", []) or []) > 0:
                return
        import torch

        named = list(module.named_buffers())[:MAX_BUFFERS]
        if not named:
            return
        device = named[0][1].device  # summed where the buffers are: copied to the collective's device at a check
        with torch.no_grad():
            digests = torch.stack([rd.bitsum(b).to(device) for _, b in named]).to(torch.float64)
            stash = torch.full((MAX_BUFFERS,), -1.0, dtype=torch.float64, device=device)
            stash[:len(named)] = digests
        self._names = [n for n, _ in named]
        self._stash, self.stash_count, self.stash_step = stash, len(named), self._armed_step

    def drop(self) -> None:
        """Forget this rank's stash (its peers read another forward's): armed again at the next comparison."""
        self._stash, self.stash_step, self.stash_count = None, None, -1

    def compare(self, agreed_step: Optional[int]) -> Optional[BufferDiff]:
        """At a check, every rank alike: `agreed_step` is the step whose forward every rank's row says it
        stashed (None: they differ, or none did). The gather happens when the table says so, never from
        this rank's own state, so every rank calls it at the same check; on a GPU the previous check's
        gather is read here."""
        import torch

        out = None
        if self._pending is not None:
            at, host, event, names = self._pending
            self._pending = None
            if not event.query():
                event.synchronize()  # a whole check interval behind: every rank reads the same gather
            out = self._diff(at, host.reshape(self.world_size, -1).tolist(), names)
        if agreed_step is not None and agreed_step != self._used_step and not self.done:
            mine = self._stash if self.stash_step == agreed_step and self._stash is not None else None
            # (A rank without that stash cannot be, the table said it holds it; sent as -2 rather than a hang.)
            sent = mine.to(self.device) if mine is not None else torch.full((MAX_BUFFERS,), -2.0, dtype=torch.float64,
                                                                          device=self.device)
            gathered = self._gather(sent)
            at = self._used_step = agreed_step
            self._stash, self.stash_step, self.stash_count = None, None, -1
            if self.late:
                self._pending = (at, *to_host_late(gathered), list(self._names))
            else:
                out = out or self._diff(at, gathered.reshape(self.world_size, -1).tolist(), self._names)
        if out is not None:
            self.done = True
        return out

    def _gather(self, vector: torch.Tensor) -> torch.Tensor:
        return all_gathered(vector, self.world_size)

    def _diff(self, step: int, rows: list[list[float]], names: list[str]) -> Optional[BufferDiff]:
        if any(row and row[0] == -2.0 for row in rows):
            return None  # a rank had no stash to send: nothing compared this time
        self.compared += 1
        differing = [i for i in range(min(len(names), MAX_BUFFERS)) if len({row[i] for row in rows}) > 1]
        if not differing:
            return None
        by: dict[tuple[float, ...], list[int]] = {}
        for rank, row in enumerate(rows):
            by.setdefault(tuple(row[i] for i in differing), []).append(rank)
        groups = sorted(by.values(), key=lambda rs: (-len(rs), rs))
        names = [names[i] for i in differing]
        ignored = set(getattr(self.ddp, "parameters_to_ignore", ()) or ())
        return BufferDiff(step, names, groups, not (getattr(self.ddp, "modules_buffers", None) or []),
                          [n for n in names if n in ignored])

