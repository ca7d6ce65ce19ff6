"""When the callback checks next: by steps (`every`) and by time (`check_every_s`), agreed by all ranks.

A check is a collective: every rank must make it at the same step, or the job hangs in it. A
clock read on each rank would disagree by a step now and then, so the next check's step is
computed at each check from the gathered table, which every rank holds alike: the slowest
rank's mean step over the window (its wall time between checks over its steps) says how many
steps `check_every_s` is. Checks stay on multiples of `every`, as they always were.

Why by time: on 2 ms steps `every=50` alone is ten gathers a second, each a collective and a
judging of the table, a few percent of the job; on 5 s steps it is one check in four minutes.
`check_every_s` bounds the first and leaves the second as it was.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

NEVER = 2**62  # a job without a process group never checks


def next_check(steps: int, every: int, check_every_s: float, step_s: Optional[float]) -> int:
    """The step of the next check after one made at `steps`: the first multiple of `every` after it
    that is also at least `check_every_s` of training away at `step_s` a step (None: not known)."""
    wanted = steps + 1
    if check_every_s > 0 and step_s is not None and step_s > 0:
        wanted = steps + max(1, math.ceil(check_every_s / step_s))
    return max(every, every * math.ceil(wanted / every))


def slowest_step_s(windows: Iterable[tuple[int, float]]) -> Optional[float]:
    """The longest mean step over the ranks' windows, each given as (steps, wall seconds); None if none has steps."""
    means = [wall / steps for steps, wall in windows if steps > 0 and wall > 0]
    return max(means) if means else None
