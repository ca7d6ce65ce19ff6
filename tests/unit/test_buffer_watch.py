"""The buffer comparison's own decisions (callback/buffers.py), without a process group.

Why: every gather of the buffers is a collective, so whether a rank gathers must follow from the
table every rank holds, never from its own state: a stash is gathered once (a GPU's table shows it a
check late), a rank without the agreed stash still takes part (and nothing is judged), a forward that
did not broadcast leaves nothing to compare, and the hooks never outlive their forward or the Doctor.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ddpdoctor.callback.buffers import MAX_BUFFERS, BufferWatch


class FakeDDP(nn.Module):
    """What BufferWatch reads of a DDP model: its module, broadcast_buffers, and whether this forward syncs."""

    def __init__(self, module: nn.Module, syncs: bool = True, knew_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.broadcast_buffers = True
        self.syncs = syncs
        self.modules_buffers = list(module.buffers()) if knew_buffers else []
        self.parameters_to_ignore: set[str] = set()

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return self.syncs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _watch(syncs: bool = True) -> tuple[BufferWatch, FakeDDP, list[torch.Tensor]]:
    ddp = FakeDDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), syncs)
    watch = BufferWatch(ddp, 2, torch.device("cpu"), late=False)
    sent: list[torch.Tensor] = []

    def gather(vector: torch.Tensor) -> torch.Tensor:  # rank 1's row: its running mean one bit apart
        sent.append(vector.clone())
        other = vector.clone()
        other[0] += 1.0
        return torch.cat([vector, other])

    watch._gather = gather  # type: ignore[method-assign]
    return watch, ddp, sent


def test_a_stash_is_taken_after_the_broadcast_gathered_once_and_the_hooks_are_gone():
    watch, ddp, sent = _watch()
    watch.arm(10)
    ddp(torch.randn(8, 4))
    assert watch.stash_step == 11 and watch.stash_count == 3  # running_mean, running_var, num_batches_tracked
    assert not ddp._forward_pre_hooks and not ddp.module._forward_pre_hooks
    diff = watch.compare(11)
    assert diff is not None and diff.names == ["1.running_mean"] and diff.groups == [[0], [1]] and diff.step == 11
    assert len(sent) == 1 and sent[0].numel() == MAX_BUFFERS
    assert watch.compare(11) is None and len(sent) == 1  # the same agreed stash again (a GPU's late table): no gather


def test_no_agreement_means_no_gather_and_a_forward_without_broadcast_leaves_nothing():
    watch, ddp, sent = _watch(syncs=False)
    watch.arm(10)
    ddp(torch.randn(8, 4))
    assert watch.stash_step is None  # DDP did not broadcast in this forward: nothing is promised equal
    assert watch.compare(None) is None and sent == []
    watch.arm(20)
    assert ddp._forward_pre_hooks  # armed again at the next comparison


def test_a_rank_without_the_agreed_stash_still_gathers_and_nothing_is_judged():
    watch, ddp, sent = _watch()
    assert watch.compare(7) is None  # the table says step 7; this rank holds none: it sends -2 and judges nothing
    assert len(sent) == 1 and float(sent[0][0]) == -2.0 and watch.compared == 0


def test_the_hooks_are_removed_at_close_and_a_copy_of_the_module_does_not_drag_the_watch():
    watch, ddp, _ = _watch()
    watch.arm(10)
    clone = copy.deepcopy(ddp.module)  # an EMA or a checkpoint between a check and the next forward
    assert all(not hasattr(h, "__self__") for h in clone._forward_pre_hooks.values())
    watch.close()
    assert not ddp._forward_pre_hooks and not ddp.module._forward_pre_hooks


def test_a_hook_that_fails_leaves_no_stash_and_never_raises_into_the_forward():
    class Broken(FakeDDP):
        def _check_sync_bufs_pre_fwd(self) -> bool:
            raise AttributeError("no such private method on this torch")

    ddp = Broken(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    watch = BufferWatch(ddp, 2, torch.device("cpu"), late=False)
    watch.arm(10)
    out = ddp(torch.randn(8, 4))  # the user's forward goes on
    assert out.shape == (8, 4) and watch.stash_step is None and not ddp._forward_pre_hooks
