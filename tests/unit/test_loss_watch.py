"""The first non-finite loss of each rank, and the verdict across ranks (callback/loss_watch.py, judge/losses.py).

Why these cases: a NaN loss on one rank turns every rank's gradients NaN at the next all-reduce, so only
the ranks' own losses say where it began; the verdict must name the rank first alone, say "together"
when every rank went at once, and lead the weights' findings it explains (judge/causal_order.py).
"""

from __future__ import annotations

import math

import torch

from ddpdoctor.callback.loss_watch import LossWatch
from ddpdoctor.core import codes
from ddpdoctor.judge import causal_order, losses


def test_the_first_non_finite_step_is_kept_and_later_ones_do_not_move_it():
    watch = LossWatch()
    for step, value in enumerate([0.7, 0.6, float("nan"), 0.5, float("inf")], start=1):
        watch.see(torch.tensor(value), step)
    assert watch.take(5) == 3


def test_numbers_non_scalar_losses_and_none_are_read_alike():
    number = LossWatch()
    number.see(1.5, 1)
    number.see(None, 2)
    number.see(-math.inf, 3)
    assert number.take(3) == 3
    vector = LossWatch()
    vector.see(torch.tensor([0.1, float("nan"), 0.2]), 4)  # a per-sample loss never reduced
    assert vector.take(4) == 4
    finite = LossWatch()
    for step in range(1, 50):
        finite.see(torch.tensor(1e30) * step, step)  # large but finite: nothing
    assert finite.take(49) is None


def test_one_rank_first_is_named_alone_with_the_others_after_it_and_the_finite_ones():
    f = losses.finding({0: 32, 1: 31, 2: None}, {0: "a", 1: "b", 2: "b"}, at_step=40)
    assert f is not None and f.code == "DOC018" and f.ranks == (1,) and f.nodes == ("b",)
    assert f.title == ("The loss went non-finite (NaN or inf) first on rank 1, at step 31; then rank 0 at step 32; "
                       "rank 2's was finite to step 40")
    assert losses.said({0: 32, 1: 31, 2: None}) == "rank 1's loss went non-finite first, at step 31"


def test_every_rank_at_the_same_step_points_at_what_they_share():
    f = losses.finding({0: 9, 1: 9}, {})
    assert f is not None and f.ranks == (0, 1) and f.evidence["together"] is True
    assert "on every rank at step 9 together" in f.title and "not one rank's data" in f.title
    assert losses.said({0: 9, 1: 9}) == "every rank's loss went non-finite at step 9 together"


def test_finite_losses_or_none_given_say_nothing():
    assert losses.finding({0: None, 1: None}, {}) is None and losses.said({}) is None


def _weights(code: str, step: int, ranks: tuple[int, ...], said: object = "DOC017", equal: object = 30):
    evidence = ({"first_seen_step": step, "last_equal_step": equal, "explained_by": said} if code == "DOC013"
                else {"step": step})
    return codes.finding(code, "callback", f"{code} at {step}", ranks=ranks, nodes=(),
                         **({"severity": codes.Severity.CRITICAL} if code == "DOC013" else {}), evidence=evidence)


def test_the_loss_leads_the_weights_it_made_non_finite_on_another_rank():
    loss = losses.finding({0: 32, 1: 31}, {})
    assert loss is not None
    ordered = causal_order.ordered([_weights("DOC013", 40, (0, 1)), _weights("DOC017", 40, (0,)), loss])
    assert [f.code for f in ordered] == ["DOC018", "DOC017", "DOC013"]
    assert [f.explained_by for f in ordered] == ["", "DOC018", "DOC018"]
    assert causal_order.verdict_line(ordered).startswith("DOC018 (rank 1): The loss went non-finite")


def test_a_loss_that_went_non_finite_after_the_weights_were_apart_explains_nothing():
    loss = losses.finding({0: 55, 1: None}, {})
    assert loss is not None
    ordered = causal_order.ordered([_weights("DOC017", 40, (0,)), loss])
    assert ordered[0].code == "DOC017" and all(not f.explained_by for f in ordered)


def test_a_divergence_told_by_another_cause_or_seen_equal_after_the_nan_is_not_the_loss_s():
    loss = losses.finding({0: 5, 1: None}, {})  # a transient inf early in the run
    assert loss is not None
    settings = _weights("DOC013", 4000, (1,), said="DOC014", equal=3990)  # the learning rates differ: DOC014's
    assert not causal_order.ordered([settings, loss])[0].explained_by
    later = _weights("DOC013", 4000, (1,), said=None, equal=3990)  # equal at 3990, long after the NaN at 5
    assert all(not f.explained_by for f in causal_order.ordered([later, loss]))
