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
from typing import Any, Mapping

from ddpdoctor.core.findings import Finding
from ddpdoctor.runtime.scaling_run import DEFAULT_KNOB, measure

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.scaling.judge import NAME, diagnose_scaling
from ddpdoctor.probes.scaling.render import render_table


class Scaling:
    name = NAME
    trains = True
    summary = "Train on 1, 2, 4, ... ranks: speedup, efficiency, where the time goes, DDP settings measured (not default)."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: Any) -> dict[str, Any]:
        facts = {"rank": ctx.rank, "host": ctx.env.hostname, "device": str(ctx.device), "backend": ctx.backend,
                 "model": ctx.cfg.model.model or "built-in MLP", "cpus_usable": len(os.sched_getaffinity(0))
                 if hasattr(os, "sched_getaffinity") else os.cpu_count()}
        return measure(ctx, facts)

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
        return diagnose_scaling(facts, run, DEFAULT_KNOB) if facts else []

    def render_details(self, facts: Mapping[Any, Mapping[str, Any]], console: Any) -> None:
        render_table(facts, console)
