"""The median, exactly as `statistics.median` gives it, without its overhead.

Why: the straggler judge takes a median per step across ranks (hundreds a check) and runs inside
the user's training loop at every check of the callback (issue 36). `statistics.median` checks its
input and dispatches generically; on the 1 to 8 values a step has, that overhead was most of the
judge's time (1.25 million calls in a replay of 288 kept runs). Same sort, same arithmetic, so the
same float results: the judges' verdicts do not change (tests/unit/test_medians.py).
"""

from __future__ import annotations

from typing import Sequence


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); NaN for none."""
    n = len(values)
    if n == 1:
        return float(values[0])
    if n == 0:
        return float("nan")
    ordered = sorted(values)
    half = n // 2
    if n % 2:
        return float(ordered[half])
    return float((ordered[half - 1] + ordered[half]) / 2)
