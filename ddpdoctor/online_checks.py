"""Judging what the training callback gathered from every rank: pure, tested without processes.

Every `every` steps each rank contributes one row (`RankWindow`): its last steps' timings,
a fingerprint of its current batch, its loader length, whether it saw a new epoch without
`set_epoch`, its peak memory. Straggler scores are the `stragglers` probe's own, computed on
the same columns, so a job's verdict and a pre-flight check's verdict agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ddpdoctor.findings import Finding, Severity, rank_ranges

PROBE = "callback"
MEMORY_GROWTH_SHARE = 0.10  # peak memory that rose this much over the kept windows, steadily
MEMORY_GROWTH_BYTES = 256 * 2**20


@dataclass
class RankWindow:
    rank: int
    host: str
    step: int  # steps done on this rank when the row was made
    step_ms: list[float]  # per step: begin to end
    data_ms: list[float]  # per step: end of the previous step to begin (the loader)
    wait_ms: list[float]  # per step: the gradient all-reduce wait (0 when not measured)
    samples: list[float]
    fingerprint: int  # of the batch of the last step; 0: none given
    loader_len: int  # -1: unknown
    stale_epoch: bool  # a second pass over the loader began with the sampler's epoch unchanged
    peak_mem_bytes: int
    wait_measured: bool = True

    def to_facts(self) -> dict[str, Any]:
        """In the `stragglers` probe's shape: the in-step work is 'forward', data is apart."""
        forward = [max(0.0, s - w) for s, w in zip(self.step_ms, self.wait_ms)]
        zeros = [0.0] * len(self.step_ms)
        return {"rank": self.rank, "host": self.host, "device": "", "samples": self.samples,
                "peak_mem_bytes": self.peak_mem_bytes,
                "steps": {"data_ms": self.data_ms, "forward_ms": forward, "backward_ms": zeros,
                          "comm_wait_ms": self.wait_ms, "optimizer_ms": zeros,
                          "step_ms": [s + d for s, d in zip(self.step_ms, self.data_ms)]}}


@dataclass
class History:
    """Rank 0's memory of the last few gathers: stragglers are judged over more than one window."""

    keep: int = 4
    windows: list[dict[int, RankWindow]] = field(default_factory=list)

    def add(self, rows: dict[int, RankWindow]) -> None:
        self.windows = (self.windows + [rows])[-self.keep:]

    def facts(self) -> dict[int, dict[str, Any]]:
        merged: dict[int, dict[str, Any]] = {}
        for rows in self.windows:
            for r, row in rows.items():
                f = row.to_facts()
                if r not in merged:
                    merged[r] = f
                    continue
                m = merged[r]
                m["samples"] = m["samples"] + f["samples"]
                m["peak_mem_bytes"] = f["peak_mem_bytes"]
                m["steps"] = {k: m["steps"][k] + f["steps"][k] for k in m["steps"]}
        return merged


def _nodes(rows: dict[int, RankWindow], ranks: Sequence[int]) -> tuple[str, ...]:
    return tuple(sorted({rows[r].host for r in ranks if r in rows}))


def data_findings(rows: dict[int, RankWindow]) -> list[Finding]:
    out: list[Finding] = []
    ranks = sorted(rows)
    prints = {r: rows[r].fingerprint for r in ranks if rows[r].fingerprint}
    if len(prints) >= 2 and len(set(prints.values())) == 1:
        out.append(Finding(
            code="DOC001", severity=Severity.CRITICAL, probe=PROBE,
            title=f"Every rank trained on the same batch at step {rows[ranks[0]].step}: the data is not sharded",
            ranks=tuple(ranks), nodes=_nodes(rows, ranks),
            evidence={"batch_fingerprint_by_rank": {r: f"{p:013x}" for r, p in prints.items()}},
            why=("Without a DistributedSampler each rank iterates the whole dataset in the same order, so N ranks do "
                 "the work of one: the same gradients N times, N times the compute for nothing."),
            fix=("Give the DataLoader sampler=DistributedSampler(dataset) (shuffle=False on the DataLoader) and call "
                 "sampler.set_epoch(epoch) at the start of every epoch."),
        ))
    lengths = {r: rows[r].loader_len for r in ranks if rows[r].loader_len >= 0}
    if len(set(lengths.values())) > 1:
        short = min(lengths.values())
        fewer = sorted(r for r, n in lengths.items() if n == short)
        out.append(Finding(
            code="DOC002", severity=Severity.CRITICAL, probe=PROBE,
            title=(f"Ranks have different numbers of batches per epoch ({short} on rank {rank_ranges(fewer)}, up to "
                   f"{max(lengths.values())}): the job will hang at the end of the epoch"),
            ranks=tuple(fewer), nodes=_nodes(rows, fewer), evidence={"batches_per_epoch_by_rank": lengths},
            why=("The ranks with fewer batches leave the loop while the others enter another step's gradient "
                 "all-reduce, which then waits forever (or until the NCCL watchdog's timeout)."),
            fix=("Shard with DistributedSampler (it pads every rank to the same count) and drop_last=True. "
                 "(model.join() for uneven inputs does not cover the ddpdoctor callback's own gather: balance the data.)"),
        ))
    stale = sorted(r for r in ranks if rows[r].stale_epoch)
    if stale:
        out.append(Finding(
            code="DOC003", severity=Severity.WARN, probe=PROBE,
            title=f"DistributedSampler.set_epoch() is never called on rank {rank_ranges(stale)}: every epoch has the same order",
            ranks=tuple(stale), nodes=_nodes(rows, stale), evidence={"step": rows[stale[0]].step},
            why=("DistributedSampler shuffles with seed + epoch; without set_epoch the epoch stays 0 and every epoch "
                 "repeats the first one's order, which hurts convergence."),
            fix="Call loader.sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader.",
        ))
    return out


def memory_growth(history: History) -> list[Finding]:
    out: list[Finding] = []
    if len(history.windows) < 3:
        return out
    ranks = sorted(set.intersection(*(set(w) for w in history.windows)))
    for r in ranks:
        peaks = [w[r].peak_mem_bytes for w in history.windows]
        rises = all(b > a for a, b in zip(peaks, peaks[1:]))
        grown = peaks[-1] - peaks[0]
        if rises and peaks[0] and grown > max(MEMORY_GROWTH_SHARE * peaks[0], MEMORY_GROWTH_BYTES):
            out.append(Finding(
                code="DOC006", severity=Severity.WARN, probe=PROBE,
                title=f"Memory on rank {r} keeps growing: {peaks[0] / 2**30:.2f} to {peaks[-1] / 2**30:.2f} GiB "
                      f"over the last {len(peaks)} checks",
                ranks=(r,), nodes=_nodes(history.windows[-1], [r]),
                evidence={"peak_mem_bytes_per_check": peaks},
                why="Steadily growing memory is usually a tensor kept across steps (a loss history kept with its graph).",
                fix="Store loss.item() (or detach()) instead of the loss tensor; look for lists that grow every step.",
            ))
    return out


def setup_findings(is_ddp: bool, world_size: int, visible_gpus: int, rank: int, host: str,
                   sampler_name: Optional[str]) -> list[Finding]:
    """What is wrong before the first step: judged from the objects the callback was given."""
    out: list[Finding] = []
    if world_size > 1 and not is_ddp:
        out.append(Finding(
            code="DOC004", severity=Severity.CRITICAL, probe=PROBE,
            title=f"The model given to ddpdoctor is not wrapped in DistributedDataParallel ({world_size} ranks)",
            ranks=(rank,), nodes=(host,), evidence={"world_size": world_size},
            why="Without DDP, gradients are never averaged: each rank trains its own model.",
            fix="model = DistributedDataParallel(model, device_ids=[local_rank]) after init_process_group and .to(device).",
        ))
    if world_size == 1 and visible_gpus > 1:
        out.append(Finding(
            code="DOC005", severity=Severity.WARN, probe=PROBE,
            title=f"World size 1 while {visible_gpus} GPUs are visible: one GPU works, the others idle",
            ranks=(rank,), nodes=(host,), evidence={"visible_gpus": visible_gpus},
            why="The job was started as one process; DDP needs one process per GPU.",
            fix=f"Start it with torchrun --nproc_per_node={visible_gpus} (or srun with one task per GPU).",
        ))
    if world_size > 1 and sampler_name is not None and "Distributed" not in sampler_name:
        out.append(Finding(
            code="DOC008", severity=Severity.INFO, probe=PROBE,
            title=f"The DataLoader uses a {sampler_name}, not a DistributedSampler: each rank may see the whole dataset",
            ranks=(rank,), nodes=(host,), evidence={"sampler": sampler_name},
            why=("Each rank iterates the whole dataset unless the sampler shards it; DOC001 says so for sure when the "
                 "ranks' batches turn out identical."),
            fix="sampler=DistributedSampler(dataset), and sampler.set_epoch(epoch) every epoch.",
        ))
    return out
