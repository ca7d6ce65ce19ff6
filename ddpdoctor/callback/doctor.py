"""`Doctor`: the probes inside a user's own training loop, at negligible cost.

    doctor = ddpdoctor.Doctor(ddp_model, loader=loader)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            with doctor.step(batch):
                loss = ddp_model(batch).sum(); loss.backward(); optimizer.step()

Per step it only reads clocks (and, through a DDP comm hook, when each gradient bucket's
all-reduce starts and ends). Every `every` steps it makes one collective of its own: an
all_gather of one small float64 tensor per rank holding those steps' timings, a
fingerprint of the current batch, the loader's length, the sampler's epoch state and the
peak memory. Rank 0 judges (`online_checks`, and the `stragglers` probe's scores on the
same columns) and reports each new finding once: to the `ddpdoctor` logger, to a JSON file,
and to `on_finding`. A step that outlives its allowance is judged across ranks by the
watchdog threads, through the job's store (callback/hang.py): one verdict on every rank
naming the rank that caused the hang and its victims. Nothing raises into the training loop unless
`raise_on_finding` asks for it, and then on every rank at the same step (all ranks judge
the same gathered table), so no rank is left waiting in the next all-reduce.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from ddpdoctor.core import codes, keys
from ddpdoctor.core.exits import PEER_HUNG_EXIT, STAGE_TIMEOUT_EXIT, hard_exit
from ddpdoctor.callback import hang
from ddpdoctor.callback.online_checks import (PROBE, DataParallelGpu, History, RankWindow, batch_scaling_finding,
                                              data_findings, data_parallel_finding, memory_growth, setup_findings)
from ddpdoctor.callback.metrics import MetricsSink
from ddpdoctor.callback.row import GatheredRow, contention_fields, pack, packed_length, unpack
from ddpdoctor.callback.step_clock import StepClock
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.history import recording
from ddpdoctor.measure import contention
from ddpdoctor.runtime.liveness import main_thread_frame
from ddpdoctor.runtime.workload import tensor_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ddpdoctor")
T = TypeVar("T")
MIN_COST_SHARE = 0.05
# Stragglers are judged on the kept windows once they hold this many steps: 8 windows of 10.
ONLINE_MIN_STEPS = 80
# A DataParallel model's GPUs are measured over this many steps (or `every`, if fewer), then judged.
DATA_PARALLEL_STEPS = 20
# The watchdog looks this often: a hang is named within half a second of its allowance, for a
# wake-up of a few microseconds twice a second in the user's process.
WATCH_TICK_S = 0.5


class FindingRaised(RuntimeError):
    """Raised into the loop only when `raise_on_finding` is set and a finding reaches it."""


def _fingerprint(batch: Any) -> int:
    """52 bits of a SHA-1 over strided samples of the batch's first tensors (exact in a float64).

    Several tensors, so a constant first one (a mask, say) does not make two ranks' batches
    look the same. Only on check steps: on a GPU reading the batch is a device-to-host copy."""
    import torch

    digest = hashlib.sha1()
    for tensor in _tensors(batch)[:4]:
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 4096)
        sample = flat[::stride][:4096].to("cpu", torch.float64).contiguous()
        digest.update(tensor_bytes(sample))
    if digest.digest() == hashlib.sha1().digest():  # no tensor in the batch
        return 0
    return int.from_bytes(digest.digest()[:7], "big") >> 4 or 1


def _safely(read: Callable[[], T]) -> Optional[T]:
    """A local reading, or None (unknown) where it fails: the training loop never sees our errors."""
    try:
        return read()
    except Exception:
        return None


def _tensors(batch: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(batch, torch.Tensor):
        return [batch] if batch.layout == torch.strided and batch.numel() else []
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):  # dicts, and Hugging Face's BatchEncoding (a UserDict)
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class _WaitTimer:
    """DDP comm hook state: an ordinary all-reduce, with the wait for the last bucket timed."""

    def __init__(self, group: Any, size: int) -> None:
        self.group = group  # DDP's own process group: a subgroup's gradients stay in the subgroup
        self.size = size
        self.last_launch = 0.0
        self.last_done = 0.0

    def take_ms(self) -> float:
        ms = max(0.0, self.last_done - self.last_launch) * 1e3 if self.last_launch else 0.0
        self.last_launch = self.last_done = 0.0
        return ms


def _wait_hook(state, bucket):
    # Unannotated on purpose: DDP's register_comm_hook compares the hook's annotations with
    # GradBucket and Future[Tensor] objects, and under `from __future__ import annotations`
    # they are strings, so an annotated hook is refused and the wait goes unmeasured (DOC011).
    import torch.distributed as dist

    state.last_launch = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(state.size)

    def done(fut: Any) -> Any:
        value = fut.value()[0]  # raises if the all-reduce failed: still pending, for the hang's record
        state.last_done = time.perf_counter()
        return value

    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(done)


def _is_wrapped(model: Any, ddp_class: Any) -> bool:
    """DDP, or another data-parallel wrapper that averages gradients (FSDP, DeepSpeed), or
    torch.compile of one of them: not DOC004."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile(DDP(m))
    if isinstance(inner, ddp_class):
        return True
    name = type(inner).__name__
    # FSDP1's wrapper, FSDP2's fully_shard (it renames the class "FSDP<name>"), a DeepSpeed engine.
    return "FullyShardedDataParallel" in name or name.startswith("FSDP") or "DeepSpeed" in name


def _data_parallel_ids(model: Any) -> Optional[list[int]]:
    """The GPUs of a torch.nn.DataParallel model (possibly empty: no GPU), or None for any other model."""
    import torch

    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, torch.nn.DataParallel):
        return None
    return [int(getattr(d, "index", d)) for d in (inner.device_ids or [])]


def _learning_rates(optimizer: Any) -> list[float]:
    """Each parameter group's base rate: a scheduler's `initial_lr` (the warm-up's start is not the rate)."""
    out = []
    for group in getattr(optimizer, "param_groups", None) or []:
        lr = group.get("initial_lr", group.get("lr"))
        if hasattr(lr, "item"):  # a tensor learning rate (capturable optimizers)
            lr = lr.item()
        if isinstance(lr, (int, float)):
            out.append(float(lr))
    return out


def _unsharded_sampler(loader: Any, sampler: Any) -> Optional[str]:
    """The sampler's class name when nothing in the loader shards the data; None otherwise.

    Frameworks shard in their own ways: Lightning swaps in a DistributedSampler, Accelerate
    (Hugging Face) wraps the loader and its batch sampler ("...Shard")."""
    if loader is None or sampler is None:
        return None
    names = [type(x).__name__ for x in (loader, sampler, getattr(loader, "batch_sampler", None)) if x is not None]
    if any("Distributed" in n or "Shard" in n or "Dispatcher" in n or n.startswith("_Infinite") for n in names):
        return None  # sharded, dispatched by Accelerate, or an IterableDataset (which shards itself)
    return type(sampler).__name__


def _default_store() -> Optional[torch.distributed.Store]:
    """The job's own rendezvous store (torch keeps no public handle to it), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def gather_device(nccl: bool, model_device: torch.device) -> torch.device:
    """Where the callback's own gather runs: the model's GPU under NCCL (its index, not the current
    device, which a job that never called set_device leaves at 0 on every rank); CPU otherwise."""
    import torch

    if not nccl:
        return torch.device("cpu")
    if model_device.type == "cuda":
        index = model_device.index if model_device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cuda", torch.cuda.current_device())


class Doctor:
    """Rank, world size and device come from the process group and the model, never from torchrun's
    variables, so a job started with mp.spawn (or any launcher) is watched the same way."""

    def __init__(self, model: Any, optimizer: Any = None, loader: Any = None, sampler: Any = None, *,
                 every: int = 50, step_deadline_s: float = 600.0, json_path: Optional[str] = None,
                 on_finding: Optional[Callable[[Finding], None]] = None, raise_on_finding: bool = False,
                 on_hang: str = "report", measure_comm: bool = True, batch_size: Optional[int] = None,
                 history: Optional[str] = None, on_metrics: Optional[Callable[[dict[str, Any]], Any]] = None,
                 tensorboard: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if on_hang not in ("report", "exit"):
            raise ValueError(f"on_hang must be 'report' or 'exit', not {on_hang!r}")
        # The step deadline is learned from the job's own steps; step_deadline_s is its ceiling.
        self._clock = StepClock(step_deadline_s)  # a ValueError for 0, negative, NaN, inf
        self._allowance = self._clock.allowance_s()  # the running step's, read by the watchdog
        self._slow = ""  # what the running step was marked slow for ("" when it was not)
        self.hang_deadline: dict[str, Any] = {}  # how the allowance of the step called hung was set
        self.every = max(2, int(every))
        self.deadline_s = self._clock.ceiling_s
        self.json_path = json_path
        self.on_finding = on_finding
        self.raise_on_finding = raise_on_finding
        self.on_hang = on_hang
        self._metrics = MetricsSink(on_metrics, tensorboard)  # each check's numbers out (docs/fleet.md)
        # --history's store (or DDPDOCTOR_HISTORY): rank 0 appends the run at close (docs/fleet.md).
        self.history = recording.store_path(history, os.environ)
        self._started_at = time.time()
        self.loader = loader
        self.optimizer = optimizer
        self.batch_size = int(batch_size) if batch_size else None
        self.sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.host = os.uname().nodename
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, tuple[int, ...]]] = set()
        self._lock = threading.Lock()
        self._same_batch_checks = 0  # consecutive checks where every rank had the same batch
        self._history = History(keep=max(4, -(-ONLINE_MIN_STEPS // self.every)))
        self._cpu = contention.Window(corunners="when_lost")  # the CPU this thread gets, per window
        self._steps = 0
        self._columns: dict[str, list[float]] = {"step": [], "data": [], "wait": [], "samples": []}
        self._began = 0.0
        self._last_end = 0.0
        self._batch: Any = None
        self._epoch0 = getattr(self.sampler, "epoch", None)
        # Without a process group there are no checks to read the events: CPU clocks only.
        self._cuda = self.device.type == "cuda" and self.distributed
        # NCCL gathers CUDA tensors on the rank's own GPU, which is the model's: the mp.spawn tutorial
        # moves the model with .to(rank) and never calls set_device, so "current device" would be
        # cuda:0 on every rank (NCCL's "Duplicate GPU detected"). Other backends take CPU tensors.
        nccl = self.distributed and dist.get_backend() == "nccl"
        self._gather_device = gather_device(nccl, self.device)
        self._events: list[tuple[Any, Any]] = []
        self._event_begin: Any = None
        self._timer = self._install_wait_timer(model, measure_comm)
        self._dp_ids = _data_parallel_ids(model)
        self._dp_util: dict[int, list[float]] = {i: [] for i in self._dp_ids or []}
        self._dp_done = self._dp_ids is None
        self._emit_setup_findings(model, measure_comm)
        self._store = _default_store()
        self._hosts: dict[int, str] = {self.rank: self.host}
        if self._store is not None:
            # The node names travel through the job's own store, not a collective.
            self._store.set(keys.callback_host(self.rank), self.host)
            # So a peer can tell this rank dead or frozen when a hang finds it silent.
            self._store.set(keys.callback_pid(self.rank), json.dumps({"pid": os.getpid(), "host": self.host}))
        self._hangs = 0  # hang episodes this rank took part in (each has its own store keys)
        self._hanging = False  # a hang's exchange runs: the main thread's error is part of it
        self._hang_over = threading.Event()  # set when it is over (on_hang="report")
        self._hang_lock = threading.Lock()  # one thread judges: the watchdog, the loop's, or the left one
        self._watchdog = threading.Thread(target=self._watch, name="ddpdoctor-step-watchdog", daemon=True)
        self._stop = threading.Event()
        self._watchdog.start()
        self._closed = False
        atexit.register(self.close)

    def _install_wait_timer(self, model: Any, measure_comm: bool) -> Optional[_WaitTimer]:
        """The comm hook that times each step's gradient all-reduce wait, or None where it cannot be ours.

        Only DDP's comm hook has the (state, bucket) form the timer is: FSDP's register_comm_hook
        takes another signature, and its hook would fail inside the user's backward pass."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not (isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel) and measure_comm
                and self.distributed):
            return None
        group = getattr(model, "process_group", None)
        timer = _WaitTimer(group, dist.get_world_size(group) if group is not None else self.world_size)
        try:
            model.register_comm_hook(timer, _wait_hook)
        except Exception:  # the job has a comm hook of its own: step times only
            return None
        return timer

    def _unmeasured_wait(self, model: Any, is_ddp: bool, measure_comm: bool) -> Optional[str]:
        """The wrapper whose collectives go untimed (DOC011 names it), or None where the wait is measured
        or there is no data-parallel wrapper to time."""
        from torch.nn.parallel import DistributedDataParallel

        if not (is_ddp and self._timer is None and self.distributed):
            return None
        inner = getattr(model, "_orig_mod", model)
        if not isinstance(inner, DistributedDataParallel):
            return type(inner).__name__
        return ("DistributedDataParallel (measure_comm=False)" if not measure_comm
                else "DistributedDataParallel (the job has its own comm hook)")

    def _emit_setup_findings(self, model: Any, measure_comm: bool) -> None:
        """What is wrong before the first step, from the objects given: reported at construction,
        so a job that would train for nothing hears of it at once."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        is_ddp = _is_wrapped(model, DistributedDataParallel)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for finding in setup_findings(is_ddp, self.world_size, gpus, self.rank, self.host,
                                      _unsharded_sampler(self.loader, self.sampler),
                                      data_parallel=self._dp_ids is not None,
                                      unmeasured_wait=self._unmeasured_wait(model, is_ddp, measure_comm)):
            self._emit(finding)

    # -- the loop's side --------------------------------------------------------
    @contextlib.contextmanager
    def step(self, batch: Any = None, slow: bool = False) -> Iterator[None]:
        """One training step; `slow=True` marks one known to be slow (it evaluates, it saves a checkpoint),
        which is given a longer allowance before it is called hung (docs/callback.md)."""
        self.step_begin(batch, slow)
        try:
            yield
        except BaseException as exc:
            # The loop's own error ends the step: no check (a collective other ranks may not
            # reach), and no hang report for a step that is over, unless a collective failed
            # because a peer is gone (gloo's "Connection closed by peer"): that is a hang's verdict.
            began, self._began = self._began, 0.0
            self._slow = ""
            self._after_collective_failure(exc, began)
            raise
        self.step_end()

    def step_begin(self, batch: Any = None, slow: bool = False) -> None:
        now = time.perf_counter()
        self._columns["data"].append((now - self._last_end) * 1e3 if self._last_end else 0.0)
        self._batch = batch
        self._slow = "step marked slow" if slow else ""
        self._allowance = self._clock.allowance_s(slow)  # before _began: the watchdog reads both
        self._began = now
        if self._cuda:
            self._event_begin = self._record()

    def step_end(self) -> None:
        now = time.perf_counter()
        began = self._began
        self._columns["step"].append((now - began) * 1e3)
        if self._cuda:
            # GPU work runs behind the CPU: events on the stream, read only at the next check.
            self._events.append((self._event_begin, self._record()))
        self._columns["wait"].append(self._timer.take_ms() if self._timer else 0.0)
        tensor = _first_tensor(self._batch)
        # 0: not known (no batch given, or a scalar): DOC010 is then not said rather than guessed.
        self._columns["samples"].append(float(tensor.shape[0]) if tensor is not None and tensor.dim() else 0.0)
        self._steps += 1
        try:
            if not self._dp_done:
                self._data_parallel_step()
            if self.distributed and (self._steps == 1 or self._steps % self.every == 0):
                self._check()  # still inside the step for the watchdog: a stuck gather is a stuck step
            elif not self.distributed and len(self._columns["step"]) > 2 * self.every:
                for key in self._columns:  # one process: no check ever takes them, keep the last ones
                    self._columns[key] = self._columns[key][-self.every:]
        finally:
            # Also when a check raised (raise_on_finding): a step that is over must not be taken for a hang.
            self._began = 0.0
            self._last_end = time.perf_counter()
            # The whole step as the watchdog saw it, check included, teaches the clock.
            if began:
                self._clock.finished(self._last_end - began, slow=bool(self._slow))
            self._slow = ""

    @contextlib.contextmanager
    def expect_slow(self, what: str = "slow work") -> Iterator[None]:
        """Code known to be slow (`with doctor.expect_slow("checkpoint"): save(...)`): a longer allowance.

        Inside a step, the step is marked slow from here on. Between steps, the block is watched
        as a slow step of its own (a checkpoint stuck in a collective is a hang too), not
        counted as a training step. `what` is named in the hang report."""
        if self._began:
            self._slow = what
            self._allowance = self._clock.allowance_s(slow=True)
            yield
            return
        began = time.perf_counter()
        self._slow = what
        self._allowance = self._clock.allowance_s(slow=True)
        self._began = began
        try:
            yield
        finally:
            self._began = 0.0
            self._slow = ""
            self._clock.finished(time.perf_counter() - began, slow=True)

    def report(self) -> list[Finding]:
        """Every finding so far, on this rank (rank 0 holds the gathered ones)."""
        return list(self.findings)

    def close(self) -> None:
        """Stop watching and write the final summary (once; also at interpreter exit if never called)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._cpu.close()
        atexit.unregister(self.close)
        self._publish_left()
        if not self._dp_done and self._steps:
            self._data_parallel_judge()
        if self.rank == 0 and self.history:
            recording.record_callback(self.history, self._history.windows, self.findings,
                                      world_size=self.world_size, started_at=self._started_at)
        if self.rank != 0 and not self.findings:
            return
        worst = max((f.severity for f in self.findings), default=Severity.OK)
        log.warning("ddpdoctor: rank %d, %d steps: %s", self.rank, self._steps,
                    "no findings" if not self.findings else
                    f"{len(self.findings)} finding(s), worst {worst.label}: "
                    + "; ".join(f"{f.code} {f.title}" for f in self.findings[:5]))

    # -- every `every` steps: one collective ------------------------------------------
    def _check(self) -> None:
        """Gather every rank's window, judge the table, report what is new.

        Every rank judges the same table the same way, so a raise (when asked for) happens on
        every rank at the same step; only rank 0 reports."""
        if self._cuda and self._events:
            self._device_times()
        gathered = self._gather(self._window_row())
        if self._steps > 1:  # what was sent is not sent again (step 1's check is for the data and setup)
            for key in self._columns:
                self._columns[key] = []
        try:
            rows = self._rows(gathered)
            found = self._judge(rows)
        except Exception as exc:  # a bug of ours must not end the user's job
            log.warning("ddpdoctor: judging failed on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
            return
        if self.rank == 0 and self._metrics.wanted:
            self._metrics.publish_window(self._steps, rows, self._history)
        self._take_new(found)

    def _window_row(self) -> GatheredRow:
        """This rank's last `every` steps and its local facts, as one row of the gather.

        Each column is cut to the steps the step column holds, so the row's columns agree."""
        n = self.every
        count = min(n, len(self._columns["step"]))
        cols = {k: (v[-n:] + [0.0] * n)[:count] for k, v in self._columns.items()}
        loader_len, stale, peak, fingerprint = self._local_facts()
        return GatheredRow(rank=self.rank, steps_done=self._steps, loader_len_batches=loader_len,
                           stale_epoch=stale, peak_mem_bytes=peak, batch_fingerprint=fingerprint,
                           wait_measured=self._timer is not None, step_ms=cols["step"], data_ms=cols["data"],
                           wait_ms=cols["wait"], samples=cols["samples"],
                           **contention_fields(self._cpu.take(wait_s=(sum(cols["wait"]) + sum(cols["data"])) / 1e3)))

    def _gather(self, row: GatheredRow) -> torch.Tensor:
        """The one collective: every rank's packed row, side by side, on the gather's device."""
        import torch
        import torch.distributed as dist

        sent = torch.tensor(pack(row, self.every), dtype=torch.float64).to(self._gather_device)
        gathered = torch.empty(self.world_size * packed_length(self.every), dtype=torch.float64,
                               device=self._gather_device)
        # torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older torch has only that.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, sent)
        return gathered

    def _take_new(self, found: list[Finding]) -> None:
        """Findings not seen before: rank 0 reports them, the others only remember them; then
        the raise, if asked for, on every rank alike (the judges saw the same table)."""
        new = [f for f in found if (f.code, f.ranks) not in self._seen]
        for finding in new:
            if self.rank == 0:
                self._emit(finding, may_raise=False)
            else:
                self._seen.add((finding.code, finding.ranks))
        if self.raise_on_finding and any(f.severity >= Severity.WARN for f in new):
            worst = max(new, key=lambda f: f.severity)
            raise FindingRaised(f"{worst.code}: {worst.title}")

    def _local_facts(self) -> tuple[Optional[int], bool, Optional[int], Optional[int]]:
        """Loader length, stale epoch, peak memory, batch fingerprint: unknown where a reading fails,
        because a rank that raised here would never join the gather its peers wait in."""
        return (_safely(self._known_loader_len), bool(_safely(self._stale_epoch)),
                _safely(lambda: int(self._peak_mem())), _safely(self._batch_fingerprint))

    def _known_loader_len(self) -> Optional[int]:
        length = self._loader_len()
        return int(length) if length >= 0 else None

    def _batch_fingerprint(self) -> Optional[int]:
        return (_fingerprint(self._batch) or None) if self._batch is not None else None

    def _rows(self, gathered: torch.Tensor) -> dict[int, RankWindow]:
        """The gathered tensor as every rank's window, keyed by rank, with its node's name."""
        rows = {}
        for values in gathered.cpu().reshape(self.world_size, -1).tolist():
            row = unpack(values)
            rows[row.rank] = row.to_window(self._host_of(row.rank))
        return rows

    def _judge(self, rows: dict[int, RankWindow]) -> list[Finding]:
        """Every online check on one gathered table; DOC001 only once it repeats."""
        found = data_findings(rows)
        if self._steps == 1 and self.optimizer is not None:  # once: the first gathered step shows the batch
            found += self._batch_scaling(rows)
        same = any(f.code == "DOC001" for f in found)
        self._same_batch_checks = self._same_batch_checks + 1 if same else 0
        if same and self._same_batch_checks < 2:  # one coincidence is not a missing sampler
            found = [f for f in found if f.code != "DOC001"]
        if len(next(iter(rows.values())).step_ms) > 1:
            self._history.add(rows)
            found += memory_growth(self._history)
        return found + self._stragglers(rows)

    def _batch_scaling(self, rows: dict[int, RankWindow]) -> list[Finding]:
        """DOC010 from the first check: each rank's batch (as given, or as seen) and the optimizer's rates."""
        batch = {r: float(self.batch_size) if self.batch_size else (row.samples[-1] if row.samples else 0.0)
                 for r, row in rows.items()}
        scaling = batch_scaling_finding(batch, _learning_rates(self.optimizer),
                                        [rows[r].host for r in sorted(rows)])
        return [scaling] if scaling is not None else []

    def _stragglers(self, rows: dict[int, RankWindow]) -> list[Finding]:
        """The `stragglers` probe's verdict on the kept windows, once they hold enough steps.

        In a live job a straggler must also cost something: tiny steps make a few percent of
        noise look like a rank, and a rank that costs under MIN_COST_SHARE of a step is not worth a page.
        Here a step is only data (before step_begin) and work inside the step, so a real
        straggler's extra time shows in one of them; extra time in neither ("host overhead")
        is noise between medians, not a rank."""
        from ddpdoctor.probes.base import RunView
        from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

        facts = self._history.facts()
        if not facts or min(len(f["steps"]["step_ms"]) for f in facts.values()) < ONLINE_MIN_STEPS:
            return []
        run = RunView(world_size=self.world_size, hosts={r: row.host for r, row in rows.items()})
        return [f for f in diagnose_stragglers(facts, run) if f.severity >= Severity.WARN
                and (f.code != "STR001" or (f.evidence.get("cause") != "host overhead"
                                            and f.evidence.get("cost_ms_per_step", 0.0)
                                            >= MIN_COST_SHARE * f.evidence.get("median_step_ms", 0.0)))]

    def _host_of(self, rank: int) -> str:
        if rank not in self._hosts and self._store is not None:
            key = keys.callback_host(rank)
            try:
                if self._store.check([key]):
                    self._hosts[rank] = self._store.get(key).decode("utf-8", "replace")
            except Exception:
                pass
        return self._hosts.get(rank, f"rank{rank}")

    def _record(self) -> torch.cuda.Event:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _device_times(self) -> None:
        """Step and between-step times from the CUDA events: one sync, on the last event, per check."""
        events = self._events[-len(self._columns["step"]):]
        events[-1][1].synchronize()
        steps = [begin.elapsed_time(end) for begin, end in events]
        gaps = [0.0] + [prev[1].elapsed_time(cur[0]) for prev, cur in zip(events, events[1:])]
        k = len(steps)
        self._columns["step"][-k:] = steps
        self._columns["data"][-k + 1:] = gaps[1:] if k > 1 else self._columns["data"][-k + 1:]
        self._events = self._events[-1:]  # the last one starts the next check's first gap

    # -- DataParallel: one process, several GPUs, measured over its first steps --------
    def _data_parallel_step(self) -> None:
        try:
            self._data_parallel_sample()
        except Exception:  # a reading that fails is missing; it never stops the training
            pass
        if self._steps >= min(self.every, DATA_PARALLEL_STEPS):
            self._data_parallel_judge()

    def _data_parallel_sample(self) -> None:
        if not self._dp_ids:
            return
        import torch

        from ddpdoctor.measure import nvml

        for index in self._dp_ids:
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            handle = nvml.query("nvmlDeviceGetHandleByUUID", f"GPU-{uuid}") if uuid else nvml.Unknown("no uuid")
            if isinstance(handle, nvml.Unknown):
                continue
            util = nvml.query("nvmlDeviceGetUtilizationRates", handle, convert=lambda u: float(u.gpu))
            if not isinstance(util, nvml.Unknown):
                self._dp_util[index].append(util)

    def _data_parallel_judge(self) -> None:
        self._dp_done = True
        gpus = []
        for index in self._dp_ids or []:
            try:
                import torch

                peak = int(torch.cuda.max_memory_allocated(index))
            except Exception:
                peak = 0
            gpus.append(DataParallelGpu(index=index, peak_mem_bytes=peak, util_pct=self._dp_util.get(index, [])))
        self._emit(data_parallel_finding(gpus, self._steps, self._columns["step"], self.rank, self.host),
                   may_raise=not self._closed)

    # -- local facts ---------------------------------------------------------------
    def _loader_len(self) -> float:
        try:
            return float(len(self.loader)) if self.loader is not None else -1.0
        except TypeError:  # an iterable-style dataset has no length
            return -1.0

    def _stale_epoch(self) -> bool:
        """A second pass over the loader began and the sampler's epoch never changed."""
        length = self._loader_len()
        if self._epoch0 is None or length <= 0 or not getattr(self.sampler, "shuffle", False):
            return False
        return self._steps > length and getattr(self.sampler, "epoch", None) == self._epoch0

    def _peak_mem(self) -> float:
        if self.device.type == "cuda":
            import torch

            return float(torch.cuda.max_memory_allocated(self.device))
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    # -- reporting ---------------------------------------------------------------
    def _emit(self, finding: Finding, may_raise: bool = True) -> None:
        with self._lock:  # the watchdog thread reports too
            key = (finding.code, finding.ranks)
            if key in self._seen:
                return
            self._seen.add(key)
            self.findings.append(finding)
            self._report(finding)
        if may_raise and self.raise_on_finding and finding.severity >= Severity.WARN:
            raise FindingRaised(f"{finding.code}: {finding.title}")

    def _report(self, finding: Finding) -> None:
        log.warning("ddpdoctor %s %s: %s (ranks %s)", finding.severity.label, finding.code, finding.title,
                    ",".join(map(str, finding.ranks)))
        if self.json_path:
            self._write_json(self.json_path)
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception:  # a broken hook must not break training
                log.exception("ddpdoctor: on_finding raised")

    def _write_json(self, json_path: str) -> None:
        from ddpdoctor.core.files import atomic_write_json

        path = json_path if self.rank == 0 else f"{json_path}.rank{self.rank}"
        try:
            atomic_write_json({"rank": self.rank, "world_size": self.world_size, "steps": self._steps,
                               "findings": [f.to_json() for f in self.findings]}, path)
        except OSError as exc:
            log.error("ddpdoctor: cannot write %s: %s", path, exc)

    # -- the step deadline -------------------------------------------------------------
    def _watch(self) -> None:
        reported = 0.0
        while not self._stop.wait(min(WATCH_TICK_S, self.deadline_s / 4)):
            began = self._began
            if not began or began == reported or time.perf_counter() - began < self._allowance:
                self._answer_peers(began)
                continue
            reported = began
            # Read while the main thread is stuck in the step, so the clock is not being fed.
            self.hang_deadline = dict(self._clock.describe(slow=bool(self._slow)), marked_slow_as=self._slow)
            self._emit_hang(time.perf_counter() - began)

    def _answer_peers(self, began: float) -> None:
        """A peer's step hung: answer its exchange from here, between steps (a data loader stuck)
        or inside a step not yet past its allowance. The store is read only once this rank has
        itself gone half its allowance without finishing a step: a healthy job never reads it here."""
        since = began or self._last_end
        if (self._store is None or self.world_size < 2 or not since or self._hanging
                or time.perf_counter() - since < self._allowance / 2):
            return
        try:
            started = hang.Exchange(self._store, self.rank, self.world_size, self._hangs + 1, self.host).started()
        except Exception:  # the store went away with its host
            return
        if started:
            self.hang_deadline = dict(self._clock.describe(slow=bool(self._slow)), marked_slow_as=self._slow)
            self._emit_hang(time.perf_counter() - since)

    def _emit_hang(self, elapsed_s: float, error: Optional[BaseException] = None) -> None:
        if self._store is not None and self.world_size > 1:
            self._cross_rank_hang(error)
            return
        main = main_thread_frame()
        stack = traceback.format_stack(main) if main is not None else []
        where = stack[-1].strip().splitlines()[0] if stack else "unknown"
        finding = codes.finding(
            "DOC007", PROBE,
            f"Step {self._steps + 1} on rank {self.rank} has run for {elapsed_s:.0f} s "
            f"(allowance {self.hang_deadline.get('allowance_s', self.deadline_s):g} s = "
            f"{self.hang_deadline.get('rule', 'step_deadline_s')}): stuck at {where}",
            ranks=(self.rank,), nodes=(self.host,),
            evidence={"python_stack": [line.rstrip() for line in "".join(stack[-12:]).splitlines()],
                      "deadline": self.hang_deadline,
                      "flight_recorder": ("set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                                          "to have NCCL's Flight Recorder dump what every rank was in; then "
                                          "`ddpdoctor explain` the dumps")})
        sys.stderr.write(f"ddpdoctor: rank {self.rank}: {finding.title}\n" + "".join(stack[-12:]))
        sys.stderr.flush()
        self._emit(finding, may_raise=False)  # the watchdog thread cannot raise into the loop
        if self.on_hang == "exit":
            # The first peer to leave resets this rank's connections, and its main thread may die of
            # that error before this thread exits: the exit status stays "hung", not the error's 1.
            atexit.register(hard_exit, STAGE_TIMEOUT_EXIT)
            hard_exit(STAGE_TIMEOUT_EXIT)

    def _cross_rank_hang(self, error: Optional[BaseException]) -> None:
        """One verdict on every rank (callback/hang.py): trade records through the job's store,
        the lowest answering rank judges, every rank reports the same finding; with
        on_hang="exit", the culprit leaves first."""
        if not self._hang_lock.acquire(blocking=False):  # another thread of this rank is judging it
            self._hang_over.wait(hang.leave_within_s() + 2.0)
            return
        self._hanging = True
        self._hang_over.clear()
        self._hangs += 1
        try:
            self._judge_hang(hang.Exchange(self._store, self.rank, self.world_size, self._hangs, self.host), error)
        finally:
            self._hanging = False
            self._hang_over.set()
            self._hang_lock.release()

    def _judge_hang(self, exchange: hang.Exchange, error: Optional[BaseException]) -> None:
        if self.on_hang == "exit":
            # A store call can block past every wait (TCPStore serialises its clients): the exit
            # must not wait on it. This timer ends the process if the calls below do not return.
            backstop = threading.Timer(hang.leave_within_s() + 2.0, hard_exit, (STAGE_TIMEOUT_EXIT,))
            backstop.daemon = True
            backstop.start()
        record = self._hang_record(error)
        try:
            exchange.publish(record)
            verdict = exchange.decide(*exchange.collect())
        except Exception:  # the store went away with its host: judged on what this rank knows
            verdict = hang.judge({self.rank: record}, {r: hang.Absent(r, "silent") for r in range(self.world_size)
                                                       if r != self.rank}, self.rank)
        finding = hang.verdict_finding(verdict)
        sys.stderr.write(f"ddpdoctor: rank {self.rank}: {finding.code} {finding.title}\n")
        sys.stderr.flush()
        self._emit(finding, may_raise=False)  # the watchdog thread cannot raise into the loop
        with contextlib.suppress(Exception):
            exchange.reported()
        if self.on_hang == "exit":
            self._leave_after_hang(exchange, verdict)

    def _hang_record(self, error: Optional[BaseException]) -> hang.RankRecord:
        """Where this rank is: in which collective (DDP's all-reduce pending in our comm hook, or one
        the main thread called), at which line of the user's code, and its stack. `error`: the
        collective's failure, whose traceback holds the user's line (this is the main thread)."""
        pairs = [(f, f.f_lineno) for f in hang.frames_of(main_thread_frame() if error is None else sys._getframe())]
        if error is not None:
            pairs += list(traceback.walk_tb(error.__traceback__))
        frames = [f for f, _ in pairs]
        pending = self._timer is not None and self._timer.last_launch > self._timer.last_done
        collective = hang.DDP_ALLREDUCE if pending else hang.user_collective(frames)
        if not collective and hang.untimed_backward(frames):
            # No hook of ours (FSDP, the job's own), or NCCL's, whose futures complete when queued.
            collective = "backward (its gradient collectives, not timed)"
        where, stack = hang.describe(pairs)
        in_step = (bool(self._began) or error is not None) and not self._closed
        return hang.RankRecord(self.rank, self._steps + int(in_step), os.getpid(), self.host, collective, where, stack,
                               error=f"{type(error).__name__}: {error}"[:300] if error is not None else "",
                               left=self._closed, deadline=self.hang_deadline)

    def _leave_after_hang(self, exchange: hang.Exchange, verdict: hang.Verdict) -> None:
        """The culprit leaves first, once its victims have written the verdict down, so the launcher's
        first failure (torchrun's "Root Cause") is it; a victim leaves after it, or after a grace
        where the culprit cannot leave (dead, frozen). Exit codes: core/exits.py."""
        culprit = self.rank in verdict.culprits
        code = STAGE_TIMEOUT_EXIT if culprit else PEER_HUNG_EXIT
        # The culprit's leaving resets this rank's connections, and its main thread may die of that
        # error before this thread exits: the exit status stays this one, not the error's 1.
        atexit.register(hard_exit, code)
        try:
            if culprit:
                exchange.wait_reported([r for r in verdict.records if r != self.rank], hang.COLLECT_S)
                exchange.leaving()
            else:
                exchange.wait_gone(verdict)
        except Exception:  # the store went away with its host: nobody is left to wait for
            pass
        hard_exit(code)

    def _after_collective_failure(self, exc: BaseException, began: float) -> None:
        """A step's collective failed because a peer went away (gloo closes a dead or departed
        rank's connections at once, where NCCL would hang): the hang's verdict, from this thread."""
        if self._hanging:
            # The watchdog is judging (the culprit's leaving caused this error): wait for it, so
            # the culprit stays the first to exit; with on_hang="exit" the watchdog ends the process.
            self._hang_over.wait(hang.leave_within_s() + 2.0)
        elif began and self._store is not None and self.world_size > 1 and hang.peer_gone(exc):
            self._emit_hang(time.perf_counter() - began, error=exc)

    def _publish_left(self) -> None:
        """Tell the peers this rank's loop is over (a hang that follows is blamed on its leaving)
        and, with on_hang="exit", keep answering their hang so that, named, it leaves first."""
        if self._store is None or self.world_size < 2:
            return
        try:
            self._store.set(keys.callback_left(self.rank), str(self._steps))
        except Exception:  # the store went away with its host: the job is over
            return
        if self.on_hang == "exit":
            with contextlib.suppress(RuntimeError):  # close() at interpreter exit: no new thread then
                threading.Thread(target=self._answer_after_leaving, name="ddpdoctor-left-watch", daemon=True).start()

    def _answer_after_leaving(self) -> None:
        exchange = hang.Exchange(self._store, self.rank, self.world_size, self._hangs + 1, self.host)
        try:
            while not exchange.started():
                time.sleep(2 * WATCH_TICK_S)
        except Exception:  # the store went away with the job: nothing left to answer
            return
        self._emit_hang(0.0)
