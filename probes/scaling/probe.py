"""Probe `scaling` (the `ddpdoctor scaling` command): measured weak-scaling efficiency.

Collect: `scaling_run.measure` trains the same per-rank batch on the first 1, 2, 4, ...
ranks in turn (the built-in model or the user's `--model`), each step split into data,
forward, backward and optimizer, with `no_sync()` steps for backward without the
all-reduce, then tries DDP settings at the largest size.
Gather: each rank's medians go to the store as its facts.
Diagnose: `scaling_judge` (pure) computes speedup and efficiency per size, says where
each size loses time, and what the DDP settings did.
Not a default probe of `check`: it trains several seconds per size.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

from ddpdoctor.core.findings import Finding
from ddpdoctor.runtime.scaling_run import DEFAULT_KNOB, measure

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.scaling.facts import ScalingFacts
from ddpdoctor.probes.scaling.judge import NAME, diagnose_scaling
from ddpdoctor.probes.scaling.render import render_table

if TYPE_CHECKING:
    from rich.console import Console

    from ddpdoctor.runtime.context import RankContext


class Scaling:
    name = NAME
    facts_type = ScalingFacts
    trains = True
    summary = "Train on 1, 2, 4, ... ranks: speedup, efficiency, where the time goes, DDP settings measured (not default)."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: "RankContext") -> dict[str, object]:
        facts = ScalingFacts(rank=ctx.rank, host=ctx.env.hostname, device=str(ctx.device), backend=ctx.backend,
                             model=ctx.cfg.model.model or "built-in MLP", cpus_usable=_cpus_usable())
        measure(ctx, facts)
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, ScalingFacts], run: RunView) -> list[Finding]:
        return diagnose_scaling(facts, run, DEFAULT_KNOB) if facts else []

    def render_details(self, facts: Mapping[int, ScalingFacts], console: "Console") -> None:
        render_table(facts, console)


def _cpus_usable() -> Optional[int]:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
