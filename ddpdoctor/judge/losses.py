"""Which rank's loss went non-finite first: the rank to look at, or the cause the ranks share.

Pure: given each rank's first step with a NaN or inf loss (callback/loss_watch.py, gathered at
the checks; None where its loss stayed finite), one finding (DOC018). Why it matters beside the
weights' check (judge/replicas.py): DDP averages a rank's non-finite gradient into every rank's,
so the weights go non-finite on every rank at the same step and look alike; only the losses,
each rank's own before the all-reduce, say where it began. A rank first alone points at its own
batch, data or device; every rank at the same step points at what they share (the weights, the
learning rate, an fp16 overflow of the model itself).
"""

from __future__ import annotations

from typing import Mapping, Optional

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, rank_ranges

PROBE = "callback"


def first_ranks(firsts: Mapping[int, Optional[int]]) -> tuple[Optional[int], list[int]]:
    """(the first non-finite step of any rank, the ranks whose loss went non-finite at it)."""
    bad = {r: s for r, s in firsts.items() if s is not None}
    if not bad:
        return None, []
    step = min(bad.values())
    return step, sorted(r for r, s in bad.items() if s == step)


def said(firsts: Mapping[int, Optional[int]]) -> Optional[str]:
    """The finding's short form, for the findings it explains ("rank 1's loss went non-finite first, at step 37")."""
    step, ranks = first_ranks(firsts)
    if step is None:
        return None
    if len(ranks) == len(firsts) and len(ranks) > 1:
        return f"every rank's loss went non-finite at step {step} together"
    return f"rank {rank_ranges(ranks)}'s loss went non-finite first, at step {step}"


def finding(firsts: Mapping[int, Optional[int]], hosts: Mapping[int, str], probe: str = PROBE,
            at_step: Optional[int] = None) -> Optional[Finding]:
    """DOC018 when any rank's loss went non-finite; None when every loss stayed finite (or none was given)."""
    step, ranks = first_ranks(firsts)
    if step is None:
        return None
    later = {r: s for r, s in firsts.items() if s is not None and r not in ranks}
    finite = sorted(r for r, s in firsts.items() if s is None)
    together = len(ranks) == len(firsts) and len(ranks) > 1
    if together:
        title = (f"The loss went non-finite (NaN or inf) on every rank at step {step} together: the cause is what the "
                 "ranks share (the weights, the learning rate, an overflow in the model), not one rank's data")
    else:
        title = f"The loss went non-finite (NaN or inf) first on rank {rank_ranges(ranks)}, at step {step}"
        if later:
            title += "; then " + ", ".join(f"rank {r} at step {s}" for r, s in sorted(later.items(), key=lambda x: x[1]))
        if finite:  # said once (the finding is not repeated), so as of when it was seen
            title += f"; rank {rank_ranges(finite)}'s " + (f"was finite to step {at_step}" if at_step else "was finite")
    return codes.finding(
        "DOC018", probe, title, ranks=tuple(ranks),
        nodes=tuple(sorted({hosts[r] for r in ranks if r in hosts})),
        evidence={"first_nonfinite_step": {str(r): s for r, s in sorted(firsts.items())}, "first_step": step,
                  "first_ranks": ranks, "together": together})
