"""The comparison of replicas (judge/replicas.py) and its digest (measure/replica_digest.py), alone.

Digests are exact: equal tensors give equal sums whatever the order or thread count, one changed bit
changes the sum. The judge names the differing tensors, the minority ranks and the cause the
numbers tell, one finding per cause.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddpdoctor.judge.replicas import RankDigest, Seen, compare, findings
from ddpdoctor.measure import replica_digest as rd

NAMES = [("fc.weight",), ("fc.bias",), ("temperature",)]
AVERAGED = [True, True, False]
SETTINGS = rd.settings_names()


def digest(rank: int, params, grads=None, pnorms=None, gnorms=None, lr: float = 0.1) -> RankDigest:
    opt = torch.optim.SGD([torch.zeros(1)], lr=lr)
    return RankDigest(rank, list(params), rd.settings(opt), grads, pnorms, gnorms)


def test_a_bit_sum_ignores_order_and_threads_and_sees_one_flipped_bit():
    t = torch.randn(100_003)
    base = rd.bitsum(t)
    assert rd.bitsum(t.flip(0).contiguous()) == base == rd.bitsum(t[torch.randperm(t.numel())].contiguous())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert rd.bitsum(t) == base
    finally:
        torch.set_num_threads(threads)
    nudged = t.clone()
    nudged[77] = torch.nextafter(nudged[77], torch.tensor(1e9))  # one last bit of one element
    assert rd.bitsum(nudged) != base
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        u = torch.randn(64).to(dtype)
        assert rd.bitsum(u) == rd.bitsum(u.flip(0).contiguous())


def test_the_layout_names_the_optimizers_tensors_from_the_model_and_knows_what_ddp_averages():
    model = nn.Sequential(nn.Linear(2, 2))
    stray = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [stray], "lr": 0.5}], lr=0.1)
    layout = rd.layout(opt, model, averaged={id(p) for p in model.parameters()})
    assert [e.names for e in layout.entries][:2] == [("0.weight",), ("0.bias",)]
    assert "outside the model" in layout.entries[2].names[0] and "(1,)" in layout.entries[2].names[0]
    assert [e.averaged for e in layout.entries] == [True, True, False] and layout.group_sizes == [2, 1]
    values = rd.settings(opt)
    assert values[SETTINGS.index("group 1 lr")] == 0.5 and values[SETTINGS.index("param groups")] == 2.0


def test_many_tensors_are_summed_into_at_most_max_entries_groups():
    params = [torch.full((2,), float(i), requires_grad=True) for i in range(rd.MAX_ENTRIES + 5)]
    layout = rd.layout(torch.optim.SGD(params, lr=0.1), nn.Module())
    assert len(layout.entries) <= rd.MAX_ENTRIES and sum(len(g) for g in layout.groups) == len(params)
    before = rd.digest(layout)
    with torch.no_grad():
        params[-1][0] += 1.0
    after = rd.digest(layout)
    assert (before != after).sum() == 1 and after.dtype == torch.float64


def test_equal_replicas_give_no_finding():
    same = {r: digest(r, [1.0, 2.0, 3.0]) for r in range(4)}
    comparison = compare(same, NAMES, AVERAGED, SETTINGS)
    assert comparison.equal and findings(comparison, Seen(50, 40), {}) == []


def test_a_tensor_ddp_does_not_average_is_the_cause_and_its_rank_groups_are_listed():
    digests = {r: digest(r, [1.0, 2.0, 10.0 + r], grads=[5.0, 6.0, 7.0 + r], pnorms=[1.0, 1.0, 1.0 + 0.01 * r],
                         gnorms=[1.0, 1.0, 1.0]) for r in range(2)}
    comparison = compare(digests, NAMES, AVERAGED, SETTINGS)
    [entry] = comparison.entries
    assert entry.names == ("temperature",) and entry.groups == [[0], [1]] and entry.grads_equal is False
    [weights] = findings(comparison, Seen(11, 10), {0: "a", 1: "b"})
    assert weights.code == "DOC013" and weights.severity.label == "critical"
    assert "temperature" in weights.title and "between ranks 0-1" in weights.title and "since step 11-11" in weights.title
    assert weights.evidence["explained_by"] == "DOC012" and "does not average" in weights.evidence["cause"]
    assert math.isclose(weights.evidence["largest_norm_rel_diff"], 0.01 / 1.01)


def test_same_gradients_different_weights_is_a_change_outside_the_optimizer_on_the_odd_rank():
    digests = {r: digest(r, [1.0 if r != 2 else 9.0, 2.0, 3.0], grads=[4.0, 5.0, 6.0], pnorms=[2.0 if r != 2 else 1.0,
                                                                                              1.0, 1.0]) for r in range(4)}
    [weights] = findings(compare(digests, NAMES, AVERAGED, SETTINGS), Seen(30, None), {r: f"h{r}" for r in range(4)})
    assert weights.ranks == (2,) and weights.nodes == ("h2",) and "on rank 2 against the others" in weights.title
    assert "changed outside the optimizer" in weights.evidence["cause"] and "at step 30, the first compared" in weights.title


def test_settings_that_differ_are_their_own_finding_and_the_cause_of_the_drift():
    digests = {r: digest(r, [1.0 + r, 2.0, 3.0], grads=[1.0, 1.0, 1.0], lr=0.1 * (1 + r)) for r in range(2)}
    found = {f.code: f for f in findings(compare(digests, NAMES, AVERAGED, SETTINGS), Seen(20, 10), {})}
    assert "group 0 lr is 0.1 on rank 0, 0.2 on rank 1" in found["DOC014"].title
    assert found["DOC013"].evidence["explained_by"] == "DOC014"


def test_differences_in_the_last_bits_only_are_a_warning_not_a_divergence():
    digests = {r: digest(r, [1.0 + r, 2.0, 3.0], grads=[1.0, 1.0, 1.0], pnorms=[1.0 + 1e-9 * r, 1.0, 1.0])
               for r in range(2)}
    [weights] = findings(compare(digests, NAMES, AVERAGED, SETTINGS), Seen(20, 10), {})
    assert weights.severity.label == "warn" and "in the last bits only" in weights.title


def test_non_finite_weights_on_one_rank_name_the_step_taken_there_and_skipped_elsewhere():
    nan = float("nan")
    digests = {0: digest(0, [1.0, 2.0, 3.0], grads=[1.0, 1.0, 1.0], pnorms=[nan, 1.0, 1.0], gnorms=[nan, 1.0, 1.0]),
               1: digest(1, [7.0, 2.0, 3.0], grads=[1.0, 1.0, 1.0], pnorms=[1.0, 1.0, 1.0], gnorms=[nan, 1.0, 1.0])}
    found = {f.code: f for f in findings(compare(digests, NAMES, AVERAGED, SETTINGS), Seen(40, 20), {})}
    assert found["DOC017"].ranks == (0,) and "rank 1's are finite" in found["DOC017"].title
    assert "skipped where they did not" in found["DOC017"].title
    assert found["DOC013"].evidence["explained_by"] == "DOC017"


@pytest.mark.parametrize("bypassed", [True, False])
def test_gradients_that_differ_say_ddp_did_not_average_them_and_a_bypass_is_named_when_seen(bypassed):
    digests = {r: digest(r, [1.0 + r, 2.0, 3.0], grads=[5.0 + r, 1.0, 1.0]) for r in range(2)}
    [weights] = findings(compare(digests, NAMES, AVERAGED, SETTINGS), Seen(1, None, bypassed_ddp=bypassed), {})
    assert weights.evidence["explained_by"] == ("DOC015" if bypassed else None)
    assert ("model.module" in weights.evidence["cause"]) and ("DDP did not average them" in weights.evidence["cause"]
                                                              or bypassed)


def test_only_ddp_replicas_are_compared(tmp_path):
    """FSDP's and DeepSpeed's ranks hold different shards by design: comparing them would name every rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpdoctor.callback.replicas import ReplicaWatch

    plain = nn.Linear(2, 2)
    assert ReplicaWatch(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 2, torch.device("cpu"), False).done
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        watch = ReplicaWatch(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2, torch.device("cpu"), False)
        assert not watch.done and [e.names for e in watch.layout.entries] == [("weight",), ("bias",)]
        assert all(e.averaged for e in watch.layout.entries)
        assert not ReplicaWatch(ddp, None, 2, torch.device("cpu"), False).layout.entries
    finally:
        dist.destroy_process_group()
