"""`Doctor`: the probes inside a user's own training loop, at negligible cost.

    doctor = ddpdoctor.Doctor(ddp_model, loader=loader)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            with doctor.step(batch):
                loss = ddp_model(batch).sum(); loss.backward(); optimizer.step()

Per step it only reads the CPU clock and appends to bounded lists: no GPU call, no
synchronisation, nothing inside DDP's backward (the gradient all-reduce's wait is read from
DDP's own reducer timings at the checks: callback/reducer_wait.py). At the first step, then
every `every` steps but no more often than every `check_every_s` seconds of training
(callback/schedule.py), it makes one collective of its own: an all_gather of one small
float64 tensor per rank holding the window's timings (its last WINDOW_CAP steps), a
fingerprint of the current batch, the loader's length, the sampler's epoch state and the
peak memory (callback/gather.py: under NCCL read one check late, never waited for).
Rank 0 judges (`online_checks`, and the `stragglers` probe's scores on the
same columns) and reports each new finding once: to the `ddpdoctor` logger, to a JSON file,
and to `on_finding`. A step that outlives its allowance is judged across ranks by the
watchdog threads, through the job's store (callback/hang_watch.py; the verdict, callback/hang.py):
one verdict on every rank naming the rank that caused the hang and its victims. Nothing raises into
the training loop unless `raise_on_finding` asks for it, and then on every rank at the same step
(all ranks judge the same gathered table), so no rank is left waiting in the next all-reduce.

This module is the step and check flow; its parts live beside it: the arguments (options.py),
the readings of the job's objects (user_objects.py), the reducer's wait (reducer_wait.py), the
gather and the batch's fingerprint (gather.py), the checks' schedule (schedule.py), the hang
watch (hang_watch.py) and a DataParallel model's GPUs (data_parallel.py).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Optional

from ddpdoctor.core import keys
from ddpdoctor.callback.buffers import BufferWatch
from ddpdoctor.callback.data_parallel import DATA_PARALLEL_STEPS, DataParallelGpus
from ddpdoctor.callback.final_check import Collected, FinalExchange, final_wait_s
from ddpdoctor.callback.gather import BatchPrint, Gather
from ddpdoctor.callback.hang_watch import HangWatch
from ddpdoctor.callback.loss_watch import LossWatch
from ddpdoctor.callback.online_checks import (History, RankWindow, RunHistory, batch_scaling_finding,
                                              data_findings, data_parallel_finding, memory_growth, setup_findings)
from ddpdoctor.callback.metrics import MetricsSink
from ddpdoctor.callback.options import DoctorOptions, store_file
from ddpdoctor.callback.reducer_wait import reducer_wait, unmeasured_wait
from ddpdoctor.callback.replicas import BYPASS_STEPS, END_MAX_MS, ReplicaWatch, bypass_finding
from ddpdoctor.callback.row import GatheredRow, contention_fields, pack, unpack
from ddpdoctor.callback.run_summary import RunLedger, summary
from ddpdoctor.callback.schedule import NEVER, next_check, slowest_step_s
from ddpdoctor.callback.step_clock import StepClock
from ddpdoctor.callback.trace_keep import HANG_CODES, TraceKeep
from ddpdoctor.callback.user_objects import (batch_len, default_store, gather_device, is_wrapped, learning_rates,
                                             safely, unsharded_sampler)
from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.history import recording
from ddpdoctor.judge import causal_order
from ddpdoctor.judge import losses as loss_judge
from ddpdoctor.judge.replicas import buffers_finding
from ddpdoctor.judge.replicas import findings as replica_findings
from ddpdoctor.measure import contention

log = logging.getLogger("ddpdoctor")
# A straggler the callback names must cost the job this share of its step at least: the probe's own 10%
# ("a 10% gap costs a synchronous job 10% of its time, which is worth a warning"). At 5%, 4 healthy ranks
# pinned two to a core named the two on one core (`compute`, 6% and 7% of a 7.6 ms step) in 1 run of 10.
MIN_COST_SHARE = 0.10
# Stragglers are judged on the kept windows once they hold this many steps (8 windows of 8), from
# at least MIN_JUDGED_CHECKS checks: a verdict rests on more than one stretch of the job.
ONLINE_MIN_STEPS = 64
MIN_JUDGED_CHECKS = 3
# A straggler verdict is said once the checks have named it for this long (seconds of the job, the slowest
# rank's windows summed from the gathered table, so every rank agrees): at the defaults (a check about every
# 2 s) that is the next check, as before; checked every few steps, it is several. Why: judged on 80 steps of
# 10 ms, two checks 20 steps apart share three quarters of their steps, so one rank's half-second hiccup on a
# shared VM (its best steps 20% slower, no CPU wait to see) was named a straggler by both: a healthy
# Hugging Face fit in CI, the second such alarm in about 130 healthy adapter fits recorded. A straggler that
# costs the job lasts.
CONFIRM_S = 2.0
# A check's row carries at most this many of the window's steps (the last ones), whatever `every`
# and the time between checks: what the callback keeps and sends does not grow with them.
WINDOW_CAP = 128
# The reducer's sample rate is set from the step times of the steps before this one (reducer_wait.py).
TUNE_STEP = 8
# The Doctors this process made, in order: every rank makes them alike, so the n-th one's end-of-run keys
# are the same on every rank (callback/final_check.py); and those not closed yet, for destroy_process_group.
_MADE = itertools.count()
_OPEN: "weakref.WeakSet[Doctor]" = weakref.WeakSet()
# How rank 0 prints the run summary: set from above this room (`ddpdoctor.Doctor`, the adapters) to
# render/run_summary.py's screen, since rendering sits above the callback; unset, the log line and JSON have it.
SUMMARY_PRINTER: Optional[Callable[[dict[str, Any], list[Finding], Optional[str]], None]] = None
# The page `html_path` asks for (render/html_report.py, a room above this one; ddpdoctor/__init__.py plugs it in):
# (path, this rank's JSON as `_write_json` writes it, the timeline's trace-event document or None).
HTML_WRITER: Optional[Callable[[str, dict[str, Any], Optional[dict[str, Any]]], Any]] = None


class FindingRaised(RuntimeError):
    """Raised into the loop only when `raise_on_finding` is set and a finding reaches it."""


class _Step:
    """`with doctor.step(batch):` without a generator: the step path is a few attribute reads."""

    __slots__ = ("_doctor", "loss")

    def __init__(self, doctor: Doctor) -> None:
        self._doctor = doctor
        self.loss: Any = None  # `with doctor.step(batch) as step: ... step.loss = loss`: watched at the step's end

    def __enter__(self) -> _Step:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        d = self._doctor
        if exc is None:
            d.step_end(self.loss)
            return
        # The loop's own error ends the step: no check (a collective other ranks may not reach),
        # and no hang report for a step that is over, unless a collective failed because a peer
        # is gone (gloo's "Connection closed by peer"): that is a hang's verdict.
        began, d._began = d._began, 0.0
        d._slow = ""
        d._hang.after_collective_failure(exc, began)


class _Expect:
    """`with doctor.expect_slow(what):` (see `Doctor.expect_slow`)."""

    __slots__ = ("_doctor", "_what", "_began")

    def __init__(self, doctor: Doctor, what: str) -> None:
        self._doctor, self._what, self._began = doctor, what, 0.0

    def __enter__(self) -> None:
        d = self._doctor
        inside = bool(d._began)
        d._slow = self._what
        if not inside:  # between steps: watched as a slow step of its own
            self._began = d._began = time.perf_counter()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        d = self._doctor
        if self._began:
            d._began = 0.0
            d._slow = ""
            d._finished.append(self._began - time.perf_counter())  # negative: a step marked slow


class Doctor:
    """Rank, world size and device come from the process group and the model, never from torchrun's
    variables, so a job started with mp.spawn (or any launcher) is watched the same way.

    Every argument but the job's objects is checked here (callback/options.py): a bad one is a
    ValueError saying what to give, before the first step."""

    def __init__(self, model: Any, optimizer: Any = None, loader: Any = None, sampler: Any = None, *,
                 every: int = 50, check_every_s: float = 2.0, step_deadline_s: float = 600.0,
                 json_path: Optional[str] = None, on_finding: Optional[Callable[[Finding], None]] = None,
                 raise_on_finding: bool = False, on_hang: str = "report", measure_comm: bool = True,
                 batch_size: Optional[int] = None, history: Optional[str] = None,
                 on_metrics: Optional[Callable[[dict[str, Any]], Any]] = None, tensorboard: Any = None,
                 summary: bool = True, trace_path: Optional[str] = None, html_path: Optional[str] = None) -> None:
        import torch
        import torch.distributed as dist

        # The judges' modules, now: imported at the first straggler verdict they cost 0.4 s inside a step.
        import ddpdoctor.probes.stragglers.scores  # noqa: F401

        opts = DoctorOptions(every=every, check_every_s=check_every_s, step_deadline_s=step_deadline_s,
                             json_path=json_path, on_finding=on_finding, raise_on_finding=raise_on_finding,
                             on_hang=on_hang, measure_comm=measure_comm, batch_size=batch_size, history=history,
                             on_metrics=on_metrics, tensorboard=tensorboard, summary=summary, trace_path=trace_path,
                             html_path=html_path)
        _check_objects(model, optimizer)
        self.options = opts
        # The step deadline is learned from the job's own steps; step_deadline_s is its ceiling. The
        # step path only appends each step's duration to `_finished` (negative: marked slow); the
        # watchdog thread feeds them to the clock and asks it for the running step's allowance.
        self._clock = StepClock(opts.step_deadline_s)
        self._finished: deque[float] = deque(maxlen=4096)
        self._slow = ""  # what the running step was marked slow for ("" when it was not)
        self.every = opts.every
        self.check_every_s = opts.check_every_s
        self.deadline_s = self._clock.ceiling_s
        self.json_path = opts.json_path
        self.on_finding = opts.on_finding
        self.raise_on_finding = opts.raise_on_finding
        self.on_hang = opts.on_hang
        self._metrics = MetricsSink(opts.on_metrics, opts.tensorboard)  # each check's numbers out (docs/fleet.md)
        # --history's store (or DDPDOCTOR_HISTORY): rank 0 appends the run at close (docs/fleet.md).
        self.history = store_file("DDPDOCTOR_HISTORY", recording.store_path(opts.history, os.environ))
        self._started_at = time.time()
        self._epoch_less_perf = self._started_at - time.perf_counter()  # a perf_counter reading as wall clock
        self._gather_left = 0.0  # when this rank left the last check's gather (perf_counter)
        self._check_began = 0.0  # and when that check began
        self.loader = loader
        self.optimizer = optimizer
        self.batch_size = opts.batch_size
        self.sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.trace_path = opts.trace_path
        self.html_path = opts.html_path
        # Rank 0 keeps the windows for a timeline: a trace file's, or the page's.
        self._trace = TraceKeep(self.world_size) if (self.trace_path or self.html_path) and self.rank == 0 else None
        self.host = os.uname().nodename
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, tuple[int, ...]]] = set()
        self._lock = threading.Lock()
        self._same_batch_checks = 0  # consecutive checks where every rank had the same batch
        # Straggler verdicts of the last check, each with the job's time (`_job_s`) at the first check of the
        # run of checks that has named it since.
        self._named_since: dict[tuple[str, tuple[int, ...]], float] = {}
        self._job_s = 0.0  # the slowest rank's windows, summed over the checks (from the gathered tables)
        self._history = History(keep=max(MIN_JUDGED_CHECKS + 1, -(-ONLINE_MIN_STEPS // min(self.every, WINDOW_CAP))),
                                device=self.device.type)
        # Rank 0's memory of the whole run, for the end of the run (`_finish`): windows spread over it, bounded
        # by steps, and every rank's figures folded from each table (callback/run_summary.py).
        self._run = RunHistory(device=self.device.type)
        self._ledger = RunLedger()
        self.summary: Optional[dict[str, Any]] = None  # the run summary, once the run has ended (rank 0)
        self._show_summary = opts.summary
        self._instance = next(_MADE)
        self._step_s: Optional[float] = None  # the slowest rank's mean step at the last check
        self._last_steps: dict[int, int] = {}  # each rank's steps done at the last check
        self._end_evidence: Optional[dict[str, Any]] = None  # what the end's straggler verdict rested on
        self._end_replicas: Optional[dict[str, Any]] = None  # whether the end compared the replicas, and what it saw
        self._cpu = contention.Window(corunners="when_lost")  # the CPU this thread gets, per window
        self._steps = 0
        # The window's last WINDOW_CAP steps, per step: begin to end, end of the previous to begin, samples.
        self._step_ms: deque[float] = deque(maxlen=WINDOW_CAP)
        self._data_ms: deque[float] = deque(maxlen=WINDOW_CAP)
        # Per step, the part of the time before it that the framework spent waiting in its own collective
        # (framework_wait): waiting for peers, not loading. Zero for a plain loop.
        self._between_ms: deque[float] = deque(maxlen=WINDOW_CAP)
        self._between_pending = 0.0
        self._samples: deque[float] = deque(maxlen=WINDOW_CAP)
        self._window_from = 0  # the steps done at the last check, and when it ended
        self._window_began = time.perf_counter()
        self._began = 0.0
        self._last_end = 0.0
        self._first_end = 0.0
        self._batch: Any = None
        # Its first dimension, read as the step begins (the loop has just touched the batch: its tensor is in
        # cache; after backward it is not, and the same read cost 10 µs); -1: read at the step's end instead.
        self._batch_n = -1.0
        self._epoch0 = getattr(self.sampler, "epoch", None)
        self._next_check = 1 if self.distributed else NEVER
        self._first_row_step = 0  # the steps_done of the first row judged (the setup check's)
        # NCCL gathers CUDA tensors on the rank's own GPU, which is the model's: the mp.spawn tutorial
        # moves the model with .to(rank) and never calls set_device, so "current device" would be
        # cuda:0 on every rank (NCCL's "Duplicate GPU detected"). Other backends take CPU tensors.
        nccl = self.distributed and dist.get_backend() == "nccl"
        self._gather = Gather(self.world_size, gather_device(nccl, self.device))
        self._print = BatchPrint()
        self._wait = reducer_wait(model, opts.measure_comm, self.distributed, self.device.type)
        self._replicas = ReplicaWatch(model, optimizer, self.world_size, self._gather.device, self._gather.late)
        self._bypass_said = False
        self._buffers = BufferWatch(self._replicas.ddp, self.world_size, self._gather.device, self._gather.late)
        self._loss = LossWatch()  # the first step whose loss was non-finite (given to step_end)
        self._loss_firsts: dict[int, Optional[int]] = {}  # per rank, from the last gathered table
        self._dp = DataParallelGpus(model)
        self._dp_done = self._dp.ids is None
        self._dp_steps: list[float] = []
        self._emit_setup_findings(model, opts.measure_comm)
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
        self._before_close: list[Callable[[], None]] = []
        atexit.register(self.close)
        _OPEN.add(self)
        _close_before_destroy()

    @property
    def wait_measured(self) -> bool:
        """The gradient all-reduce's wait is read from DDP's reducer (False: FSDP, measure_comm=False)."""
        return self._wait is not None

    def _emit_setup_findings(self, model: Any, measure_comm: bool) -> None:
        """What is wrong before the first step, from the objects given: reported at construction,
        so a job that would train for nothing hears of it at once."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        is_ddp = is_wrapped(model, DistributedDataParallel)
        self._is_ddp = isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for finding in setup_findings(is_ddp, self.world_size, gpus, self.rank, self.host,
                                      unsharded_sampler(self.loader, self.sampler),
                                      data_parallel=self._dp.ids is not None,
                                      unmeasured_wait=unmeasured_wait(model, is_ddp, self._wait, measure_comm,
                                                                      self.distributed)):
            self._emit(finding)
        if self.distributed:
            for finding in self._replicas.setup_findings(self.rank, self.host):
                self._emit(finding)
        self._emit_limits(gpus)

    def _emit_limits(self, gpus: int) -> None:
        """The node's limits against this job (its loader's workers known here), said once per node
        (local rank 0); never raised, even with raise_on_finding: the job has not failed, and a
        reading must never break it (docs/probes/limits.md)."""
        if os.environ.get("LOCAL_RANK", "0") not in ("", "0"):
            return
        try:
            from ddpdoctor.probes.limits.probe import job_findings

            found = job_findings(self.rank, self.world_size, self.host, gpus, self.loader)
        except Exception:  # a reading on an exotic platform: the job goes on without it
            log.debug("ddpdoctor: limits not read", exc_info=True)
            return
        for finding in found:
            self._emit(finding, may_raise=False)

    # -- the loop's side: a few microseconds a step, nothing that waits for a GPU ----------------
    def step(self, batch: Any = None, slow: bool = False) -> _Step:
        """One training step; `slow=True` marks one known to be slow (it evaluates, it saves a checkpoint),
        which is given a longer allowance before it is called hung (docs/callback.md)."""
        self.step_begin(batch, slow)
        return _Step(self)

    def step_begin(self, batch: Any = None, slow: bool = False) -> None:
        now = time.perf_counter()
        # Every step is timed (the last WINDOW_CAP are kept): the run may end before the next check, and its
        # last window is judged at the end (`_finish`).
        gap = (now - self._last_end) * 1e3 if self._last_end else 0.0
        between = min(self._between_pending, gap)
        self._data_ms.append(gap - between)
        self._between_ms.append(between)
        self._batch = batch
        self._batch_n = batch_len(batch) if batch is not None else -1.0
        self._between_pending = 0.0
        if slow:
            self._slow = "step marked slow"
        self._began = now  # last: the watchdog reads it, with _slow

    @property
    def steps_done(self) -> int:
        return self._steps

    @property
    def in_step(self) -> bool:
        """Between step_begin and step_end (a framework's hook on the model asks: callback/model_tap.py)."""
        return bool(self._began)

    def before_close(self, fn: Callable[[], None]) -> None:
        """`fn()` first thing at the end of the run, whoever ends it (close(), destroy_process_group(), interpreter
        exit): what an attachment could not see is told (`tell`) before the end judges and summarises."""
        self._before_close.append(fn)

    def tell(self, found: list[Finding]) -> None:
        """Findings an adapter made of what it saw, or could not see, of its framework (Hugging Face's loss
        computed outside the model: DOC020): reported as this Doctor's own, by rank 0, never raised."""
        self._take_new(found, may_raise=False)

    def framework_wait(self, ms: float) -> None:
        """Time the framework spent between steps in a collective of its own (Lightning broadcasts a flag
        from rank 0 before every batch): its peers' lateness, which would otherwise read as this rank's
        data loading and hide a straggler from the judge. Counted with the next step's wait."""
        self._between_pending += ms

    def see_batch(self, batch: Any) -> None:
        """The step's batch, where the framework shows it to the model only (Hugging Face's Trainer): the
        first one given in a step counts, as `step_begin(batch)` would have taken it."""
        if self._batch is None:
            self._batch = batch
            self._batch_n = -1.0

    def step_end(self, loss: Any = None) -> None:
        """The step is over (after optimizer.step()). `loss`: the step's loss (a tensor or a number), watched
        for the first non-finite value on each rank (callback/loss_watch.py): never read back from a GPU here."""
        now = time.perf_counter()
        began = self._began
        if not began:  # no step_begin before it (or the step already ended): nothing to time
            return
        steps = self._steps = self._steps + 1
        try:
            if loss is not None:
                self._loss.see(loss, steps)
            if self._replicas.per_step:  # a step long enough to afford a fingerprint of the weights (replicas.py)
                self._replicas.record(steps)
        except Exception as exc:  # a loss or a weight of a kind we cannot read: stop that watch, never the job
            log.warning("ddpdoctor: watching the loss or weights failed on rank %d: %s: %s", self.rank,
                        type(exc).__name__, exc)
            self._loss.off = True
            self._replicas.per_step = False  # the ring's gaps are then bracketed by checks, never guessed
            self._replicas.recorded_from = None
        self._step_ms.append((now - began) * 1e3)
        # 0: not known (no batch given, or a scalar): DOC010 is then not said rather than guessed.
        n = self._batch_n
        self._samples.append(n if n >= 0.0 else batch_len(self._batch))
        try:
            if steps == self._next_check:
                self._check()  # still inside the step for the watchdog: a stuck gather is a stuck step
            if steps == TUNE_STEP and self._wait is not None:  # the mean step since the first one ended
                self._wait.tune((time.perf_counter() - self._first_end) * 1e3 / (TUNE_STEP - 1))
            if not self._dp_done:
                self._data_parallel_step()
        finally:
            # Also when a check raised (raise_on_finding): a step that is over must not be taken for a hang.
            self._began = 0.0
            # The batch is kept until the next step replaces it (the loop's own variable holds it as long), so
            # the end of the run can fingerprint the last one (DOC001); released at close.
            self._last_end = end = time.perf_counter()
            if steps == 1:
                self._first_end = end
            # The whole step as the watchdog saw it, check included, teaches the clock (negative: marked slow).
            self._finished.append(end - began if not self._slow else began - end)
            self._slow = ""

    def allowance_s(self) -> float:
        """The running step's allowance before it is called hung: asked by the watchdog thread, which
        alone feeds the clock the steps finished since it last asked."""
        finished = self._finished
        clock = self._clock
        while finished:
            seconds = finished.popleft()
            clock.finished(abs(seconds), slow=seconds < 0)
        return clock.allowance_s(slow=bool(self._slow))

    def expect_slow(self, what: str = "slow work") -> _Expect:
        """Code known to be slow (`with doctor.expect_slow("checkpoint"): save(...)`): a longer allowance.

        Inside a step, the step is marked slow from here on. Between steps, the block is watched
        as a slow step of its own (a checkpoint stuck in a collective is a hang too), not
        counted as a training step. `what` is named in the hang report."""
        return _Expect(self, what)

    def report(self) -> list[Finding]:
        """Every finding so far, worst first, on this rank (rank 0 holds the gathered ones)."""
        return causal_order.ordered(self.findings, keep_order=True)

    @property
    def hang_deadline(self) -> dict[str, Any]:
        """How the allowance of the step called hung was set (empty until a hang)."""
        return self._hang.deadline

    def __enter__(self) -> Doctor:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.close()

    def close(self) -> None:
        """End of the run: the final check, the whole run judged, the summary (once; also from
        `dist.destroy_process_group()` and at interpreter exit if never called). Bounded in time: a rank
        that never arrives costs rank 0 at most FINAL_WAIT_CAP_S, and nothing here raises into the job."""
        if self._closed:
            return
        self._closed = True
        for fn in self._before_close:
            try:
                fn()
            except Exception:  # a bug of ours must not fail the job's exit
                log.debug("ddpdoctor: a before-close call failed", exc_info=True)
        _OPEN.discard(self)
        self._hang.stop()
        self._buffers.close()
        atexit.unregister(self.close)
        self._hang.publish_left()
        if not self._dp_done and self._steps:
            self._data_parallel_judge()
        self._judge_last_gather()
        try:
            self._finish()
        except Exception as exc:  # a bug of ours must not fail the job's exit; the report is still written
            log.warning("ddpdoctor: the end-of-run check failed on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
        self._cpu.close()
        self._batch = None
        timeline = self._timeline()  # once, for the trace file and the page
        self._write_trace(timeline)
        if self.rank == 0 and self.history:
            recording.record_callback(self.history, self._history.windows, self.findings,
                                      world_size=self.world_size, started_at=self._started_at)
        if self.json_path and (self.rank == 0 or self.findings):
            self._write_json(self.json_path)  # the last word: the steps done, every finding, the summary
        if self.rank == 0 and self.html_path:
            self._write_html(self.html_path, timeline)
        if self.rank != 0 and not self.findings:
            return
        found = self.report()
        worst = found[0].severity if found else Severity.OK
        log.warning("ddpdoctor: rank %d, %d steps: %s", self.rank, self._steps,
                    "no findings" if not found else
                    f"{len(found)} finding(s), worst {worst.label}: "
                    + "; ".join(f"{f.code} {f.title}" for f in found[:5]))
        if self.rank == 0 and self.summary is not None and self._show_summary and SUMMARY_PRINTER is not None:
            try:
                SUMMARY_PRINTER(self.summary, found, self.json_path)
            except Exception:  # a terminal we cannot write to: the JSON and the log line have it
                log.debug("ddpdoctor: the summary was not printed", exc_info=True)

    # -- at the end of the run: one exchange through the store, the whole run judged -------------
    def _finish(self) -> None:
        """The final check: this rank's last window (the steps since the last check) to rank 0 through the
        job's store (callback/final_check.py), never a collective; rank 0 judges the last table and the whole
        run's kept windows with the checks' own rules, names a rank that did not come, and makes the summary.
        A rank whose row cannot be sent says what it knows alone (its sampler's epoch, its loss)."""
        row = self._take_window(final=True)
        collected: Optional[Collected] = None
        exchange: Optional[FinalExchange] = None
        sent = False
        if self.distributed and self.world_size > 1 and self._store is not None:
            exchange = FinalExchange(self._store, self.rank, self.world_size, self._instance, self.host)
            try:
                exchange.publish(pack(row, WINDOW_CAP), self._replica_at_end())
                sent = True
                if self.rank == 0:
                    collected = exchange.collect(final_wait_s(self._step_s), self._last_steps)
            except Exception as exc:  # the store went away with its host: judged on what this rank knows
                log.warning("ddpdoctor: rank %d could not trade its last window: %s: %s", self.rank,
                            type(exc).__name__, exc)
        if self.rank != 0:
            if not sent:
                self._judge_alone(row)
            return
        rows = {r: unpack(values) for r, values in (collected.rows if collected else {}).items()}
        rows[self.rank] = row
        if collected is None and self.world_size > 1:  # no exchange at all: this rank's own facts only
            self._judge_alone(row)
            rows = {self.rank: row}
        windows = {r: r_row.to_window(*self._where_of(r)) for r, r_row in rows.items()}
        self._job_s += slowest_window_s(rows)
        self._fold(rows, windows)
        found = self._data_at_end(windows, fresh=row.window_steps > 0) if len(rows) > 1 else []
        found += memory_growth(self._run) + self._run_stragglers(windows)
        missing = collected.missing if collected is not None else {}
        if missing:
            found.append(missing_finding(missing, sorted(rows), {r: w.host for r, w in windows.items()},
                                         collected.waited_s if collected else 0.0))
        self._take_new(found, may_raise=False)
        if len(rows) > 1:
            self._judge_losses(rows, windows, may_raise=False)
        if collected is not None and exchange is not None:
            self._compare_replicas_at_end(exchange, rows, windows)
        how = {r: m.how for r, m in missing.items()}
        if collected is None and self.world_size > 1:
            how = {r: "no exchange" for r in range(self.world_size) if r != self.rank}
        self.summary = summary(self._ledger, self.report(), self.world_size, time.time() - self._started_at, how,
                               collected.waited_s if collected else 0.0, self._job_s, self._end_evidence,
                               self._end_replicas)

    def _replica_at_end(self) -> Optional[tuple[str, str]]:
        """This rank's replica for the end's comparison (callback/replicas.py), or None (nothing to compare)."""
        try:
            return self._replicas.end_payload()
        except Exception as exc:  # a bug of ours must not fail the job's exit: the row is still sent
            log.warning("ddpdoctor: rank %d could not read its replica at the end: %s: %s", self.rank,
                        type(exc).__name__, exc)
            return None

    def _compare_replicas_at_end(self, exchange: FinalExchange, rows: dict[int, GatheredRow],
                                 windows: dict[int, RankWindow]) -> None:
        """The replicas compared once more at the end (a run shorter than a check, or the steps since the last
        comparison): every rank's fingerprint, and only where they differ the details, judged with the checks'
        own rules (judge/replicas.py). Only where every rank arrived at the same step: weights a step apart
        differ by design, and a missing rank is the verdict then."""
        steps = {r.steps_done for r in rows.values()}
        why = None
        if self._replicas.first_seen_step is not None:
            why = "named at a check"
        elif self._replicas.done:
            why = "not compared: not DDP, one rank, no optimizer, or a comparison failed"
        elif len(rows) < self.world_size:
            why = "not compared: a rank is missing"
        elif len(steps) != 1:
            why = "not compared: the ranks ended at different steps"
        if why is not None:
            self._end_replicas = {"compared": False, "why": why}
            return
        step = steps.pop()
        ranks = list(range(self.world_size))
        prints = exchange.replica_parts(ranks, "fingerprint")
        if len(prints) < self.world_size:
            self._end_replicas = {"compared": False, "why": f"not compared: a comparison costs more than {END_MAX_MS:.0f} ms"}
            return
        equal = len(set(prints.values())) == 1
        self._end_replicas = {"compared": True, "equal": equal, "step": step}
        if equal:
            self._replicas.last_equal_step = step
            return
        details = exchange.replica_parts(ranks, "detail")
        if len(details) < self.world_size:
            return
        hosts = {r: w.host for r, w in windows.items()}
        comparison, seen = self._replicas.compare_at_end(details, step)
        bypassed = any(r.reducer_iteration == 0 and r.steps_done >= BYPASS_STEPS for r in rows.values())
        found = replica_findings(comparison, replace(seen, bypassed_ddp=bypassed,
                                                     nonfinite_loss=loss_judge.said(self._loss_firsts)), hosts)
        for f in found:
            f.evidence["judged_at_end"] = {"step": step}
        self._take_new(found, may_raise=False)

    def _judge_alone(self, row: GatheredRow) -> None:
        """What one rank knows without its peers: a sampler whose epoch never moved, its own first non-finite loss."""
        window = row.to_window(self.host)
        found = [f for f in data_findings({self.rank: window}) if f.code == "DOC003"]
        first = row.loss_nonfinite_step
        if first is not None:
            said = loss_judge.finding({self.rank: first}, {self.rank: self.host}, at_step=self._steps)
            found += [said] if said is not None else []
        for finding in causal_order.ordered(found, keep_order=True):
            self._emit(finding, may_raise=False)

    def _data_at_end(self, windows: dict[int, RankWindow], fresh: bool) -> list[Finding]:
        """The data rules on the last table. DOC001 needs the same batch at two checks in a row: the last check's,
        and the end's where a step ran since (else it is the same batch, seen twice)."""
        found = data_findings(windows)
        same = fresh and any(f.code == "DOC001" for f in found)
        if not (same and self._same_batch_checks >= 1):
            found = [f for f in found if f.code != "DOC001"]
        return found

    def _run_stragglers(self, windows: dict[int, RankWindow]) -> list[Finding]:
        """The `stragglers` probe's verdict on the whole run's kept windows (RunHistory), with the live rule's cost
        bar; judged once they hold ONLINE_MIN_STEPS steps and stand for CONFIRM_S of the job. The scorer cuts them
        into windows and asks a rank to be slow in most: a hiccup of one stretch is not a straggler, and more
        steps only make its windows longer."""
        from ddpdoctor.probes.base import RunView
        from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

        facts = self._run.facts()
        self._end_evidence = {"judged": False, "steps_per_rank": self._run.steps(), "windows": len(self._run.windows),
                              "job_s": round(sum(self._run.job_s), 2), "needs_steps": ONLINE_MIN_STEPS,
                              "needs_s": CONFIRM_S}
        if len(facts) < 2 or self._run.steps() < ONLINE_MIN_STEPS or sum(self._run.job_s) < CONFIRM_S:
            return []
        self._end_evidence["judged"] = True
        run = RunView(world_size=self.world_size, hosts={r: w.host for r, w in windows.items()})
        judged = [f for f in diagnose_stragglers(facts, run) if worth_naming_online(f)]
        for f in judged:
            f.evidence["judged_at_end"] = {"steps_per_rank": self._run.steps(), "windows": len(self._run.windows),
                                           "job_s": round(sum(self._run.job_s), 2)}
        return judged

    def _fold(self, rows: dict[int, GatheredRow], windows: dict[int, RankWindow]) -> None:
        """Rank 0 keeps the run: every table into the ledger, windows of more than one step into the run's."""
        if self.rank != 0 or not rows:
            return
        self._ledger.add(rows, {r: w.host for r, w in windows.items()})
        if self._trace is not None:
            self._trace.add(rows, {r: w.host for r, w in windows.items()})
        if min(len(w.step_ms) for w in windows.values()) > 1:
            self._run.add(windows, slowest_window_s(rows))

    # -- at the checks: one collective ---------------------------------------------------
    def _check(self) -> None:
        """Gather every rank's window, judge the table, report what is new, agree on the next check.

        Every rank judges the same table the same way, so a raise (when asked for) happens on
        every rank at the same step, and every rank computes the same next check; only rank 0 reports."""
        began = time.perf_counter()
        row = self._take_window()
        gathered = self._gather.exchange(pack(row, WINDOW_CAP))
        self._gather_left, self._check_began = time.perf_counter(), began
        rows = self._rows(gathered) if gathered is not None else {}  # None: a GPU's first check, read at the next
        step_s = slowest_step_s((r.window_steps, r.window_s) for r in rows.values())
        self._next_check = next_check(self._steps, self.every, self.check_every_s, step_s)
        self._step_s = step_s if step_s is not None else self._step_s
        self._last_steps = {r: row.steps_done for r, row in rows.items()} or self._last_steps
        windows = {r: row.to_window(*self._where_of(r)) for r, row in rows.items()}
        self._job_s += slowest_window_s(rows)
        self._fold(rows, windows)
        if rows:
            self._judge_rows(windows)
            self._judge_losses(rows, windows)
        self._compare_replicas(rows, windows)

    def _judge_losses(self, rows: dict[int, GatheredRow], windows: dict[int, RankWindow], may_raise: bool = True) -> None:
        """DOC018: which rank's loss went non-finite first (judge/losses.py), from the gathered table."""
        self._loss_firsts = {r: row.loss_nonfinite_step for r, row in rows.items()}
        found = loss_judge.finding(self._loss_firsts, {r: w.host for r, w in windows.items()},
                                   at_step=max((row.steps_done for row in rows.values()), default=None))
        if found is not None:
            self._take_new([found], may_raise)

    def _compare_replicas(self, rows: dict[int, GatheredRow], windows: dict[int, RankWindow]) -> None:
        """Every rank's replica against the others' (callback/replicas.py), when due: decided from the
        gathered table, so every rank takes part in the same collectives at the same check."""
        window_s = slowest_window_s(rows)
        slowest = max((r.digest_ms for r in rows.values()), default=0.0)
        if any(r.replicas_off for r in rows.values()):  # a rank's comparison failed: every rank stops comparing
            self._replicas.done = self._buffers.done = True
            self._replicas.per_step = False
        bypassed = bool(rows) and self._wait is not None and any(
            r.reducer_iteration == 0 and r.steps_done >= BYPASS_STEPS for r in rows.values())
        found: list[Finding] = []
        if bypassed and not self._bypass_said:
            self._bypass_said = True
            found.append(bypass_finding(rows, {r: w.host for r, w in windows.items()}))
        step_ms = max((1e3 * r.window_s / r.window_steps for r in rows.values() if r.window_steps > 0), default=0.0)
        hosts = {r: w.host for r, w in windows.items()} or {self.rank: self.host}
        try:
            due = self._replicas.due(window_s, slowest)
            result = self._replicas.check(self._steps, due)
            self._replicas.plan_per_step(self._steps, max((r.fingerprint_ms for r in rows.values()), default=0.0),
                                         step_ms)
            stashed = {(r.buffers_step, r.buffers_count) for r in rows.values()}
            if len(stashed) > 1:  # the ranks read different forwards (one did not broadcast): read again, alike
                self._buffers.drop()
            agreed = next(iter(stashed))[0] if len(stashed) == 1 else None
            buffers = self._buffers.compare(agreed)
            if buffers is not None:
                found.append(buffers_finding(buffers.step, buffers.names, buffers.groups, buffers.never_broadcast,
                                             buffers.ignored, hosts))
            if due:
                self._buffers.arm(self._steps)
        except Exception as exc:  # a bug of ours must not end the user's job (every rank runs the same code)
            log.warning("ddpdoctor: comparing replicas failed on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
            # This rank stops, and says so in its next row (replicas_off), so every rank stops at the same check.
            self._replicas.done = self._replicas.failed = self._buffers.done = True
            self._replicas.per_step = False
            return
        if result is not None:
            comparison, seen = result
            found += replica_findings(comparison, replace(seen, bypassed_ddp=bypassed,
                                                          nonfinite_loss=loss_judge.said(self._loss_firsts)), hosts)
        if found:
            self._take_new(found)

    def _judge_rows(self, rows: dict[int, RankWindow], may_raise: bool = True) -> None:
        try:
            found = self._judge(rows)
        except Exception as exc:  # a bug of ours must not end the user's job
            log.warning("ddpdoctor: judging failed on rank %d: %s: %s", self.rank, type(exc).__name__, exc)
            return
        if self.rank == 0 and self._metrics.wanted:
            self._metrics.publish_window(self._steps, rows, self._history)
        self._take_new(found, may_raise)

    def _judge_last_gather(self) -> None:
        """A GPU's last gather, still unread at close: judged (on every rank alike), never raised."""
        try:
            gathered = self._gather.flush()
        except Exception:  # the job's process group is already gone
            return
        if gathered is not None:
            rows = self._rows(gathered)
            windows = {r: row.to_window(*self._where_of(r)) for r, row in rows.items()}
            self._job_s += slowest_window_s(rows)
            self._fold(rows, windows)
            self._judge_rows(windows, may_raise=False)
            self._judge_losses(rows, windows, may_raise=False)

    def _take_window(self, final: bool = False) -> GatheredRow:
        """This rank's window as a row, and a new window begun: at a check, and at the end of the run."""
        row = self._window_row(final)
        for column in (self._step_ms, self._data_ms, self._between_ms, self._samples):
            column.clear()
        self._window_from = self._steps
        self._window_began = time.perf_counter()
        return row

    def _window_row(self, final: bool = False) -> GatheredRow:
        """This rank's window (its last WINDOW_CAP steps) and its local facts, as one row of the gather.
        `final`: the end of the run's, whose batch is fingerprinted now (a GPU's too: off the step path)."""
        steps = list(self._step_ms)
        data = list(self._data_ms)[-len(steps):] if steps else []
        between = list(self._between_ms)[-len(steps):] if steps else []
        wait = self._wait.take() if self._wait is not None else None
        wait_ms = wait.mean_ms if wait is not None and wait.mean_ms is not None else 0.0
        # The reducer gives the window's mean wait, not each step's: each step gets the window's share
        # of its length (a short step, a short wait), so its work (step minus wait) is never negative and
        # the windows' low quantiles compare like with like. Step minus the mean would make a quick
        # step's work negative, and the straggler's score with it (seen: -500% for a rank 4x slower).
        share = min(1.0, wait_ms / (sum(steps) / len(steps))) if steps and sum(steps) > 0 else 0.0
        loader_len, stale, peak, fingerprint = self._local_facts(final)
        window_s = time.perf_counter() - self._window_began
        return GatheredRow(rank=self.rank, steps_done=self._steps, loader_len_batches=loader_len,
                           stale_epoch=stale, peak_mem_bytes=peak, batch_fingerprint=fingerprint,
                           wait_measured=self._wait is not None, wait_samples=wait.samples if wait else 0,
                           window_steps=self._steps - self._window_from, window_s=window_s,
                           digest_ms=self._replicas.digest_ms, fingerprint_ms=self._replicas.fingerprint_ms,
                           buffers_step=self._buffers.stash_step, buffers_count=self._buffers.stash_count,
                           loss_nonfinite_step=safely(lambda: self._loss_first(final)),
                           replicas_off=self._replicas.done and self._replicas.failed,
                           reducer_iteration=self._wait.iteration if self._wait is not None else -1,
                           # A framework's wait between steps joins the step as waiting (zero in a plain loop).
                           step_ms=[step + b for step, b in zip(steps, between)], data_ms=data,
                           wait_ms=[share * step + b for step, b in zip(steps, between)],
                           samples=list(self._samples)[-len(steps):] if steps else [],
                           last_end_s=self._ended_s(),
                           gather_left_s=self._gather_left + self._epoch_less_perf if self._gather_left else 0.0,
                           check_began_s=self._check_began + self._epoch_less_perf if self._check_began else 0.0,
                           **contention_fields(self._cpu.take(wait_s=(wait_ms * len(steps) + sum(between) + sum(data))
                                                              / 1e3)))

    def _ended_s(self) -> float:
        """When this rank's last step ended, as wall clock (0: none yet). A check runs inside its step, before
        `_last_end` is set: that step ended where its length, just appended, says."""
        if self._began and self._step_ms:
            ended = self._began + self._step_ms[-1] / 1e3
        else:
            ended = self._last_end
        return ended + self._epoch_less_perf if ended else 0.0

    def _take_new(self, found: list[Finding], may_raise: bool = True) -> None:
        """Findings not seen before: rank 0 reports them, the others only remember them; then
        the raise, if asked for, on every rank alike (the judges saw the same table)."""
        # Causes first, worst first, in the log too (judge/causal_order.py: what explains what).
        new = causal_order.ordered([f for f in found if (f.code, f.ranks) not in self._seen], keep_order=True)
        for finding in new:
            if self.rank == 0:
                self._emit(finding, may_raise=False)
            else:
                self._seen.add((finding.code, finding.ranks))
        if may_raise and self.raise_on_finding and any(f.severity >= Severity.WARN for f in new):
            raise FindingRaised(f"{new[0].code}: {new[0].title}")

    def _loss_first(self, final: bool) -> Optional[int]:
        """The first non-finite loss step known; at the end a GPU's last scan is launched and read at once."""
        first = self._loss.take(self._steps)
        return self._loss.take(self._steps) if final and first is None else first

    def _local_facts(self, final: bool = False) -> tuple[Optional[int], bool, Optional[int], Optional[int]]:
        """Loader length, stale epoch, peak memory, batch fingerprint: unknown where a reading fails,
        because a rank that raised here would never join the gather its peers wait in."""
        fingerprint = self._print.take_now if final else self._print.take
        return (safely(self._known_loader_len), bool(safely(self._stale_epoch)),
                safely(lambda: int(self._peak_mem())), safely(lambda: fingerprint(self._batch)))

    def _known_loader_len(self) -> Optional[int]:
        length = self._loader_len()
        return int(length) if length >= 0 else None

    def _rows(self, gathered: list[list[float]]) -> dict[int, GatheredRow]:
        """The gathered table as every rank's row, keyed by rank."""
        rows = {}
        for values in gathered:
            row = unpack(values)
            rows[row.rank] = row
        return rows

    def _judge(self, rows: dict[int, RankWindow]) -> list[Finding]:
        """Every online check on one gathered table; DOC001 only once it repeats."""
        found = data_findings(rows)
        first = next(iter(rows.values())).step
        if not self._first_row_step:
            self._first_row_step = first
            if self.optimizer is not None:  # once: the first gathered step shows the batch
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
        """The `stragglers` probe's verdict on the kept windows, once they hold enough steps of enough
        checks, and only a verdict whose run of checks (`named_since`) has lasted CONFIRM_S of the job (two
        checks at least): a rank named in one stretch of the job and not the next is the job's noise (a
        scheduler's draw, a hiccup of the host), not a straggler.

        In a live job a straggler must also cost something: tiny steps make a few percent of
        noise look like a rank, and a rank that costs under MIN_COST_SHARE of a step is not worth a page.
        Here a step is only data (before step_begin) and work inside the step, so a real
        straggler's extra time shows in one of them; extra time in neither ("host overhead")
        is noise between medians, not a rank."""
        from ddpdoctor.probes.base import RunView
        from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

        facts = self._history.facts()
        if (len(self._history.windows) < MIN_JUDGED_CHECKS or not facts
                or min(len(f["steps"]["step_ms"]) for f in facts.values()) < ONLINE_MIN_STEPS):
            return []
        run = RunView(world_size=self.world_size, hosts={r: row.host for r, row in rows.items()})
        judged = diagnose_stragglers(facts, run)
        self._named_since = named_since(self._named_since, judged, self._job_s)
        return [f for f in judged if worth_naming_online(f) and said(self._named_since, f, self._job_s)]

    def _where_of(self, rank: int) -> tuple[str, Optional[str]]:
        """(node, CPU set) of a rank, as it published them; ("rankN", None) until it has."""
        if rank not in self._where and self._store is not None:
            key = keys.callback_host(rank)
            try:
                if self._store.check([key]):
                    where = json.loads(self._store.get(key).decode("utf-8", "replace"))
                    self._where[rank] = (str(where["host"]), where.get("cpus"))
                    self._not_a_neighbour(rank, str(where["host"]))
            except Exception:
                pass
        return self._where.get(rank, (f"rank{rank}", None))

    def _not_a_neighbour(self, rank: int, host: str) -> None:
        """A peer rank on this node is not "another process" on this rank's cores: ranks that share cores
        time-share them, which the CPU-denied rules judge from the lost time (and HOM013/HOM015 say), while a
        co-runner named is taken for a neighbour. Seen on 4 ranks pinned two to a core: rank 0's busiest
        "other process (pid 16462, python)" was rank 2."""
        if rank == self.rank or host != self.host or self._store is None:
            return
        key = keys.callback_pid(rank)
        if self._store.check([key]):
            pid = json.loads(self._store.get(key).decode("utf-8", "replace")).get("pid")
            if isinstance(pid, int):
                self._cpu.exclude = self._cpu.exclude | {pid}

    # -- DataParallel: one process, several GPUs, measured over its first steps --------
    def _data_parallel_step(self) -> None:
        self._dp_steps.append(self._step_ms[-1])
        try:
            self._dp.sample()
        except Exception:  # a reading that fails is missing; it never stops the training
            pass
        if self._steps >= min(self.every, DATA_PARALLEL_STEPS):
            self._data_parallel_judge()

    def _data_parallel_judge(self) -> None:
        self._dp_done = True
        self._emit(data_parallel_finding(self._dp.gpus(), self._steps, self._dp_steps, self.rank, self.host),
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

            return float(torch.cuda.max_memory_allocated(self.device))  # the allocator's counter: no sync
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
        if self._trace is not None:
            self._trace.finding(finding, time.time())
            if finding.code in HANG_CODES:  # the process may end next (on_hang="exit"): the timeline now
                self._write_trace(self._timeline())
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception:  # a broken hook must not break training
                log.exception("ddpdoctor: on_finding raised")

    def _timeline(self) -> Optional[dict[str, Any]]:
        """Rank 0's kept windows, findings and any hang as a trace-event document (callback/trace_keep.py); None
        where none is kept, or where making it failed (said in the log: a bug of ours must not fail the job)."""
        if self._trace is None:
            return None
        try:
            return self._trace.timeline(time.time(), {"steps_done": self._steps}).to_json()
        except Exception as exc:
            log.error("ddpdoctor: cannot make the timeline: %s: %s", type(exc).__name__, exc)
            return None

    def _write_trace(self, timeline: Optional[dict[str, Any]]) -> None:
        """trace_path: the timeline, written (at the end, and at a hang)."""
        if timeline is None or not self.trace_path:
            return
        from ddpdoctor.core.files import atomic_write_json

        try:
            atomic_write_json(timeline, self.trace_path)
        except Exception as exc:  # a full disk must not fail the job
            log.error("ddpdoctor: cannot write the timeline %s: %s: %s", self.trace_path, type(exc).__name__, exc)

    def _write_html(self, path: str, timeline: Optional[dict[str, Any]]) -> None:
        """html_path: rank 0's report as a page, with the timeline (render/html_report.py, through HTML_WRITER)."""
        if HTML_WRITER is None:
            log.warning("ddpdoctor: no HTML writer plugged in (import ddpdoctor, not ddpdoctor.callback.doctor): "
                        "%s not written", path)
            return
        try:
            HTML_WRITER(path, self._json_doc(), timeline)
        except Exception as exc:  # a full disk or a bug of ours must not fail the job
            log.error("ddpdoctor: cannot write %s: %s: %s", path, type(exc).__name__, exc)

    def _json_doc(self) -> dict[str, Any]:
        """This rank's report as its JSON file (and the page) have it."""
        return ({"rank": self.rank, "world_size": self.world_size, "steps": self._steps,
                 "findings": [f.to_json() for f in self.report()]}
                | ({"summary": self.summary} if self.summary is not None else {}))

    def _write_json(self, json_path: str) -> None:
        from ddpdoctor.core.files import atomic_write_json

        path = json_path if self.rank == 0 else f"{json_path}.rank{self.rank}"
        try:
            atomic_write_json(self._json_doc(), path)
        except OSError as exc:
            log.error("ddpdoctor: cannot write %s: %s", path, exc)


def slowest_window_s(rows: dict[int, GatheredRow]) -> float:
    """The slowest rank's window in a gathered table (seconds; 0 for none): the job's time since the last check,
    the same on every rank, which the straggler runs of checks and the replicas' due time are measured in."""
    return max((r.window_s for r in rows.values()), default=0.0)


def named_since(before: dict[tuple[str, tuple[int, ...]], float], judged: list[Finding],
                job_s: float) -> dict[tuple[str, tuple[int, ...]], float]:
    """Each straggler verdict's run of checks: the job's time at its first check. A check that names it (warn or
    worse, `worth_naming_online`) starts or continues its run; one that still finds the rank slower at warn but
    below the cost bar (a dip of a busy neighbour's share under 10% of the step) continues a run without starting
    one; one that no longer finds it slower ends it. Measured on issue 31's outside faults (2 ranks, checks
    every 20 steps): without the middle case a 50% busy neighbour was said in 7 of 10 runs of 4 s, one dip ending
    its run 1.8 s in; with it 9 of 10, and none of 60 kept healthy runs said anything more (benchmarks/README.md).
    Shared with benchmarks/stragglers_detection.py's replay."""
    now = {(f.code, f.ranks) for f in judged if worth_naming_online(f)}
    still = {(f.code, f.ranks) for f in judged if f.severity >= Severity.WARN}
    return {key: before.get(key, job_s) for key in now} | {key: t for key, t in before.items()
                                                          if key in still and key not in now}


def said(since: dict[tuple[str, tuple[int, ...]], float], f: Finding, job_s: float) -> bool:
    """A verdict named now whose run of checks has lasted CONFIRM_S of the job (two checks at least)."""
    began = since.get((f.code, f.ranks))
    return began is not None and began < job_s and job_s - began >= CONFIRM_S


def worth_naming_online(f: Finding) -> bool:
    """A straggler verdict the callback reports (once its run of checks has lasted, `Doctor._stragglers`): warn
    or worse, and for STR001 a cause in the step (not "host overhead") costing MIN_COST_SHARE of it.
    Shared with benchmarks/stragglers_detection.py --replay, which re-judges recorded windows."""
    if f.severity < Severity.WARN:
        return False
    return f.code != "STR001" or (f.evidence.get("cause") != "host overhead" and f.evidence.get("cost_ms_per_step", 0.0)
                                  >= MIN_COST_SHARE * f.evidence.get("median_step_ms", 0.0))


def _check_objects(model: Any, optimizer: Any) -> None:
    """The job's objects, as far as `Doctor` relies on them: a model with parameters, an optimizer with groups."""
    if not callable(getattr(model, "parameters", None)):
        raise ValueError(f"model must be a torch.nn.Module (the DDP-wrapped model), not {type(model).__name__}")
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or None), not {type(optimizer).__name__}")


def missing_finding(missing: dict[int, Any], arrived: list[int], hosts: dict[int, str], waited_s: float) -> Finding:
    """DOC021: ranks whose last window never reached rank 0 at the end of the run, each with its fate."""
    ranks = sorted(missing)
    fates = {r: missing[r].how for r in ranks}
    words = {"dead": "its process is gone", "frozen": "its process is stopped (SIGSTOP, a debugger)",
             "silent": f"it did not answer within {waited_s:.1f} s"}
    first = missing[ranks[0]]
    where = f" on {first.host}" if first.host else ""
    after = f" (last seen at the check of step {first.last_step})" if first.last_step is not None else ""
    more = f" (and {len(ranks) - 1} more: {', '.join(f'{r} {fates[r]}' for r in ranks[1:])})" if len(ranks) > 1 else ""
    severity = Severity.CRITICAL if any(how != "silent" for how in fates.values()) else Severity.WARN
    return codes.finding(
        "DOC021", "callback",
        f"Rank {ranks[0]}{where} did not reach the end of the run with its peers{after}: "
        f"{words.get(first.how, first.how)}{more}",
        severity=severity, ranks=tuple(ranks), nodes=tuple(sorted({m.host for m in missing.values() if m.host})),
        evidence={"fate_by_rank": fates, "pid_by_rank": {r: missing[r].pid for r in ranks},
                  "last_check_step_by_rank": {r: missing[r].last_step for r in ranks},
                  "arrived_ranks": arrived, "waited_ms": round(1e3 * waited_s, 1),
                  "arrived_nodes": sorted({hosts[r] for r in arrived if r in hosts})})


def _close_before_destroy() -> None:
    """`dist.destroy_process_group()` closes the open Doctors first (once installed, for the process): scripts
    call it and never close the Doctor, and a close at interpreter exit would find no process group to flush
    a GPU's last gather through. Only the default group's destruction ends the run; a subgroup's does not."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    if getattr(original, "_ddpdoctor", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        if group is None or group is getattr(distributed_c10d.GroupMember, "WORLD", None):
            for doctor in list(_OPEN):
                doctor.close()
        return original(group, *args, **kwargs)

    setattr(destroy_process_group, "_ddpdoctor", True)
    distributed_c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group
