"""What the stage-deadline watchdog publishes about where its rank is.

Recorded in the full suite (issue 40): `check --inject desync:rank=1` on 3 ranks named rank 0 "hung in
stage train, outside any collective" and no desync, because rank 0's all-reduce had just raised (gloo's
own timeout) and its stage handler was still formatting the traceback (its stack: linecache,
tokenize.open) when the deadline fired; the collective it came out of had already been cleared.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddpdoctor.runtime.context import RankContext
from ddpdoctor.runtime.liveness import Watchdog
from ddpdoctor.runtime.rank_state import RankState


def _watchdog(state: RankState) -> Watchdog:
    dog = Watchdog(side=None, rank=0, state=state)  # type: ignore[arg-type]  # record() writes nothing
    dog.armed_stage, dog.armed_for_s = "train", 6.0
    return dog


def test_a_collective_that_raised_is_still_where_the_rank_was_at_the_deadline() -> None:
    state = RankState(stage="train")
    holder = SimpleNamespace(state=state)
    with pytest.raises(RuntimeError):
        with RankContext.collective(holder, "ddp_gradient_allreduce", step=0):  # type: ignore[arg-type]
            raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    assert state.collective is None  # the handler's view: no collective in flight any more
    record = _watchdog(state).record(now=1.0)
    assert record["collective"] == {"op": "ddp_gradient_allreduce", "seq": 1, "step": 0}


def test_a_rank_in_its_own_code_is_outside_any_collective() -> None:
    state = RankState(stage="train")
    holder = SimpleNamespace(state=state)
    with RankContext.collective(holder, "barrier"):  # type: ignore[arg-type]
        pass
    assert _watchdog(state).record(now=1.0)["collective"] is None


def test_the_collective_in_flight_is_published() -> None:
    state = RankState(stage="train", collective={"op": "barrier", "seq": 4}, collectives_entered=4)
    assert _watchdog(state).record(now=1.0)["collective"] == {"op": "barrier", "seq": 4}
