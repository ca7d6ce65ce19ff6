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
watchdog threads, through the job's store (callback/hang_watch.py; the verdict, callback/hang.py):
one verdict on every rank naming the rank that caused the hang and its victims. Nothing raises into
the training loop unless `raise_on_finding` asks for it, and then on every rank at the same step
(all ranks judge the same gathered table), so no rank is left waiting in the next all-reduce.

This module is the step and check flow; its parts live beside it: the readings of the job's
objects (user_objects.py), the comm hook's wait timer (wait_timer.py), the hang watch
(hang_watch.py) and a DataParallel model's GPUs (data_parallel.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from ddpdoctor.core import keys
from ddpdoctor.callback.data_parallel import DATA_PARALLEL_STEPS, DataParallelGpus
from ddpdoctor.callback.hang_watch import HangWatch
from ddpdoctor.callback.online_checks import (History, RankWindow, batch_scaling_finding, data_findings,
                                              data_parallel_finding, memory_growth, setup_findings)
from ddpdoctor.callback.metrics import MetricsSink
from ddpdoctor.callback.row import GatheredRow, contention_fields, pack, packed_length, unpack
from ddpdoctor.callback.step_clock import StepClock
from ddpdoctor.callback.user_objects import (default_store, fingerprint, first_tensor, gather_device, is_wrapped,
                                             learning_rates, safely, unsharded_sampler)
from ddpdoctor.callback.wait_timer import install_wait_timer, unmeasured_wait
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.history import recording
from ddpdoctor.measure import contention

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ddpdoctor")
MIN_COST_SHARE = 0.05
# Stragglers are judged on the kept windows once they hold this many steps: 8 windows of 10.
ONLINE_MIN_STEPS = 80


class FindingRaised(RuntimeError):
    """Raised into the loop only when `raise_on_finding` is set and a finding reaches it."""


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
        self._timer = install_wait_timer(model, measure_comm, self.distributed, self.world_size)
        self._dp = DataParallelGpus(model)
        self._dp_done = self._dp.ids is None
        self._emit_setup_findings(model, measure_comm)
        self._store = default_store()
        # Where each rank runs, its node and its CPU set: the verdicts need both (ranks on the same
        # cores time-share them; a neighbour on a rank's own cores is that rank's), and they travel
        # through the job's own store, read once per rank, not in every check's collective.
        cpus = contention.cpu_list(self._cpu.cpus)
        self._where: dict[int, tuple[str, Optional[str]]] = {self.rank: (self.host, cpus)}
        if self._store is not None:
            self._store.set(keys.callback_host(self.rank), json.dumps({"host": self.host, "cpus": cpus}))
            # So a peer can tell this rank dead or frozen when a hang finds it silent.
            self._store.set(keys.callback_pid(self.rank), json.dumps({"pid": os.getpid(), "host": self.host}))
        self._hang = HangWatch(self)  # the step watchdog, and the hang's verdict across ranks
        self._hang.start()
        self._closed = False
        atexit.register(self.close)

    def _emit_setup_findings(self, model: Any, measure_comm: bool) -> None:
        """What is wrong before the first step, from the objects given: reported at construction,
        so a job that would train for nothing hears of it at once."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        is_ddp = is_wrapped(model, DistributedDataParallel)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for finding in setup_findings(is_ddp, self.world_size, gpus, self.rank, self.host,
                                      unsharded_sampler(self.loader, self.sampler),
                                      data_parallel=self._dp.ids is not None,
                                      unmeasured_wait=unmeasured_wait(model, is_ddp, self._timer, measure_comm,
                                                                      self.distributed)):
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
            self._hang.after_collective_failure(exc, began)
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
        tensor = first_tensor(self._batch)
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

    @property
    def hang_deadline(self) -> dict[str, Any]:
        """How the allowance of the step called hung was set (empty until a hang)."""
        return self._hang.deadline

    def close(self) -> None:
        """Stop watching and write the final summary (once; also at interpreter exit if never called)."""
        if self._closed:
            return
        self._closed = True
        self._hang.stop()
        self._cpu.close()
        atexit.unregister(self.close)
        self._hang.publish_left()
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
        return (safely(self._known_loader_len), bool(safely(self._stale_epoch)),
                safely(lambda: int(self._peak_mem())), safely(self._batch_fingerprint))

    def _known_loader_len(self) -> Optional[int]:
        length = self._loader_len()
        return int(length) if length >= 0 else None

    def _batch_fingerprint(self) -> Optional[int]:
        return (fingerprint(self._batch) or None) if self._batch is not None else None

    def _rows(self, gathered: torch.Tensor) -> dict[int, RankWindow]:
        """The gathered tensor as every rank's window, keyed by rank, with its node's name."""
        rows = {}
        for values in gathered.cpu().reshape(self.world_size, -1).tolist():
            row = unpack(values)
            rows[row.rank] = row.to_window(*self._where_of(row.rank))
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
        scaling = batch_scaling_finding(batch, learning_rates(self.optimizer),
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

    def _where_of(self, rank: int) -> tuple[str, Optional[str]]:
        """(node, CPU set) of a rank, as it published them; ("rankN", None) until it has."""
        if rank not in self._where and self._store is not None:
            key = keys.callback_host(rank)
            try:
                if self._store.check([key]):
                    where = json.loads(self._store.get(key).decode("utf-8", "replace"))
                    self._where[rank] = (str(where["host"]), where.get("cpus"))
            except Exception:
                pass
        return self._where.get(rank, (f"rank{rank}", None))

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
            self._dp.sample()
        except Exception:  # a reading that fails is missing; it never stops the training
            pass
        if self._steps >= min(self.every, DATA_PARALLEL_STEPS):
            self._data_parallel_judge()

    def _data_parallel_judge(self) -> None:
        self._dp_done = True
        self._emit(data_parallel_finding(self._dp.gpus(), self._steps, self._columns["step"], self.rank, self.host),
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
