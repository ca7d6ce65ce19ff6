"""The per-step record of replica fingerprints (callback/replicas.py): when it is kept, and how it dates a divergence.

Why: a divergence is seen at a check, but it began at one step between two checks; where a step is
long enough to afford one fingerprint of the weights, every rank keeps one per step and the first
step whose fingerprints differ is that step. The record must be kept only where it is cheap, and a
step the ring no longer holds must not be guessed.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpdoctor.callback.replicas import RING, ReplicaWatch
from ddpdoctor.measure import replica_digest as rd


def _watch() -> ReplicaWatch:
    net = nn.Linear(4, 2)
    watch = ReplicaWatch(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, torch.device("cpu"), late=False)
    watch.done = False  # not a DDP model here: the ring's logic alone
    return watch


def test_the_record_is_kept_only_where_a_fingerprint_is_within_the_budget_of_a_step():
    watch = _watch()
    watch.plan_per_step(10, slowest_fingerprint_ms=0.07, slowest_step_ms=10.0)  # 0.7%: too dear
    assert not watch.per_step and watch.recorded_from is None
    watch.plan_per_step(20, slowest_fingerprint_ms=0.07, slowest_step_ms=40.0)  # 0.18%
    assert watch.per_step and watch.recorded_from == 21
    watch.plan_per_step(30, slowest_fingerprint_ms=0.07, slowest_step_ms=41.0)  # still kept: unbroken since 21
    assert watch.recorded_from == 21
    watch.plan_per_step(40, slowest_fingerprint_ms=0.0, slowest_step_ms=40.0)  # not measured: not kept
    assert not watch.per_step and watch.recorded_from is None


def test_the_first_differing_step_is_found_where_the_ring_covers_every_step_since_the_last_equal_check():
    watch = _watch()
    watch.recorded_from, watch.last_equal_step = 11, 30
    same = [float(s) for s in range(RING)]
    other = list(same)
    for s in range(34, 41):
        other[s % RING] += 1.0  # rank 1's weights differ from step 34
    assert watch._first_differing_step({0: same, 1: other}, 40) == 34
    assert watch._first_differing_step({0: same, 1: same}, 40) is None
    watch.recorded_from = 35  # the record began after the last equal check, at a step already apart:
    assert watch._first_differing_step({0: same, 1: other}, 40) is None  # steps 31-34 unknown, not guessed
    watch.recorded_from = 33  # ...but a recorded step still equal (33) dates the next one
    assert watch._first_differing_step({0: same, 1: other}, 40) == 34
    watch.recorded_from, watch.last_equal_step = 1, None
    assert watch._first_differing_step({0: same, 1: other}, RING + 34) is None  # steps 1-34 overwritten
    watch.recorded_from = None
    assert watch._first_differing_step({0: same, 1: other}, 40) is None


def test_equal_weights_give_equal_fingerprints_and_one_changed_bit_another():
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    la, lb = (rd.layout(torch.optim.SGD(m.parameters(), lr=0.1), m) for m in (a, b))
    assert int(rd.fingerprint(la)) == int(rd.fingerprint(lb))
    with torch.no_grad():
        flat = b.weight.view(-1).view(torch.int32)
        flat[0] ^= 1  # the lowest bit of one weight
    assert int(rd.fingerprint(la)) != int(rd.fingerprint(lb))


def _twin_watches() -> tuple[ReplicaWatch, ReplicaWatch, nn.Linear]:
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    watches = []
    for net in (a, b):
        w = ReplicaWatch(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, torch.device("cpu"), late=False)
        w.done = False  # not a DDP model here: the end's payload alone
        watches.append(w)
    return watches[0], watches[1], b


def test_the_end_payload_lays_out_as_the_checks_gathered_row_and_its_fingerprint_tells_equal_from_not():
    """The end trades a compact payload through the store (only the model's entries, the ring where kept); laid out
    again it must be the very row a check gathers, so the end judges with the checks' own rules."""
    wa, wb, b = _twin_watches()
    fa, detail = wa.end_payload()
    assert wa.from_end_payload(detail) == wa._detail().tolist()
    assert len(detail) < 4_000 < 8 * len(wa._detail())  # two entries and the settings, not the 2048-entry padding
    assert wb.end_payload()[0] == fa  # equal weights and settings: one fingerprint
    with torch.no_grad():
        b.bias[0] += 1e-6
    assert wb.end_payload()[0] != fa
    wb.plan_per_step(5, slowest_fingerprint_ms=0.01, slowest_step_ms=40.0)  # a per-step record is kept: it travels
    wb.record(6)
    assert wb.from_end_payload(wb.end_payload()[1]) == wb._detail().tolist()


def test_the_end_sends_no_payload_where_its_comparison_would_delay_the_exit_or_is_done():
    wa, _, _ = _twin_watches()
    wa.digest_ms = 300.0  # four reads of these weights: more than END_MAX_MS
    assert wa.end_payload() is None
    wa.digest_ms, wa.done = 1.0, True  # a divergence already named, or nothing to compare
    assert wa.end_payload() is None
