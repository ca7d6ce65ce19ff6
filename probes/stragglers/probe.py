"""Probe `stragglers`: which rank holds the others back, and why.

Collect: a few seconds of real DDP steps with each step split into data, forward,
backward compute, gradient all-reduce wait and optimizer, the wall-clock arrival of each
rank at the all-reduce (corrected to rank 0's clock through the store), compute-only
steps with no collective, and the host and GPU state sampled meanwhile.
Gather: each rank's series goes to the store as its facts.
Diagnose: `straggler_scores` (pure) turns the series into scores and findings.
Not a default probe: its verdict needs seconds of steps, more than a pre-flight check's budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ddpdoctor.measure import clock_offset
from ddpdoctor.core.hello import peer_pids
from ddpdoctor.measure.contention import Window
from ddpdoctor.core.findings import Finding
from ddpdoctor.measure.sampler import RankSampler
from ddpdoctor.runtime.step_timing import gpu_uuid, run_steps

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.stragglers.facts import ClockFacts, SampledFacts, StragglersFacts
from ddpdoctor.probes.stragglers.render import render_table
from ddpdoctor.probes.stragglers.scores import NAME, diagnose_stragglers

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from ddpdoctor.runtime.context import RankContext


def _device_name(device: "torch.device") -> str:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    from ddpdoctor.measure.host import read_host

    return str(read_host().get("cpu_model") or "cpu")


class Stragglers:
    name = NAME
    facts_type = StragglersFacts
    trains = True
    summary = "Train for a few seconds; name the rank the others wait for, by how much, and why (not default)."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: "RankContext") -> dict[str, object]:
        hosts = {r: h.host or "?" for r, h in ctx.hellos.items()}
        with ctx.stage("straggler_clock"):
            if ctx.rank == 0:
                clock_offset.serve(ctx.channel.store, 0, hosts, ctx.cfg.timeout_s / 2)
                offset = clock_offset.ClockOffset(0.0, 0.0, "rank 0")
            else:
                offset = clock_offset.measure(ctx.channel.store, ctx.rank, hosts, ctx.cfg.timeout_s / 2)
        with RankSampler(gpu_uuid(ctx.device)) as sampler:
            window = Window(exclude=peer_pids(ctx.hellos, ctx.rank))
            series = run_steps(ctx)
            # Waiting in the all-reduce and for data is on purpose; the rest of the time the thread works.
            contention = window.take(wait_s=(sum(series.columns.comm_wait_ms) + sum(series.columns.data_ms)) / 1e3)
            window.close()
        corrected = [round(a - offset.offset_s, 6) for a in series.arrival_s]
        return StragglersFacts(
            rank=ctx.rank, host=ctx.env.hostname, device=str(ctx.device), backend=ctx.backend,
            device_name=_device_name(ctx.device), torch_threads=_threads(),
            batch_size=series.batch_size, parameters=series.parameters, comm_calls=series.comm_calls,
            steps=series.columns, samples=series.samples, arrival_s=corrected,
            clock=ClockFacts.from_json(offset.to_json()), solo_ms=series.solo_ms, peak_mem_bytes=series.peak_mem_bytes,
            injected_ms=series.injected_ms, sampled=SampledFacts.from_json(sampler.facts()),
            contention=contention,
        ).to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, StragglersFacts], run: RunView) -> list[Finding]:
        return diagnose_stragglers(facts, run)

    def render_details(self, facts: Mapping[int, StragglersFacts], console: "Console") -> None:
        render_table(facts, console)


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())
