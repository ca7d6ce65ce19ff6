"""The scaling verdict on hand-built facts: the arithmetic, the targets, and the named cause.

Each case sets the per-rank medians a real run records (ddpdoctor/runtime/scaling_run.py) so that
one cause dominates, and checks the judge names that cause and no other.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpdoctor.core.findings import Severity
from ddpdoctor.probes import RunView
from ddpdoctor.probes.scaling.judge import diagnose_scaling, evaluate, target_pct

DEFAULT = "defaults (bucket_cap_mb=25)"


def row(step: float, data: float = 0.5, forward: float = 1.5, backward: float = 3.0, alone_f: float = 1.5,
        alone_b: float = 3.0, optimizer: float = 0.5) -> dict[str, float]:
    return {"step_ms": step, "data_ms": data, "forward_ms": forward, "backward_ms": backward,
            "forward_alone_ms": alone_f, "backward_alone_ms": alone_b, "optimizer_ms": optimizer}


def facts(sizes: dict[int, dict[int, dict[str, float]]], batch: int = 32,
          knobs: dict[int, dict[str, float]] | None = None) -> dict[int, dict[str, Any]]:
    ranks = sorted({r for per in sizes.values() for r in per})
    return {r: {"rank": r, "host": "h", "batch_size": batch,
                "sizes": {str(n): per[r] for n, per in sizes.items() if r in per},
                "knobs": {k: {"ms_per_batch": v} for k, v in (knobs or {}).get(r, {}).items()}} for r in ranks}


ONE = {0: row(5.5, backward=3.0)}


def judge(f: dict[int, dict[str, Any]], **settings: Any) -> list[Any]:
    return diagnose_scaling(f, RunView(world_size=len(f), hosts={r: "h" for r in f}, settings=settings), DEFAULT)


def test_targets_follow_the_common_rule_and_fall_linearly_in_log2() -> None:
    assert [target_pct(n) for n in (2, 4, 8, 16)] == [95.0, 87.5, 80.0, 80.0]
    assert target_pct(4, ((2, 90.0), (16, 60.0))) == 80.0


def test_speedup_and_efficiency_are_samples_per_second_ratios() -> None:
    results = evaluate(facts({1: ONE, 2: {0: row(5.5), 1: row(5.0)}}))
    assert [r.n for r in results] == [1, 2]
    assert results[0].samples_per_s == pytest.approx(32 / 0.0055)
    assert results[1].speedup == pytest.approx(2.0) and results[1].efficiency_pct == pytest.approx(100.0)


def test_perfect_scaling_is_ok_and_gives_the_batch_information() -> None:
    found = {f.code: f for f in judge(facts({1: ONE, 2: {0: row(5.6), 1: row(5.6)}}), lr=0.1)}
    assert found["SCL000"].severity == Severity.OK and "98%" in found["SCL000"].title
    assert found["SCL003"].evidence["effective_batch"] == 64 and found["SCL003"].evidence["linear_rule_lr"] == 0.2
    assert found["SCL003"].evidence["square_root_rule_lr"] == pytest.approx(0.141421, abs=1e-6)


def test_exposed_communication_is_the_cause_when_backward_waits_for_the_all_reduce() -> None:
    # Both ranks compute as fast as one alone, but backward takes 3 ms more than without the all-reduce.
    two = {0: row(8.5, backward=6.0), 1: row(8.5, backward=6.0)}
    [f] = [f for f in judge(facts({1: ONE, 2: two})) if f.code == "SCL001"]
    assert f.severity == Severity.WARN and "communication" in f.title and f.ranks == (0, 1)
    assert f.evidence["at_worst_size"]["loss_ms"]["comm"] == pytest.approx(3.0)
    assert f.evidence["sizes"][1].startswith("2 ranks: ") and "comm 3.0" in f.evidence["sizes"][1]
    assert "bucket_cap_mb" in f.fix


def test_a_straggler_is_named_and_the_others_wait_is_not_counted_as_communication() -> None:
    # Rank 2 computes 3x slower; ranks 0, 1, 3 wait for it inside backward.
    fast = row(14.0, backward=11.5)
    slow = row(14.0, forward=4.5, backward=9.0, alone_f=4.5, alone_b=9.0)
    f4 = facts({1: ONE, 2: {0: row(5.6), 1: row(5.6)}, 4: {0: fast, 1: fast, 2: slow, 3: fast}})
    [f] = [f for f in judge(f4) if f.code == "SCL001"]
    assert f.ranks == (2,) and "rank 2 is a straggler" in f.title
    loss = f.evidence["at_worst_size"]["loss_ms"]
    assert loss["straggler"] == pytest.approx(9.0) and loss["comm"] == pytest.approx(0.0)


def test_a_rank_waiting_for_data_is_named() -> None:
    two = {0: row(10.5), 1: row(10.5, data=5.5)}
    [f] = [f for f in judge(facts({1: ONE, 2: two})) if f.code == "SCL001"]
    assert f.ranks == (1,) and "waits for its data" in f.title and "num_workers" in f.fix


def test_slower_computation_on_every_rank_is_contention_not_a_straggler() -> None:
    both = row(9.5, forward=3.0, backward=5.5, alone_f=3.0, alone_b=5.5)
    [f] = [f for f in judge(facts({1: ONE, 2: {0: both, 1: both}})) if f.code == "SCL001"]
    assert "slower computation on every rank" in f.title and "OMP_NUM_THREADS" in f.fix


def test_user_targets_are_honoured() -> None:
    two = {0: row(6.5, backward=4.0), 1: row(6.5, backward=4.0)}  # 85%
    assert any(f.code == "SCL001" for f in judge(facts({1: ONE, 2: two})))
    assert any(f.code == "SCL000" for f in judge(facts({1: ONE, 2: two}), efficiency_targets=[[2, 80.0]]))


def test_ddp_settings_are_compared_per_batch_on_the_slowest_rank() -> None:
    knobs = {0: {DEFAULT: 10.0, "bucket_cap_mb=1": 8.0, "no_sync accumulation x4": 9.9},
             1: {DEFAULT: 10.2, "bucket_cap_mb=1": 9.0, "no_sync accumulation x4": 9.95}}
    [f] = [f for f in judge(facts({1: ONE, 2: {0: row(5.6), 1: row(5.6)}}, knobs=knobs)) if f.code == "SCL002"]
    assert f.title.startswith("DDP setting measured: bucket_cap_mb=1") and f.evidence["faster_than_defaults_pct"][
        "bucket_cap_mb=1"] == pytest.approx(11.8)


def test_a_size_with_a_missing_rank_is_not_judged_and_the_rank_is_named() -> None:
    f = facts({1: ONE, 2: {0: row(5.6), 1: row(5.6)}})
    del f[1]
    found = diagnose_scaling(f, RunView(world_size=2), DEFAULT)
    assert [x.code for x in found] == ["SCL003", "SCL004"] and found[1].ranks == (1,)


def test_more_cpu_ranks_than_cores_are_not_judged_but_said() -> None:
    f = facts({1: ONE, 2: {0: row(5.7), 1: row(5.7)}, 4: {r: row(25.0, backward=21.0) for r in range(4)}})
    for rank in f:
        f[rank].update(device="cpu", cpus_usable=2)
    found = {x.code: x for x in judge(f)}
    assert found["SCL005"].severity == Severity.INFO and "4 ranks share 2 CPUs on h" in found["SCL005"].title
    assert "SCL001" not in found and found["SCL000"].title.startswith("Scaling efficiency 96% at 2 ranks")


def test_a_straggler_that_is_not_the_main_cause_is_still_named_in_the_title() -> None:
    fast = row(12.0, backward=8.5)
    slow = row(12.0, forward=2.5, backward=7.5, alone_f=2.5, alone_b=4.0)  # 2 ms slower, comm 3.5 ms
    [f] = [x for x in judge(facts({1: ONE, 2: {0: fast, 1: slow}})) if x.code == "SCL001"]
    assert "communication" in f.title and "also rank 1 computes 2.0 ms slower" in f.title


def test_a_small_largest_part_is_no_single_cause() -> None:
    # 10 ms lost a step, of which comm 1.0, straggler 0.5: most of it is "other".
    two = {0: row(15.5, backward=4.0), 1: row(15.5, backward=4.0)}
    [f] = [x for x in judge(facts({1: ONE, 2: two})) if x.code == "SCL001"]
    assert "no single cause" in f.title and f.evidence["at_worst_size"]["cause"] is None


def test_sizes_always_start_at_one_and_never_exceed_the_ranks() -> None:
    from ddpdoctor.runtime.scaling_run import sizes_for

    assert sizes_for((), 6) == [1, 2, 4, 6] and sizes_for((2, 4), 4) == [1, 2, 4]
    assert sizes_for((8, 16), 4) == [1] and sizes_for((3,), 3) == [1, 3]
