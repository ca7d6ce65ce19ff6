"""ddp-smoke's diagnosis on recorded facts: what DdpSmoke.collect publishes, written by hand."""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import asdict
from typing import Any

import pytest

from ddpdoctor.core.findings import Severity
from ddpdoctor.probes import RunView, get_probe
from ddpdoctor.runtime.workload import StepTiming, WorkloadResult

SHA = hashlib.sha256(b"replica weights after 7 steps").hexdigest()
OTHER_SHA = hashlib.sha256(b"weights that drifted by 1e-3").hexdigest()

# The CPU model: Linear(256, 512), ReLU, Linear(512, 512), ReLU, Linear(512, 10).
PARAMS = 256 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
STEPS, WARMUP, BUCKETS = 5, 2, 2


def facts_for(rank: int, **overrides: Any) -> dict[str, Any]:
    """One rank's facts, shaped exactly as DdpSmoke.collect shapes a WorkloadResult."""
    steps = [StepTiming(data_ms=0.21 + 0.01 * i, forward_ms=1.9 + 0.1 * rank, backward_ms=4.6 + 0.05 * i,
                        comm_ms=2.4 + 0.1 * i, optimizer_ms=0.8, step_ms=7.6 + 0.2 * i + 0.1 * rank)
             for i in range(STEPS)]
    result = WorkloadResult(device="cpu", backend="gloo", parameters=PARAMS, gradient_bytes=PARAMS * 4,
                            batch_size=32, steps=steps, warmup_steps=WARMUP,
                            comm_calls=(STEPS + WARMUP) * BUCKETS, comm_bytes=(STEPS + WARMUP) * PARAMS * 4,
                            param_sha256=SHA, param_sum=-12.346817779541016, peak_mem_bytes=412_000_000,
                            loss_first=2.3412, loss_last=2.2871)
    facts = asdict(result)
    facts["steps"] = [asdict(s) for s in result.steps]
    facts.update(overrides)
    return facts


def run_view(world: int) -> RunView:
    return RunView(world_size=world, hosts={r: f"node-{r // 2}" for r in range(world)})


def diagnose(facts: dict[int, dict[str, Any]], world: int):
    return get_probe("ddp-smoke").diagnose(facts, run_view(world))


def codes(findings) -> list[str]:
    return [f.code for f in findings]


def test_facts_fixture_has_the_keys_collect_publishes():
    assert set(facts_for(0)) == set(WorkloadResult.__dataclass_fields__)
    assert set(facts_for(0)["steps"][0]) == set(StepTiming.__dataclass_fields__)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_identical_weights_give_one_ok_finding_with_evidence(world):
    facts = {r: facts_for(r) for r in range(world)}
    findings = diagnose(facts, world)
    assert codes(findings) == ["DDP001"]
    ok = findings[0]
    assert ok.severity == Severity.OK
    assert ok.probe == "ddp-smoke"
    assert ok.ranks == tuple(range(world))
    assert ok.nodes == tuple(sorted({f"node-{r // 2}" for r in range(world)}))
    assert f"DDP trained {STEPS} steps on {world} ranks" in ok.title
    ev = ok.evidence
    assert ev["backend"] == "gloo" and ev["device"] == ["cpu"]
    assert ev["parameters"] == PARAMS and ev["gradient_bytes"] == PARAMS * 4
    assert ev["weights_sha256"] == SHA[:16]
    assert ev["median_step_ms_by_rank"] == {
        r: round(statistics.median(s["step_ms"] for s in facts[r]["steps"]), 3) for r in range(world)}
    assert ev["median_step_ms_by_rank"][1] > ev["median_step_ms_by_rank"][0]
    assert ev["median_allreduce_ms"] == pytest.approx(2.6)
    assert ev["median_backward_ms"] == pytest.approx(4.7)


def test_one_rank_with_different_weights_is_named_alone():
    facts = {r: facts_for(r) for r in range(4)}
    facts[2] = facts_for(2, param_sha256=OTHER_SHA, param_sum=-12.1)
    findings = diagnose(facts, 4)
    assert codes(findings) == ["DDP002"]
    diverged = findings[0]
    assert diverged.severity == Severity.CRITICAL
    assert diverged.ranks == (2,)
    assert diverged.nodes == ("node-1",)
    assert "rank 2 disagree" in diverged.title
    assert diverged.evidence["weight_groups"] == {SHA[:12]: "0-1,3", OTHER_SHA[:12]: "2"}
    assert diverged.evidence["max_abs_sum_diff"] == pytest.approx(0.246817779541016)
    for majority_rank in (0, 1, 3):
        assert majority_rank not in diverged.ranks


def test_minority_of_two_is_named_and_majority_is_not():
    facts = {r: facts_for(r) for r in range(5)}
    for r in (1, 4):
        facts[r] = facts_for(r, param_sha256=OTHER_SHA)
    diverged, = diagnose(facts, 5)
    assert diverged.code == "DDP002" and diverged.ranks == (1, 4)
    assert "rank 1,4 disagree" in diverged.title


def test_two_way_split_does_not_blame_an_arbitrary_rank():
    facts = {0: facts_for(0, param_sha256=OTHER_SHA), 1: facts_for(1)}  # rank 0 is the one that drifted
    diverged, = diagnose(facts, 2)
    assert diverged.code == "DDP002"
    assert diverged.ranks != (1,)  # nothing in the facts says rank 1 is the odd one out


def test_no_gradient_communication_is_ddp003():
    facts = {r: facts_for(r) for r in range(3)}
    facts[1] = facts_for(1, comm_calls=0, comm_bytes=0)
    findings = diagnose(facts, 3)
    assert codes(findings) == ["DDP003"]
    no_comm = findings[0]
    assert no_comm.severity == Severity.CRITICAL and no_comm.ranks == (1,)
    assert no_comm.evidence["comm_calls"] == {0: 14, 1: 0, 2: 14}


def test_no_communication_anywhere_names_every_rank():
    facts = {r: facts_for(r, comm_calls=0) for r in range(2)}
    no_comm, = diagnose(facts, 2)
    assert no_comm.code == "DDP003" and no_comm.ranks == (0, 1)
    assert "rank 0-1" in no_comm.title


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_is_ddp004(loss):
    facts = {r: facts_for(r) for r in range(2)}
    facts[1] = facts_for(1, loss_last=loss)
    findings = diagnose(facts, 2)
    assert codes(findings) == ["DDP004"]
    bad = findings[0]
    assert bad.severity == Severity.CRITICAL and bad.ranks == (1,)
    value = bad.evidence["loss_last"][1]
    assert math.isnan(value) if math.isnan(loss) else value == loss
    assert 0 not in bad.evidence["loss_last"]


def test_missing_rank_is_ddp005_and_no_ok_finding():
    facts = {r: facts_for(r) for r in (0, 1, 3)}
    findings = diagnose(facts, 4)
    assert codes(findings) == ["DDP005"]
    missing = findings[0]
    assert missing.severity == Severity.CRITICAL
    assert missing.ranks == (2,) and missing.nodes == ("node-1",)
    assert missing.evidence == {"completed_ranks": [0, 1, 3], "missing_ranks": [2]}
    assert "rank 2" in missing.title


def test_no_rank_delivered_is_ddp005_for_all():
    findings = diagnose({}, 3)
    assert codes(findings) == ["DDP005"]
    assert findings[0].ranks == (0, 1, 2)
    assert "rank 0-2" in findings[0].title


def test_several_problems_are_all_reported_and_no_ok():
    facts = {0: facts_for(0), 1: facts_for(1, comm_calls=0, param_sha256=OTHER_SHA), 2: facts_for(2)}
    findings = diagnose(facts, 4)
    assert codes(findings) == ["DDP005", "DDP003", "DDP002"]
    assert [f.ranks for f in findings] == [(3,), (1,), (1,)]
