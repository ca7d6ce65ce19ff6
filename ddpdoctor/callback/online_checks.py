"""Judging what the training callback gathered from every rank: pure, tested without processes.

Every `every` steps each rank contributes one row (`RankWindow`): its last steps' timings,
a fingerprint of its current batch, its loader length, whether it saw a new epoch without
`set_epoch`, its peak memory. Straggler scores are the `stragglers` probe's own, computed on
the same columns, so a job's verdict and a pre-flight check's verdict agree.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity, rank_ranges

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
    # The CPU the training thread got over the window (measure/contention.py); None: not read.
    contention: Optional[dict[str, Any]] = None

    def to_facts(self, device: str = "") -> dict[str, Any]:
        """In the `stragglers` probe's shape: the in-step work is 'forward', data is apart.
        `device`: the job's device type ("cuda": the work is the GPU's, not the CPU's).

        Where the wait in collectives is not measured (FSDP, a job's own comm hook), the whole
        step may be waiting, so it counts as wait and only the data time is judged: a rank slow
        to load is still named, a rank slow to compute cannot be told from the ranks waiting for it."""
        wait = self.wait_ms if self.wait_measured else list(self.step_ms)
        forward = [max(0.0, s - w) for s, w in zip(self.step_ms, wait)]
        zeros = [0.0] * len(self.step_ms)
        return {"rank": self.rank, "host": self.host, "device": device, "samples": self.samples,
                "peak_mem_bytes": self.peak_mem_bytes, "contention": self.contention,
                "steps": {"data_ms": self.data_ms, "forward_ms": forward, "backward_ms": zeros,
                          "comm_wait_ms": wait, "optimizer_ms": zeros,
                          "step_ms": [s + d for s, d in zip(self.step_ms, self.data_ms)]}}


@dataclass
class History:
    """Rank 0's memory of the last few gathers: stragglers are judged over more than one window."""

    keep: int = 4
    windows: list[dict[int, RankWindow]] = field(default_factory=list)
    device: str = ""  # the job's device type, as the judges read it ("cuda", "cpu")

    def add(self, rows: dict[int, RankWindow]) -> None:
        self.windows = (self.windows + [rows])[-self.keep:]

    def facts(self) -> dict[int, dict[str, Any]]:
        merged: dict[int, dict[str, Any]] = {}
        for rows in self.windows:
            for r, row in rows.items():
                f = row.to_facts(self.device)
                if r not in merged:
                    merged[r] = f
                    continue
                m = merged[r]
                m["samples"] = m["samples"] + f["samples"]
                m["peak_mem_bytes"] = f["peak_mem_bytes"]
                m["contention"] = merge_contention(m["contention"], f["contention"])
                m["steps"] = {k: m["steps"][k] + f["steps"][k] for k in m["steps"]}
        return merged


# The run's kept windows hold at most this many step values over all ranks (steps x ranks), so that judging them
# at the end of a large job stays within a fifth of a second (benchmarks/end_of_run_cost.py: at 2^16, 256 ranks of
# 256 steps took 218-482 ms; at 2^15, 128 steps a rank, 8 windows of 16).
RUN_VALUES = 2**15
RUN_MAX_STEPS = 1024  # a rank's steps kept, at most (small jobs)
RUN_MIN_STEPS = 128  # and at least (the largest): ONLINE_MIN_STEPS twice
RUN_WINDOWS = 8  # windows the bound keeps at least: a window keeps every k-th step beyond max_steps / RUN_WINDOWS


@dataclass
class RunHistory(History):
    """The whole run's windows, for the end-of-run verdict: bounded by steps, not by the run's length.

    The windows kept are every `stride`-th check's (and the latest check's), and the stride doubles
    whenever they hold more than `max_steps` steps on a rank: what stays is spread evenly over the
    run, whatever its length, so the stragglers' scorer (which cuts its steps into windows and asks a
    rank to be slow in most) sees whether the same rank is behind early, midway and late. In a large
    job `max_steps` shrinks with the ranks (RUN_VALUES), and each window keeps every k-th of its steps
    so that RUN_WINDOWS of them still fit: a window's low quantile, which the scorer reads, is the
    same on a regular sample of its steps. `job_s`: per kept window, the job's time it stood for (the
    slowest rank's wall time since the check before), so the verdict knows how much of the job its
    evidence spans."""

    keep: int = 0  # unused: the bound is max_steps
    max_steps: int = 0  # 0: from the ranks of the first window (RUN_VALUES)
    job_s: list[float] = field(default_factory=list)
    stride: int = 1
    _index: list[int] = field(default_factory=list)  # each kept window's check number (1, 2, ...)
    _added: int = 0

    def add(self, rows: dict[int, RankWindow], job_s: float = 0.0) -> None:
        if not self.max_steps:
            self.max_steps = max(RUN_MIN_STEPS, min(RUN_MAX_STEPS, RUN_VALUES // max(1, len(rows))))
        per_window = max(1, self.max_steps // RUN_WINDOWS)
        rows = {r: _every_kth(w, per_window) for r, w in rows.items()}
        self._added += 1
        if self._index and self._index[-1] % self.stride:  # the latest window was only kept as the latest
            self.windows.pop(), self.job_s.pop(), self._index.pop()
        self.windows.append(rows)
        self.job_s.append(job_s)
        self._index.append(self._added)
        while len(self.windows) > 2 and self.steps(most=True) > self.max_steps:
            self.stride *= 2
            kept = [i for i, k in enumerate(self._index) if k % self.stride == 0 or i == len(self._index) - 1]
            self.windows = [self.windows[i] for i in kept]
            self.job_s = [self.job_s[i] for i in kept]
            self._index = [self._index[i] for i in kept]

    def steps(self, most: bool = False) -> int:
        """The fewest steps any rank has in the kept windows (`most`: the most)."""
        ranks = set().union(*self.windows) if self.windows else set()
        counts = [sum(len(w[r].step_ms) for w in self.windows if r in w) for r in ranks]
        return (max if most else min)(counts, default=0)


def _every_kth(w: RankWindow, most: int) -> RankWindow:
    """The window with every k-th step of its columns, so that it holds `most` steps at most."""
    k = -(-len(w.step_ms) // most)
    if k <= 1:
        return w
    return replace(w, step_ms=w.step_ms[::k], data_ms=w.data_ms[::k], wait_ms=w.wait_ms[::k], samples=w.samples[::k])


def merge_contention(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Two windows' readings as one: shares weighted by wall time. A co-runner's share too, counted 0
    in a window it was not seen in: a neighbour is judged by what it took over the whole span, not
    by its busiest window (a 60 ms window sees a duty-cycled process at 0 or 100%)."""
    if a is None or b is None:
        return a or b
    wa, wb = float(a.get("wall_s") or 0.0), float(b.get("wall_s") or 0.0)
    out = dict(b, wall_s=round(wa + wb, 3), corunners=_merge_corunners(a, wa, b, wb))
    for key, value in b.items():
        if key.endswith("_pct") or key == "nonvoluntary_per_s":
            if isinstance(value, (int, float)) and isinstance(a.get(key), (int, float)) and wa + wb > 0:
                out[key] = round((a[key] * wa + value * wb) / (wa + wb), 1)
    return out


def _merge_corunners(a: dict[str, Any], wa: float, b: dict[str, Any], wb: float) -> list[dict[str, Any]]:
    if wa + wb <= 0:
        return list(b.get("corunners") or a.get("corunners") or [])
    merged: dict[Any, dict[str, Any]] = {}
    for reading, wall in ((a, wa), (b, wb)):
        for c in reading.get("corunners") or []:
            entry = merged.setdefault(c.get("pid"), dict(c, cpu_pct=0.0))
            entry.update({k: v for k, v in c.items() if k != "cpu_pct"})
            entry["cpu_pct"] += float(c.get("cpu_pct") or 0.0) * wall
    out = [dict(c, cpu_pct=round(c["cpu_pct"] / (wa + wb), 1)) for c in merged.values()]
    return sorted(out, key=lambda c: -c["cpu_pct"])


def _nodes(rows: dict[int, RankWindow], ranks: Sequence[int]) -> tuple[str, ...]:
    return tuple(sorted({rows[r].host for r in ranks if r in rows}))


def data_findings(rows: dict[int, RankWindow]) -> list[Finding]:
    out: list[Finding] = []
    ranks = sorted(rows)
    prints = {r: rows[r].fingerprint for r in ranks if rows[r].fingerprint}
    if len(prints) >= 2 and len(set(prints.values())) == 1:
        out.append(codes.finding(
            "DOC001", PROBE,
            f"Every rank trained on the same batch at step {rows[ranks[0]].step}: the data is not sharded",
            ranks=tuple(ranks), nodes=_nodes(rows, ranks),
            evidence={"batch_fingerprint_by_rank": {r: f"{p:013x}" for r, p in prints.items()}}))
    lengths = {r: rows[r].loader_len for r in ranks if rows[r].loader_len >= 0}
    if len(set(lengths.values())) > 1:
        short = min(lengths.values())
        fewer = sorted(r for r, n in lengths.items() if n == short)
        out.append(codes.finding(
            "DOC002", PROBE,
            (f"Ranks have different numbers of batches per epoch ({short} on rank {rank_ranges(fewer)}, up to "
             f"{max(lengths.values())}): the job will hang at the end of the epoch"),
            ranks=tuple(fewer), nodes=_nodes(rows, fewer), evidence={"batches_per_epoch_by_rank": lengths}))
    stale = sorted(r for r in ranks if rows[r].stale_epoch)
    if stale:
        out.append(codes.finding(
            "DOC003", PROBE,
            f"DistributedSampler.set_epoch() is never called on rank {rank_ranges(stale)}: every epoch has the same order",
            ranks=tuple(stale), nodes=_nodes(rows, stale), evidence={"step": rows[stale[0]].step}))
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
            out.append(codes.finding(
                "DOC006", PROBE,
                f"Memory on rank {r} keeps growing: {peaks[0] / 2**30:.2f} to {peaks[-1] / 2**30:.2f} GiB "
                f"over the last {len(peaks)} checks",
                ranks=(r,), nodes=_nodes(history.windows[-1], [r]), evidence={"peak_mem_bytes_per_check": peaks}))
    return out


def setup_findings(is_ddp: bool, world_size: int, visible_gpus: int, rank: int, host: str,
                   sampler_name: Optional[str], data_parallel: bool = False,
                   unmeasured_wait: Optional[str] = None) -> list[Finding]:
    """What is wrong before the first step: judged from the objects the callback was given.

    A DataParallel model gets DOC009 once its GPUs were measured, not DOC005 here: it does
    use the GPUs, only badly."""
    out: list[Finding] = []
    if world_size > 1 and not is_ddp:
        out.append(codes.finding(
            "DOC004", PROBE,
            f"The model given to ddpdoctor is not wrapped in DistributedDataParallel ({world_size} ranks)",
            ranks=(rank,), nodes=(host,), evidence={"world_size": world_size}))
    if world_size == 1 and visible_gpus > 1 and not data_parallel:
        out.append(codes.finding(
            "DOC005", PROBE, f"World size 1 while {visible_gpus} GPUs are visible: one GPU works, the others idle",
            ranks=(rank,), nodes=(host,), evidence={"visible_gpus": visible_gpus},
            fix=f"Start it with torchrun --nproc_per_node={visible_gpus} (or srun with one task per GPU)."))
    if world_size > 1 and unmeasured_wait and rank == 0:  # the job's model, said once for every rank
        out.append(codes.finding(
            "DOC011", PROBE,
            (f"Stragglers are judged on data loading only: the wait in collectives is not measured for "
             f"{unmeasured_wait}"),
            # Every rank's node, which this rank does not know before the first gather: none named.
            ranks=tuple(range(world_size)), nodes=(), evidence={"model": unmeasured_wait}))
    if world_size > 1 and sampler_name is not None and "Distributed" not in sampler_name:
        out.append(codes.finding(
            "DOC008", PROBE,
            f"The DataLoader uses a {sampler_name}, not a DistributedSampler: each rank may see the whole dataset",
            ranks=(rank,), nodes=(host,), evidence={"sampler": sampler_name}))
    return out


@dataclass
class DataParallelGpu:
    """One GPU a DataParallel model ran on, as measured over the first steps."""

    index: int
    peak_mem_bytes: int
    util_pct: list[float]  # NVML samples, one per step end; empty where NVML is not available


def data_parallel_finding(gpus: Sequence[DataParallelGpu], steps: int, step_ms: Sequence[float], rank: int,
                          host: str) -> Finding:
    """DOC009: DataParallel, with what it measurably costs on this job's GPUs.

    DataParallel replicates the module from GPU 0 at every forward, scatters the batch from it
    and gathers the outputs (and so the loss) on it, all from one Python process: GPU 0 holds
    more memory and the others wait for it and for the GIL. The numbers make that visible."""
    evidence: dict[str, Any] = {"steps_measured": steps,
                                "median_step_ms": round(statistics.median(step_ms), 2) if step_ms else None,
                                "device_ids": [g.index for g in gpus]}
    if not gpus:
        title = ("The model is wrapped in torch.nn.DataParallel, which here has no GPU: it runs the module as is, in "
                 "one process")
        why = ("DataParallel is single-process multi-GPU; without GPUs it does nothing. On GPUs it replicates the model "
               "from GPU 0 at every step and gathers every output there, so GPU 0 carries more memory and the others "
               "wait on one Python thread. PyTorch recommends DistributedDataParallel even on a single machine.")
    else:
        first, others = gpus[0], list(gpus[1:])
        utils = {g.index: round(statistics.median(g.util_pct), 1) for g in gpus if g.util_pct}
        evidence["peak_mem_bytes_by_gpu"] = {g.index: g.peak_mem_bytes for g in gpus}
        if utils:
            evidence["median_util_pct_by_gpu"] = utils
        parts = [f"GPU {first.index} peaked at {first.peak_mem_bytes / 2**30:.2f} GiB"]
        if others:
            rest = statistics.median(g.peak_mem_bytes for g in others)
            evidence["gpu0_memory_ratio"] = round(first.peak_mem_bytes / rest, 2) if rest else None
            parts[0] += f" vs {rest / 2**30:.2f} GiB on the others (median)"
            if utils and first.index in utils and any(g.index in utils for g in others):
                rest_util = statistics.median(utils[g.index] for g in others if g.index in utils)
                parts.append(f"utilisation {utils[first.index]:.0f}% vs {rest_util:.0f}%")
        title = (f"The model is wrapped in torch.nn.DataParallel across {len(gpus)} GPUs: " + ", ".join(parts))
        why = ("DataParallel is one process driving every GPU: each step it copies the model from GPU 0 to the others, "
               "scatters the batch from GPU 0 and gathers all outputs back on it, under one Python thread. GPU 0 "
               "needs more memory than the others, and all of them wait for it; DDP runs one process per GPU and "
               "overlaps the gradient all-reduce with the backward pass.")
    # On one GPU (or none) DataParallel calls the module as is: nothing is lost yet, only the way
    # to more GPUs is the wrong one. Said as information; the cost is a warning only where measured.
    severity = Severity.WARN if len(gpus) > 1 else Severity.INFO
    return codes.finding(
        "DOC009", PROBE, title, severity=severity, ranks=(rank,), nodes=(host,), evidence=evidence, why=why)


def batch_scaling_finding(batch_by_rank: dict[int, float], learning_rates: Sequence[float],
                          nodes: Sequence[str]) -> Optional[Finding]:
    """DOC010 (info): the effective batch, and what the usual rules would make of the learning rate.

    It is information, not a verdict: whether the learning rate was tuned for one process's
    batch or for the effective one is the user's to know. Both rules scale from one process's
    batch to N of them: linear (Goyal et al., 2017, SGD with warm-up) and square root (Krizhevsky,
    2014; Hoffer et al., 2017; Malladi et al., 2022 for Adam)."""
    world = len(batch_by_rank)
    lrs = sorted({float(lr) for lr in learning_rates if isinstance(lr, (int, float)) and math.isfinite(lr)})
    if world < 2 or not lrs or any(b <= 0 for b in batch_by_rank.values()):
        return None
    batches = sorted(set(batch_by_rank.values()))
    effective = sum(batch_by_rank.values())
    per_rank = batches[0] if len(batches) == 1 else None
    lr = lrs[0] if len(lrs) == 1 else None
    scale = float(world)
    shown = ", ".join(f"{x:g}" for x in lrs)
    linear = [round(x * scale, 12) for x in lrs]
    root = [round(x * math.sqrt(scale), 12) for x in lrs]
    split = (f"{world} ranks x {per_rank:g}" if per_rank is not None
             else f"{world} ranks, {'/'.join(f'{b:g}' for b in batches)} per rank")
    title = (f"Effective batch {effective:g} ({split}) at learning rate{'s' if lr is None else ''} {shown}: tuned for "
             f"one process's batch, the linear rule gives {', '.join(f'{x:.4g}' for x in linear)} and the square-root "
             f"rule {', '.join(f'{x:.4g}' for x in root)}")
    return codes.finding(
        "DOC010", PROBE, title, ranks=tuple(sorted(batch_by_rank)), nodes=tuple(dict.fromkeys(nodes)),
        evidence={"world_size": world, "batch_per_rank": {r: b for r, b in sorted(batch_by_rank.items())},
                  "effective_batch": effective, "learning_rates": lrs, "linear_rule": linear, "sqrt_rule": root})
