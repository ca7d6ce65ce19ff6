"""The live check that every rank trains the same model: at the callback's checks, within its budget.

At a check that is due (callback/doctor.py decides, from the gathered table, so every rank
agrees), each rank sums the bits of every tensor its optimizer steps (measure/replica_digest.py)
and the ranks all-reduce those sums with MAX, beside their negatives: where the maximum equals
the minimum everywhere, every rank holds the same weights and the same optimizer settings. That
costs one read of the weights and one all-reduce of a few thousand numbers, whatever the number
of ranks. Only when something differs do the ranks gather the details (each rank's sums, its
gradients' sums, both norms): which tensors, which ranks, how far apart, and the cause
(judge/replicas.py, shared with ddp-smoke).

On a GPU the sums are computed on the device and the all-reduce's result is read at the next
check (as the timing gather is: callback/gather.py), so the check never waits for the GPU.

A check is due when the last one cost at most FREE_MS, or BUDGET of the training time since: on a
small model that is every check, on 100M parameters on a CPU (35 ms a read) one check in 7 s.

Where a step is long beside a read of the weights (one replica fingerprint, measured at each
comparison, at most BUDGET of the slowest rank's step: 70 us for a 4-tensor model on one CPU core of
the VM, against steps of 14 ms and more; about 15 us a tensor), each rank also keeps one fingerprint
per step in a ring of RING steps, and a difference's details carry the rings: the first step whose
fingerprints differ dates the divergence to the step, not only to the two checks around it.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ddpdoctor.callback.gather import all_gathered, to_host_late
from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding
from ddpdoctor.judge import replicas as judge
from ddpdoctor.measure import replica_digest as rd

if TYPE_CHECKING:
    import torch

BUDGET = 0.005  # of the wall time between checks the comparison may take
# A fingerprint's cost is read at the first comparisons only (the least of them): three timed
# fingerprints at every check were 1 ms of a check's 12 on 2 CPU ranks (issue 36's 2 ms steps).
FINGERPRINT_READS = 3
FREE_MS = 5.0  # a comparison this cheap runs at every check (at the default 2 s between checks, 0.25%)
BYPASS_STEPS = 20  # steps after which a DDP whose reducer counted no iteration was never called
RING = 1024  # per-step fingerprints kept: two check windows of 2 s at 4 ms a step and more
# The end compares once more (callback/final_check.py) where its four reads of the weights (bit sums and norms of
# weights and gradients) cost at most this, from the last check's comparison: the end delays the job's exit.
END_MAX_MS = 1000.0
GPU_READ_BYTES_PER_MS = 1e9  # a GPU reads its weights at 1 TB/s or faster (H100: 3.35): a fingerprint's least cost


@dataclass
class _Pending:
    kind: str  # "reduce" | "gather"
    step: int
    host: Any  # pinned host tensor
    event: Any


class ReplicaWatch:
    """One rank's side of the comparison: its optimizer's tensors, named from the model."""

    def __init__(self, model: Any, optimizer: Any, world_size: int, device: torch.device, late: bool) -> None:
        from torch.nn.parallel import DistributedDataParallel

        inner = getattr(model, "_orig_mod", model)
        self.ddp = inner if isinstance(inner, DistributedDataParallel) else None
        self.optimizer = optimizer
        self.world_size = world_size
        self.device = device  # where the collectives run (the model's GPU under NCCL, else CPU)
        self.late = late
        self.layout = rd.layout(optimizer, inner, rd.averaged_by(self.ddp) if self.ddp is not None else None)
        self.digest_ms = 0.0  # this rank's last comparison, in ms of its own time
        self.fingerprint_ms = 0.0  # one per-step fingerprint's cost on this rank, as the plan takes it
        self._fingerprint_best = float("inf")  # the least of its first FINGERPRINT_READS readings
        self._fingerprint_reads = 0
        self.per_step = False  # a fingerprint is kept at every step (record), decided at the checks from the table
        self.failed = False  # a comparison raised on this rank (its row tells its peers: they stop too)
        self.recorded_from: Optional[int] = None  # the first step of the unbroken per-step record
        self._ring: Optional[torch.Tensor] = None
        self.since_s = 0.0  # training time since the last comparison (from the gathered table: all ranks alike)
        self.last_equal_step: Optional[int] = None
        self.first_seen_step: Optional[int] = None
        self._pending: Optional[_Pending] = None
        # Nothing to compare (no optimizer, one rank, or not DDP: FSDP's and DeepSpeed's ranks hold different
        # shards by design), or, later, a divergence already named.
        self.done = optimizer is None or world_size < 2 or self.ddp is None

    # -- at construction -------------------------------------------------------
    def setup_findings(self, rank: int, host: str) -> list[Finding]:
        """DOC012 (tensors the optimizer steps that DDP does not average) and DOC016 (BatchNorm with
        broadcast_buffers=False), from the objects alone, before the first step: said by rank 0 for every rank."""
        if rank != 0 or self.world_size < 2 or self.ddp is None:
            return []
        out = []
        outside = [e for e in self.layout.entries if not e.averaged]
        if outside and self.optimizer is not None:
            names = [n for e in outside for n in e.names]
            shown = ", ".join(names[:judge.SHOWN]) + (f" and {len(names) - judge.SHOWN} more" if len(names) > judge.SHOWN
                                                       else "")
            out.append(codes.finding(
                "DOC012", judge.PROBE,
                (f"The optimizer steps {len(names)} tensor{'s' if len(names) != 1 else ''} whose gradient DDP does not "
                 f"average ({shown}): each rank will train its own copy"),
                ranks=tuple(range(self.world_size)), nodes=(),
                evidence={"tensors": names[:64], "count": len(names)}))
        if not getattr(self.ddp, "broadcast_buffers", True) and _batchnorm(self.ddp.module):
            out.append(codes.finding(
                "DOC016", judge.PROBE,
                ("broadcast_buffers=False with BatchNorm: each rank keeps its own running statistics, and a checkpoint "
                 "saved by rank 0 keeps rank 0's"),
                ranks=tuple(range(self.world_size)), nodes=(), evidence={"broadcast_buffers": False}))
        return out

    # -- at the checks ---------------------------------------------------------
    def due(self, window_s: float, slowest_digest_ms: float) -> bool:
        """Whether this check compares: the last comparison (the slowest rank's) took at most BUDGET of
        the training time since. Called with the gathered table's numbers, so every rank agrees."""
        if self.done:
            return False
        self.since_s += window_s
        return (slowest_digest_ms <= max(FREE_MS, BUDGET * 1e3 * self.since_s) or self.last_equal_step is None)

    def plan_per_step(self, step: int, slowest_fingerprint_ms: float, slowest_step_ms: float) -> None:
        """Whether the steps after this check each keep a fingerprint: where one costs at most BUDGET of
        the slowest rank's step. From the gathered table, so every rank records the same steps."""
        want = (not self.done and slowest_fingerprint_ms > 0 and slowest_step_ms > 0
                and slowest_fingerprint_ms <= BUDGET * slowest_step_ms)
        if want and not self.per_step:
            import torch

            self.recorded_from = step + 1
            if self._ring is None:
                device = self.layout.tensors[0].device if self.layout.tensors else self.device
                self._ring = torch.zeros(RING, dtype=torch.int64, device=device)
        elif not want:
            self.recorded_from = None
        self.per_step = want

    def record(self, step: int) -> None:
        """This step's fingerprint into the ring (a few kernels on a GPU, never read here)."""
        assert self._ring is not None
        self._ring[step % RING] = rd.fingerprint(self.layout)

    def _measure_fingerprint(self) -> float:
        """One fingerprint timed, where it is cheap enough to try (the last comparison took at most FREE_MS);
        otherwise the comparison's own time stands for it (more than a fingerprint costs: no per-step record
        is then kept on a model that cannot afford it)."""
        if self.digest_ms > FREE_MS:
            self.fingerprint_ms = self.digest_ms
            return 0.0
        if self._fingerprint_reads >= FINGERPRINT_READS:  # the model does not change: its cost is known
            self.fingerprint_ms = self._fingerprint_best  # also after a slow comparison (a GC pause) set it aside
            return 0.0
        self._fingerprint_reads += 1
        ms = self._fingerprint_best
        spent = time.perf_counter()
        for _ in range(3):  # the least of three: a single cold call read 0.2-0.3 ms where the steady cost is 0.07
            began = time.perf_counter()
            rd.fingerprint(self.layout)
            ms = min(ms, 1e3 * (time.perf_counter() - began))
        spent = 1e3 * (time.perf_counter() - spent)
        if self.layout.tensors and self.layout.tensors[0].is_cuda:  # queued only: the GPU's read of the weights
            ms = max(ms, sum(e.numel for e in self.layout.entries) * 4 / GPU_READ_BYTES_PER_MS)
        self.fingerprint_ms = self._fingerprint_best = ms
        return spent  # this rank's own time on it: counted in the comparison's cost (digest_ms)

    def check(self, step: int, due: bool) -> Optional[tuple[judge.Comparison, judge.Seen]]:
        """The comparison's progress at this check: what differs, once the ranks have gathered it."""
        if self.late:
            return self._check_late(step, due)
        if not due:
            return None
        self.since_s = 0.0
        spent = self._measure_fingerprint()
        reduced = self._reduce(self._timed(self._vector))
        self.digest_ms += spent
        differ = self._differ(reduced)
        if not differ:
            self.last_equal_step = step
            return None
        return self._compare(self._gather(self._timed(self._detail)).tolist(), step)

    def _timed(self, make: Any) -> torch.Tensor:
        """`make()`, its time kept as this rank's cost (its own work: not the collective's wait for its peers)."""
        began = time.perf_counter()
        try:
            return make()
        finally:
            self.digest_ms = 1e3 * (time.perf_counter() - began)

    def _check_late(self, step: int, due: bool) -> Optional[tuple[judge.Comparison, judge.Seen]]:
        """A GPU's: the previous check's collective read now, the next one launched."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if not pending.event.query():  # a whole check interval behind: wait, as every rank does
                pending.event.synchronize()
            if pending.kind == "gather":
                return self._compare(pending.host.tolist(), pending.step)
            if not self._differ(pending.host):
                self.last_equal_step = pending.step
            else:
                self._pending = self._launch("gather", self._gather(self._timed(self._detail)), step)
                return None
        if due:
            self.since_s = 0.0
            spent = self._measure_fingerprint()
            self._pending = self._launch("reduce", self._reduce(self._timed(self._vector)), step)
            self.digest_ms += spent
        return None

    def _launch(self, kind: str, result: torch.Tensor, step: int) -> _Pending:
        return _Pending(kind, step, *to_host_late(result))

    # -- at the end of the run (callback/final_check.py) -----------------------
    def end_payload(self) -> Optional[tuple[str, str]]:
        """This rank's replica for the end's comparison, through the store: a hash of what every rank must hold
        alike (the check's reduced vector: settings, entry count, bit sums), and the details a difference is
        judged from (the check's gathered vector, only the model's entries, base64 float64s). None where there is
        nothing to compare (already named, failed, not DDP) or where a comparison costs more than END_MAX_MS."""
        if self.done or 4 * self.digest_ms > END_MAX_MS:
            return None
        import torch

        vector = self._vector().cpu()
        entries = len(self.layout.entries)
        parts = [self._settings().cpu(), rd.digest(self.layout), rd.digest(self.layout, grads=True),
                 rd.norms(self.layout), rd.norms(self.layout, grads=True)]
        if self._ring is not None and self.recorded_from is not None:
            parts.append(self._ring)
        flat = torch.cat([p.to("cpu", torch.float64).reshape(-1) for p in parts])
        detail = struct.pack(f"<{flat.numel()}d", *flat.tolist())
        packed = struct.pack(f"<{vector.numel()}d", *vector.tolist())
        return hashlib.sha256(packed).hexdigest(), f"{entries}:" + base64.b64encode(detail).decode()

    def from_end_payload(self, detail: str) -> list[float]:
        """A rank's `end_payload` detail laid out as the check's gathered row (`_detail`), for `_compare`."""
        count, _, body = detail.partition(":")
        raw = base64.b64decode(body)
        values = list(struct.unpack(f"<{len(raw) // 8}d", raw))
        n, settings = int(count), len(rd.settings_names())
        row = values[:settings]
        for k, fill in enumerate((0.0, -1.0, 0.0, -1.0)):
            part = values[settings + k * n: settings + (k + 1) * n][:rd.MAX_ENTRIES]
            row += part + [fill] * (rd.MAX_ENTRIES - len(part))
        ring = values[settings + 4 * n:][:RING]
        return row + (ring if len(ring) == RING else [-1.0] * RING)

    def compare_at_end(self, details: dict[int, str], step: int) -> tuple[judge.Comparison, judge.Seen]:
        """The end's comparison, on rank 0, from every rank's `end_payload` detail."""
        gathered: list[float] = []
        for rank in range(self.world_size):
            gathered += self.from_end_payload(details[rank])
        return self._compare(gathered, step)

    # -- the numbers -----------------------------------------------------------
    def _settings(self) -> torch.Tensor:
        import torch

        values = torch.tensor(rd.settings(self.optimizer), dtype=torch.float64)
        return values.pin_memory().to(self.device, non_blocking=True) if self.late else values

    def _padded(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        import torch

        out = torch.full((rd.MAX_ENTRIES,), fill, dtype=torch.float64, device=self.device)
        out[:values.numel()] = values.to(self.device)
        return out

    def _vector(self) -> torch.Tensor:
        """What every rank must hold alike: the settings, the entries' count and their bit sums."""
        import torch

        count = torch.full((1,), float(len(self.layout.entries)), dtype=torch.float64, device=self.device)
        return torch.cat([self._settings(), count, self._padded(rd.digest(self.layout))])

    def _detail(self) -> torch.Tensor:
        """On a difference: the settings, the bit sums of weights and gradients, and both norms."""
        import torch

        ring = (self._ring.to(self.device, torch.float64) if self._ring is not None
                else torch.full((RING,), -1.0, dtype=torch.float64, device=self.device))
        return torch.cat([self._settings(), self._padded(rd.digest(self.layout)),
                          self._padded(rd.digest(self.layout, grads=True), -1.0),
                          self._padded(rd.norms(self.layout)), self._padded(rd.norms(self.layout, grads=True), -1.0),
                          ring])

    def _reduce(self, vector: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        both = torch.cat([vector, -vector])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return both

    def _gather(self, vector: torch.Tensor) -> torch.Tensor:
        return all_gathered(vector, self.world_size)

    @staticmethod
    def _differ(reduced: torch.Tensor) -> bool:
        """The all-reduced [max, -min] pair differs somewhere: some rank holds another value (NaN too)."""
        import torch

        half = reduced.numel() // 2
        return not torch.equal(reduced[:half], -reduced[half:])

    def _compare(self, gathered: list[float], step: int) -> tuple[judge.Comparison, judge.Seen]:
        settings = len(rd.settings_names())
        width = settings + 4 * rd.MAX_ENTRIES + RING
        digests = {}
        rings = {}
        for rank in range(self.world_size):
            row = gathered[rank * width:(rank + 1) * width]
            at = settings
            params, grads, pnorms, gnorms = (row[at + k * rd.MAX_ENTRIES: at + (k + 1) * rd.MAX_ENTRIES] for k in range(4))
            digests[rank] = judge.RankDigest(rank, params, row[:settings], grads, pnorms, gnorms)
            rings[rank] = row[at + 4 * rd.MAX_ENTRIES:]
        comparison = judge.compare(digests, [e.names for e in self.layout.entries],
                                   [e.averaged for e in self.layout.entries], rd.settings_names())
        if not comparison.entries:  # only the settings differ (so far): the weights were still equal here
            self.last_equal_step = step
            return comparison, judge.Seen(step, self.last_equal_step)
        if self.first_seen_step is None:
            self.first_seen_step = step
        # Named once: replicas that differ do not come back together, and each further look costs a read of
        # every tensor and a gather.
        self.done = True
        self.per_step = False
        return comparison, judge.Seen(self.first_seen_step, self.last_equal_step,
                                      first_step=self._first_differing_step(rings, step))

    def _first_differing_step(self, rings: dict[int, list[float]], step: int) -> Optional[int]:
        """The first step whose fingerprints differ across ranks, where the per-step record covers every
        step since the last equal check (None: it does not, and the two checks bracket it)."""
        if self.recorded_from is None:
            return None
        since = (self.last_equal_step or 0) + 1  # the first step not known equal
        low = max(self.recorded_from, since, step - RING + 1)  # older steps are overwritten in the ring
        for s in range(low, step + 1):
            if len({ring[s % RING] for ring in rings.values()}) > 1:
                # The first recorded step differing says nothing of the unrecorded ones before it.
                return s if s > low or low == since else None
        return None


def _batchnorm(module: Any) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) and m.track_running_stats for m in module.modules())


def bypass_finding(rows: Any, hosts: dict[int, str]) -> Finding:
    """DOC015: DDP's reducer recorded no iteration while the loop ran BYPASS_STEPS steps and more."""
    ranks = sorted(r for r, row in rows.items() if row.reducer_iteration == 0)
    steps = max(row.steps_done for row in rows.values())
    return codes.finding(
        "DOC015", judge.PROBE,
        (f"DDP averaged no gradient in {steps} steps on rank {', '.join(map(str, ranks))}: its forward never ran with "
         "gradient sync on (the loss is computed through model.module(...), or every backward is under no_sync()), "
         "so every rank trains alone"),
        ranks=tuple(ranks), nodes=tuple(sorted({hosts[r] for r in ranks if r in hosts})),
        evidence={"steps": steps, "ddp_iterations_recorded": {str(r): rows[r].reducer_iteration for r in ranks}})
