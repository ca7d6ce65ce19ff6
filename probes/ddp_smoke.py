"""Probe `ddp-smoke`: did every rank initialise, construct DDP, step, and agree on the weights?

Identical weights after a few optimizer steps are the proof that gradients really
synchronise; a rank that trained on its own shows up as a different fingerprint.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any, Mapping

from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.runtime.workload import run_workload

from ddpdoctor.probes.base import RunView

NAME = "ddp-smoke"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class DdpSmoke:
    name = NAME
    trains = True
    summary = "Run a short real DDP training; check every rank steps and ends with identical weights."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: Any) -> dict[str, Any]:
        result = run_workload(ctx)
        facts = asdict(result)
        facts["steps"] = [asdict(s) if not isinstance(s, dict) else s for s in result.steps]
        return facts

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
        findings: list[Finding] = []
        present = sorted(facts)
        missing = [r for r in range(run.world_size) if r not in facts]
        if missing:
            findings.append(Finding(
                code="DDP005", severity=Severity.CRITICAL, probe=NAME,
                title=f"DDP training did not complete on rank {rank_ranges(missing)}",
                ranks=tuple(missing), nodes=run.nodes_of(missing),
                evidence={"completed_ranks": present, "missing_ranks": missing},
                why="These ranks delivered no result from the DDP workload; the run findings say what happened to them.",
                fix="Fix the crash, hang or error reported for these ranks first, then run the check again.",
            ))

        no_comm = [r for r in present if int(facts[r].get("comm_calls", 0)) == 0]
        if no_comm:
            findings.append(Finding(
                code="DDP003", severity=Severity.CRITICAL, probe=NAME,
                title=f"Gradients were never all-reduced on rank {rank_ranges(no_comm)}",
                ranks=tuple(no_comm), nodes=run.nodes_of(no_comm),
                evidence={"comm_calls": {r: facts[r].get("comm_calls", 0) for r in present}},
                why="DDP's gradient hook did not run, so these ranks trained on their local gradients only.",
                fix="Make sure the model is wrapped in DistributedDataParallel and backward() runs on the wrapped model's output.",
            ))

        not_finite = [r for r in present if not math.isfinite(float(facts[r].get("loss_last", 0.0)))]
        if not_finite:
            findings.append(Finding(
                code="DDP004", severity=Severity.CRITICAL, probe=NAME,
                title=f"Loss is not finite on rank {rank_ranges(not_finite)}",
                ranks=tuple(not_finite), nodes=run.nodes_of(not_finite),
                evidence={"loss_last": {r: facts[r].get("loss_last") for r in not_finite}},
                why="A NaN or infinite loss on a synthetic, well-conditioned problem means broken arithmetic on that device.",
                fix="Run the device's own diagnostics (e.g. `dcgmi diag -r 2`) and check for ECC errors on that GPU.",
            ))

        groups: dict[str, list[int]] = {}
        for r in present:
            groups.setdefault(str(facts[r].get("param_sha256", "")), []).append(r)
        if len(groups) > 1:
            sizes = sorted((len(g) for g in groups.values()), reverse=True)
            if sizes[0] > sizes[1]:
                majority = max(groups.values(), key=len)
                odd = sorted(r for g in groups.values() if g is not majority for r in g)
                who = f"rank {rank_ranges(odd)} disagree{'s' if len(odd) == 1 else ''} with the rest"
            else:  # no majority: nothing says which side is right
                odd = sorted(present)
                who = " vs ".join(f"rank {rank_ranges(g)}" for g in sorted(groups.values()))
            sums = {r: float(facts[r].get("param_sum", 0.0)) for r in present}
            ref = statistics.median(sums.values())
            findings.append(Finding(
                code="DDP002", severity=Severity.CRITICAL, probe=NAME,
                title=f"Weights differ across ranks after training: {who}",
                ranks=tuple(odd), nodes=run.nodes_of(odd),
                evidence={
                    "weight_groups": {sha[:12]: rank_ranges(rs) for sha, rs in groups.items()},
                    "param_sum": sums,
                    "max_abs_sum_diff": max(abs(v - ref) for v in sums.values()),
                },
                why=("DDP keeps replicas identical only if every rank applies the same averaged gradient to the same "
                     "starting weights; these ranks changed their weights outside DDP or skipped gradient synchronisation."),
                fix=("Look for code that touches parameters on some ranks only (rank-dependent init after wrapping, "
                     "loading a checkpoint on rank 0 after DDP construction, no_sync() left on) and keep it before "
                     "the DistributedDataParallel(...) call."),
            ))

        if not findings and present:
            steps = [s for r in present for s in facts[r].get("steps", [])]
            per_rank = {r: round(_median([s["step_ms"] for s in facts[r].get("steps", [])]), 3) for r in present}
            any_facts = facts[present[0]]
            findings.append(Finding(
                code="DDP001", severity=Severity.OK, probe=NAME,
                title=(f"DDP trained {len(any_facts.get('steps', []))} steps on {len(present)} ranks; "
                       "gradients synchronised and weights are identical"),
                ranks=tuple(present), nodes=run.nodes_of(present),
                evidence={
                    "backend": any_facts.get("backend"),
                    "device": sorted({str(facts[r].get("device")) for r in present}),
                    "parameters": any_facts.get("parameters"),
                    "gradient_bytes": any_facts.get("gradient_bytes"),
                    "median_step_ms_by_rank": per_rank,
                    "median_forward_ms": round(_median([s["forward_ms"] for s in steps]), 3),
                    "median_backward_ms": round(_median([s["backward_ms"] for s in steps]), 3),
                    "median_allreduce_ms": round(_median([s["comm_ms"] for s in steps]), 3),
                    "weights_sha256": str(any_facts.get("param_sha256", ""))[:16],
                },
            ))
        return findings
