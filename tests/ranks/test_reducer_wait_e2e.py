"""The gradient all-reduce's wait as DDP's own reducer times it agrees with a direct measurement.

tests/ranks/reducer_wait_loop.py: 2 ranks, rank 1 late to every step by 5 ms; rank 0 waits in the
all-reduce. The callback reads the reducer's running averages at its checks
(callback/reducer_wait.py); a comm hook times the same steps directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import free_port, run_script_ranks

pytestmark = pytest.mark.ranks
LOOP = Path(__file__).with_name("reducer_wait_loop.py")


@pytest.mark.slow
def test_the_reducers_wait_is_the_measured_wait_and_its_samples_follow_torchs_rule(tmp_path):
    """The reducer's wait read at the checks equals a comm hook's direct timing, its samples torch's rate.

    Default twin: tests/ranks/test_doctor_e2e.py::test_a_slower_rank_and_a_missing_set_epoch_are_each_named
    (the same reducer_wait reading, which every Doctor on a DDP model makes at its checks, there the
    wait its straggler verdict reads: rank 0 waits for the slower rank 1)."""
    port = free_port()
    report = tmp_path / "wait"
    results = run_script_ranks(LOOP, ["--json", str(report), "--late-ms", "5", "--steps", "400", "--every", "100"],
                               {0: port, 1: port}, timeout_s=90)
    assert [rc for rc, _ in results] == [0, 0], results
    r0, r1 = (json.loads(Path(f"{report}.r{r}").read_text()) for r in (0, 1))
    # The rate was tuned from a 2 ms step: one sample per 20 ms, every 10th iteration. The reducer
    # samples iterations 1-10 and then every 10th, and writes iteration i's record at the forward of
    # i+1: 18 records in steps 1-100 (1..10, 20..90), then 10 a window (100..190, ...).
    assert r0["rate"] == r1["rate"] == 10
    assert r0["samples"] == r1["samples"] == [18, 10, 10, 10]
    for reducer, hook in zip(r0["reducer"], r0["hook"]):
        # The waiting rank: the same wait either way, within a millisecond or a quarter.
        assert abs(reducer - hook) <= max(1.5, 0.25 * hook), (r0["reducer"], r0["hook"])
        assert reducer >= 4.0  # at least most of the 5 ms its peer was late
    # The late rank waits for nobody; its peer waits the 5 ms for it.
    assert all(late < waiting - 2.5 for late, waiting in zip(r1["reducer"], r0["reducer"])), (r1, r0)
