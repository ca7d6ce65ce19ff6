"""Where each DDP step's time goes on this rank, and when the rank reached the all-reduce.

The split that names a straggler: data, forward, backward compute, the wait for the
gradient all-reduce, optimizer. The wait is measured from the last gradient bucket's
hook (the end of this rank's backward compute) to the end of backward, which DDP holds
until every bucket's all-reduce is done; the arrival is the wall-clock time of the
first bucket's hook, the moment this rank starts making its peers wait or waiting for
them. On a GPU both are CUDA events on the compute stream (the hook runs on the CPU
when the kernels are queued, not when they finish), turned into wall time from a
synchronised start of step.

Then compute-only steps on the bare model, with no collective at all: a rank slow by
itself is seen directly, not only through its peers' waiting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ddpdoctor.core.facts import Facts
from ddpdoctor.runtime.context import RankContext
from ddpdoctor.measure.slow_compute import SlowCompute
from ddpdoctor.runtime.user_model import UserWorkload, batch_size_of, forward, loss_of, to_device
from ddpdoctor.runtime.workload import build_model, model_dims, peak_mem, sync

BATCH = 32
WARMUP_STEPS = 3
CALIBRATION_STEPS = 5
MIN_STEPS = 40
MAX_STEPS = 5000
SOLO_SHARE = 0.15  # compute-only steps, as a share of the measured ones
WINDOWS = 8  # the diagnosis judges windows of steps; the step count is a multiple of this


@dataclass
class StepTimeline(Facts):
    """One rank's measured steps, a column per phase (ms, step i at index i): the `steps` of the
    stragglers probe's facts, as the wire has them (columns, not records: a few KB a rank)."""

    data_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)  # compute only: up to the last bucket's hook
    comm_wait_ms: list[float] = field(default_factory=list)  # from the last bucket's hook to the end of backward
    optimizer_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def add(self, *, data_ms: float, forward_ms: float, backward_ms: float, comm_wait_ms: float,
            optimizer_ms: float, step_ms: float) -> None:
        self.data_ms.append(round(data_ms, 4))
        self.forward_ms.append(round(forward_ms, 4))
        self.backward_ms.append(round(backward_ms, 4))
        self.comm_wait_ms.append(round(comm_wait_ms, 4))
        self.optimizer_ms.append(round(optimizer_ms, 4))
        self.step_ms.append(round(step_ms, 4))

    def columns(self) -> dict[str, list[float]]:
        """Every column by its name: for code that treats the phases alike."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class StepSeries:
    """The timeline, `arrival_s` in this host's wall clock, `samples` per step."""

    columns: StepTimeline = field(default_factory=StepTimeline)
    arrival_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    solo_ms: list[float] = field(default_factory=list)
    injected_ms: float = 0.0
    comm_calls: int = 0
    peak_mem_bytes: int = 0
    parameters: int = 0
    batch_size: int = 0

    def add(self, arrival_s: float, samples: int, **ms: float) -> None:
        self.columns.add(**ms)
        self.arrival_s.append(arrival_s)
        self.samples.append(samples)


class _Clock:
    """Time points within one step: perf_counter on CPU, CUDA events on a GPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.device = device
        self.start_wall = 0.0
        self._start_perf = 0.0
        self._start_event: Any = None

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self._start_event = self.torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self.start_wall, self._start_perf = time.time(), time.perf_counter()

    def mark(self) -> Any:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def since_start_s(self, point: Any) -> float:
        """After a device sync: how long after the start of step `point` was."""
        if self.cuda:
            return self._start_event.elapsed_time(point) / 1e3
        return point - self._start_perf


class _ArrivalHook:
    """DDP comm hook state: an ordinary all-reduce, with the first and last bucket marked."""

    def __init__(self, clock: _Clock, world_size: int) -> None:
        self.clock = clock
        self.world_size = world_size
        self.first: Any = None
        self.last: Any = None
        self.calls = 0

    def reset(self) -> None:
        self.first = self.last = None


def _arrival_hook(state, bucket):
    # No annotations: DDP rejects a hook whose `bucket` is annotated with anything but GradBucket.
    import torch.distributed as dist

    point = state.clock.mark()
    if state.first is None:
        state.first = point
    state.last = point
    state.calls += 1
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _agreed_step_count(ctx: RankContext, step_s: float) -> int:
    """Every rank must run the same number of steps: the slowest rank's calibration decides."""
    if ctx.cfg.steps is not None:
        return ctx.cfg.steps
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([step_s], dtype=torch.float64, device=ctx.device)
    with ctx.collective("straggler_calibration_max"):
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wanted = ctx.cfg.straggler_s / max(float(slowest.item()), 1e-6)
    steps = min(MAX_STEPS, max(MIN_STEPS, int(wanted)))
    return int(math.ceil(steps / WINDOWS) * WINDOWS)


def _keep_alive(ctx: RankContext) -> None:
    """A long measurement of quick steps is progress: a fresh stage deadline every second.

    The deadline is there to catch one stuck step, not a long run of quick ones."""
    if time.time() - ctx.state.stage_started >= 1.0:
        ctx.progress()


def _reset_peak_mem(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def run_steps(ctx: RankContext) -> StepSeries:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    device = ctx.device
    n_in, _, n_out = model_dims(device.type)
    batch = max(1, round(BATCH * ctx.injector.batch_factor()))
    data_delay_s = ctx.injector.data_delay_s()
    slow = SlowCompute(ctx.injector.slow_factor(), device)
    clock = _Clock(device)
    series = StepSeries(batch_size=batch)

    user = None if ctx.cfg.model.builtin else UserWorkload(ctx.cfg.model)
    with ctx.stage("straggler_ddp"):
        _reset_peak_mem(device)  # this run's peak, not an earlier probe's
        model = build_model(device, 4321 + ctx.rank) if user is None else user.model(device, 4321 + ctx.rank)
        slow.install(model)
        with ctx.collective("ddp_construct_broadcast"):
            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        hook = _ArrivalHook(clock, ctx.world_size)
        ddp.register_comm_hook(hook, _arrival_hook)
        # 16 batches per rank, cycled by epochs: memory stays flat however many steps run.
        if user is None:
            generator = torch.Generator().manual_seed(43)
            samples = max(BATCH, batch) * 16 * ctx.world_size
            data = TensorDataset(torch.randn(samples, n_in, generator=generator),
                                 torch.randint(0, n_out, (samples,), generator=generator))
            sampler: Any = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=11)
            loader: Any = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=0, drop_last=True)
            loss_fn: Any = nn.CrossEntropyLoss()
        else:
            sampler = None
            loader = user.batches(batch, ctx.rank, 16)
            loss_fn = loss_of
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        series.parameters = sum(p.numel() for p in model.parameters())

    epoch = {"n": 0}

    def batches() -> Any:
        while True:
            if sampler is not None:
                sampler.set_epoch(epoch["n"])
            epoch["n"] += 1
            yield from loader

    stream = batches()

    def one_step(record: bool) -> float:
        clock.start()
        hook.reset()
        inputs, targets = next(stream)
        if data_delay_s:
            time.sleep(data_delay_s)  # an injected loader stall
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        t_data = clock.mark()
        loss = loss_fn(forward(ddp, inputs), targets)
        t_forward = clock.mark()
        loss.backward()
        t_backward = clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t_end = clock.mark()
        sync(device)
        at = {name: clock.since_start_s(p) * 1e3 for name, p in (
            ("data", t_data), ("forward", t_forward), ("backward", t_backward), ("end", t_end))}
        first = clock.since_start_s(hook.first) * 1e3 if hook.first is not None else at["backward"]
        last = clock.since_start_s(hook.last) * 1e3 if hook.last is not None else at["backward"]
        slow.observe_backward((last - at["forward"]) / 1e3)
        if record:
            series.add(clock.start_wall + first / 1e3, batch_size_of(inputs), data_ms=at["data"],
                       forward_ms=at["forward"] - at["data"], backward_ms=last - at["forward"],
                       comm_wait_ms=at["backward"] - last, optimizer_ms=at["end"] - at["backward"],
                       step_ms=at["end"])
        return at["end"] / 1e3

    with ctx.stage("straggler_train", inject_as="train"):
        for _ in range(WARMUP_STEPS):
            one_step(record=False)
        calibration = [one_step(record=False) for _ in range(CALIBRATION_STEPS)]
        steps = _agreed_step_count(ctx, sorted(calibration)[len(calibration) // 2])
        slow.take_spun_ms()
        hook.calls = 0
        for step in range(steps):
            with ctx.collective("ddp_gradient_allreduce", step=step):
                one_step(record=True)
            _keep_alive(ctx)
        series.comm_calls = hook.calls

    with ctx.stage("straggler_solo"):
        # This rank alone: the same model and batch, forward and backward, no collective.
        solo = max(5, int(steps * SOLO_SHARE))
        for _ in range(solo):
            clock.start()
            inputs, targets = next(stream)
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            t0 = clock.mark()
            loss = loss_fn(forward(model, inputs), targets)
            t1 = clock.mark()
            loss.backward()
            t2 = clock.mark()
            sync(device)
            slow.observe_backward(clock.since_start_s(t2) - clock.since_start_s(t1))
            series.solo_ms.append(round((clock.since_start_s(t2) - clock.since_start_s(t0)) * 1e3, 4))
            model.zero_grad(set_to_none=True)
            _keep_alive(ctx)
        series.injected_ms = round(slow.take_spun_ms(), 3)
        series.peak_mem_bytes = peak_mem(device)
    return series


def gpu_uuid(device: Any) -> Optional[str]:
    """The NVML identity of this rank's GPU, for the sampler; None on CPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid else None
