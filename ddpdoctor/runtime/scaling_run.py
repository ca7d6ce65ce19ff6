"""Measuring weak scaling on the launched ranks: the same per-rank batch at 1, 2, 4, ... ranks.

Each size trains on the first n ranks (a process group of its own) while the others wait
at a barrier, so sizes never overlap and every size sees the same machine. At each size a
rank records, per step: data, forward, backward (which includes the wait for the gradient
all-reduce) and optimizer time, and, in steps under `no_sync()`, backward without any
all-reduce: the difference is the communication that computation did not hide. At the
largest size it also trains with other DDP settings (bucket size, gradient_as_bucket_view,
gradient accumulation), so their effect is measured on this model, not guessed.
"""

from __future__ import annotations

import functools
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, TypeVar

from ddpdoctor.core import keys
from ddpdoctor.core.facts import Facts
from ddpdoctor.runtime.context import RankContext
from ddpdoctor.measure.slow_compute import SlowCompute
from ddpdoctor.runtime.user_model import forward
from ddpdoctor.runtime.workload import build_model, model_dims, sync

WARMUP = 3
MIN_STEPS, MAX_STEPS = 20, 400
BATCHES = 16  # distinct batches per rank, cycled: memory stays flat
CAPS_MB = (1.0, 5.0, 25.0, 100.0)  # DDP's default bucket is 25 MB
ACCUMULATE = 4
TRAIN_LR = 0.01  # what the steps train with; the user's own LR is only for the advice
DEFAULT_KNOB = "defaults (bucket_cap_mb=25)"


def default_sizes(world: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 < world:
        sizes.append(sizes[-1] * 2)
    return sizes + ([world] if world > 1 else [])


class Parts:
    """The model, batches and loss a rank trains: the built-in MLP or the user's (`--model`)."""

    def __init__(self, ctx: RankContext, batch: int) -> None:
        import torch
        from torch import nn

        from ddpdoctor.runtime.user_model import UserWorkload, batch_size_of, loss_of

        self.device = ctx.device
        self.batch = batch
        spec = ctx.cfg.model
        if spec.builtin:
            n_in, _, n_out = model_dims(self.device.type)
            generator = torch.Generator().manual_seed(100 + ctx.rank)
            self.batches = [(torch.randn(batch, n_in, generator=generator),
                             torch.randint(0, n_out, (batch,), generator=generator)) for _ in range(BATCHES)]
            self._model: Callable[[int], Any] = lambda seed: build_model(self.device, seed)
            loss_fn = nn.CrossEntropyLoss()
            self.loss: Callable[[Any, Any], Any] = lambda out, targets: loss_fn(out, targets)
        else:
            user = UserWorkload(spec)
            self.batches = user.batches(batch, ctx.rank, BATCHES)
            self._model = lambda seed: user.model(self.device, seed)
            self.loss = loss_of
        self.samples = batch_size_of(self.batches[0][0])

    def model(self) -> Any:
        return self._model(1234)

    def batch_at(self, step: int) -> tuple[Any, Any]:
        from ddpdoctor.runtime.user_model import to_device

        inputs, targets = self.batches[step % len(self.batches)]
        return to_device(inputs, self.device), to_device(targets, self.device)


@dataclass
class SizeRow(Facts):
    """One rank's medians (ms) at one size, as the facts' `sizes[n]` hold them.

    A column with no steps is absent (`forward_alone_ms` and `backward_alone_ms` at one rank,
    which has no all-reduce to switch off)."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({
        "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms", "forward_alone_ms",
        "backward_alone_ms", "spun_ms"})

    steps: int = 0
    data_ms: Optional[float] = None
    forward_ms: Optional[float] = None
    backward_ms: Optional[float] = None  # includes the wait for the gradient all-reduce
    optimizer_ms: Optional[float] = None
    step_ms: Optional[float] = None
    forward_alone_ms: Optional[float] = None  # under no_sync(): no all-reduce
    backward_alone_ms: Optional[float] = None
    spun_ms: Optional[float] = None  # injected slowness (--inject slow), for the record
    step_ms_all: list[float] = field(default_factory=list)  # every step, for the DDP settings' mean


@dataclass
class KnobRow(Facts):
    """One DDP setting tried at the largest size, as the facts' `knobs[name]` hold it."""

    step_ms: Optional[float] = None
    accumulate: int = 1  # micro-batches per all-reduce
    ms_per_batch: Optional[float] = None


class ScalingRecord(Protocol):
    """What `measure` fills in and publishes: the scaling probe's facts (probes/scaling/facts.py)."""

    sizes: dict[str, SizeRow]
    knobs: dict[str, KnobRow]
    batch_size: Optional[int]
    sizes_asked: list[int]
    parameters: int
    gradient_bytes: int

    def to_json(self) -> dict[str, Any]: ...


def _median(values: list[float]) -> Optional[float]:
    """A column's median as the facts hold it; None for a column with no steps."""
    return round(statistics.median(values), 4) if values else None


@dataclass
class SizeTimeline:
    """One size's training, step by step (ms); its medians are the size's row."""

    data_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    optimizer_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    forward_alone_ms: list[float] = field(default_factory=list)
    backward_alone_ms: list[float] = field(default_factory=list)
    spun_ms: list[float] = field(default_factory=list)

    def add(self, *, data_ms: float, forward_ms: float, backward_ms: float, optimizer_ms: float,
            step_ms: float) -> None:
        self.data_ms.append(round(data_ms, 4))
        self.forward_ms.append(round(forward_ms, 4))
        self.backward_ms.append(round(backward_ms, 4))
        self.optimizer_ms.append(round(optimizer_ms, 4))
        self.step_ms.append(round(step_ms, 4))

    def add_alone(self, *, forward_ms: float, backward_ms: float) -> None:
        self.forward_alone_ms.append(round(forward_ms, 4))
        self.backward_alone_ms.append(round(backward_ms, 4))

    def row(self, steps: int) -> SizeRow:
        return SizeRow(steps=steps, data_ms=_median(self.data_ms), forward_ms=_median(self.forward_ms),
                       backward_ms=_median(self.backward_ms), optimizer_ms=_median(self.optimizer_ms),
                       step_ms=_median(self.step_ms), forward_alone_ms=_median(self.forward_alone_ms),
                       backward_alone_ms=_median(self.backward_alone_ms), spun_ms=_median(self.spun_ms),
                       step_ms_all=self.step_ms)


def _train(ctx: RankContext, parts: Parts, model: Any, optimizer: Any, steps: int, no_sync: Optional[Any],
           slow: SlowCompute, data_delay_s: float, accumulate: int = 1) -> SizeTimeline:
    """`steps` timed steps (after a warm-up); with `no_sync`, also a no-communication step after each other."""
    out = SizeTimeline()
    device = parts.device
    for step in range(WARMUP + steps):
        for micro in range(accumulate):
            t0 = time.perf_counter()
            inputs, targets = parts.batch_at(step * accumulate + micro)
            if data_delay_s:
                time.sleep(data_delay_s)
            sync(device)
            t1 = time.perf_counter()
            with (no_sync() if no_sync is not None and micro < accumulate - 1 else contextlib.nullcontext()):
                forward_s, backward_s = _forward_backward(parts, model, inputs, targets)
            t3 = time.perf_counter()
            if micro == accumulate - 1:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync(device)
            t4 = time.perf_counter()
            if step >= WARMUP:
                out.add(data_ms=(t1 - t0) * 1e3, forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3,
                        optimizer_ms=(t4 - t3) * 1e3, step_ms=(t4 - t0) * 1e3)
        if no_sync is not None and accumulate == 1 and step >= WARMUP and step % 2 == 0:
            # The same step with DDP's all-reduce switched off: backward as pure computation.
            inputs, targets = parts.batch_at(step)
            with no_sync():
                forward_s, backward_s = _forward_backward(parts, model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)  # drop the local gradient: weights stay in step
            slow.observe_backward(backward_s)
            out.add_alone(forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3)
        ctx.progress()
        beat(ctx)
    out.spun_ms.append(round(slow.take_spun_ms(), 3))
    return out


def _forward_backward(parts: Parts, model: Any, inputs: Any, targets: Any) -> tuple[float, float]:
    """Forward, then backward, each timed to the device's completion (seconds)."""
    t0 = time.perf_counter()
    loss = parts.loss(forward(model, inputs), targets)
    sync(parts.device)
    t1 = time.perf_counter()
    loss.backward()
    sync(parts.device)
    return t1 - t0, time.perf_counter() - t1


def _ddp(model: Any, group: Any, device: Any, **options: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group,
                                   device_ids=[device.index] if device.type == "cuda" else None, **options)


BEAT_S = 0.5


def beat(ctx: RankContext) -> None:
    """A measuring rank says it is moving on (at most twice a second): the ranks that sit a
    size out wait as long as it does, however long its steps are, and no longer."""
    now = time.time()
    if now - ctx.shared.scaling_beat >= BEAT_S:
        ctx.shared.scaling_beat = now
        ctx.channel.set(keys.scaling_beat(ctx.rank), now)


def wait_for(ctx: RankContext, done_keys: list[str], workers: range, what: str) -> None:
    """Wait for `done_keys` while any of `workers` still beats; then the stage deadline decides.

    Not a collective: a rank that sits out a size must not time out in a barrier while the
    others train for longer than one stage deadline (a big model's 20 steps)."""
    with ctx.collective("scaling_wait", waiting_for=what):
        while not all(ctx.channel.has(k) for k in done_keys):
            beats = [b for r in workers if isinstance(b := ctx.channel.get(keys.scaling_beat(r)), (int, float))]
            if beats and time.time() - max(beats) < ctx.cfg.timeout_s:
                ctx.progress()
            time.sleep(0.05)


def _agree_steps(ctx: RankContext, step_s: Optional[float]) -> int:
    """Rank 0 timed one rank alone; every size trains as many steps as fit its seconds."""
    if ctx.cfg.steps is not None:
        return ctx.cfg.steps
    if ctx.rank == 0:
        want = int(min(MAX_STEPS, max(MIN_STEPS, ctx.cfg.scaling.seconds_per_size / max(step_s or 1e-3, 1e-6))))
        ctx.channel.set(keys.SCALING_STEPS, want)
    wait_for(ctx, [keys.SCALING_STEPS], range(1), "rank 0's calibration")
    return int(ctx.channel.get(keys.SCALING_STEPS))


def _one_size(ctx: RankContext, parts: Parts, n: int, group: Any, steps: int, accumulate: int = 1,
              **ddp_options: Any) -> SizeRow:
    import torch

    slow = SlowCompute(ctx.injector.slow_factor(), parts.device)
    model = parts.model()
    slow.install(model)
    if n == 1:
        optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR, momentum=0.9)
        timed = _train(ctx, parts, model, optimizer, steps, None, slow, ctx.injector.data_delay_s())
    else:
        with ctx.collective("ddp_construct_broadcast", size=n):
            ddp = _ddp(model, group, parts.device, **ddp_options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=TRAIN_LR, momentum=0.9)
        with ctx.collective("ddp_gradient_allreduce", size=n):
            timed = _train(ctx, parts, ddp, optimizer, steps, ddp.no_sync, slow, ctx.injector.data_delay_s(),
                           accumulate=accumulate)
    return timed.row(steps)


Row = TypeVar("Row", SizeRow, KnobRow)


def _turn(ctx: RankContext, facts: ScalingRecord, into: dict[str, Row], name: str, done: Callable[[int], str], n: int, what: str,
          work: Callable[[], Row]) -> None:
    """The first n ranks measure into `into[name]` (a section of `facts`) and publish what they
    have; every rank then waits for all n."""
    if ctx.rank < n:
        into[name] = work()
        ctx.publish_partial("scaling", facts)
        ctx.channel.set(done(ctx.rank), time.time())
    wait_for(ctx, [done(r) for r in range(n)], range(n), what)


def sizes_for(wanted: tuple[int, ...], world: int) -> list[int]:
    """The sizes to measure: always 1 (every speedup is against it), none above the ranks there are."""
    return sorted({1, *(n for n in (wanted or default_sizes(world)) if 1 <= n <= world)})


def measure(ctx: RankContext, facts: ScalingRecord) -> None:
    """This rank's part of every size, and of the DDP settings tried at the largest.

    `facts` is published after each size, so a size that fails keeps the ones before it."""
    import torch.distributed as dist

    cfg = ctx.cfg.scaling
    sizes = sizes_for(cfg.sizes, ctx.world_size)
    parts = Parts(ctx, cfg.batch)
    groups = {n: dist.new_group(list(range(n))) for n in sizes if n > 1}  # every rank creates every group
    model = parts.model()
    facts.sizes, facts.knobs, facts.batch_size, facts.sizes_asked = {}, {}, parts.samples, list(cfg.sizes)
    facts.parameters = sum(p.numel() for p in model.parameters())
    facts.gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    del model
    step_s: Optional[float] = None
    if ctx.rank == 0 and ctx.cfg.steps is None:
        with ctx.stage("scaling_calibrate"):
            step_s = (_one_size(ctx, parts, 1, None, 5).step_ms or 0.0) / 1e3
    steps = _agree_steps(ctx, step_s)
    for n in sizes:
        with ctx.stage(f"scaling_{n}", inject_as="train"):
            _turn(ctx, facts, facts.sizes, str(n), functools.partial(keys.scaling_size_done, n), n, f"size {n}",
                  lambda: _one_size(ctx, parts, n, groups.get(n), steps))
    largest = max(sizes)
    if largest > 1 and cfg.knobs:
        grad_mb = facts.gradient_bytes / 2**20
        for index, (name, options) in enumerate(knob_settings(grad_mb)):
            with ctx.stage("scaling_knob", inject_as=""):
                _turn(ctx, facts, facts.knobs, name, functools.partial(keys.scaling_knob_done, index), largest, name,
                      lambda: _one_knob(ctx, parts, largest, groups[largest], max(MIN_STEPS, steps // 4), options))
    with ctx.collective("scaling_barrier"):
        dist.barrier()  # every rank is here: quick


def knob_settings(grad_mb: float) -> list[tuple[str, dict[str, Any]]]:
    """The DDP settings worth timing for gradients of this size: distinct bucket counts only."""
    import math

    settings: list[tuple[str, dict[str, Any]]] = [(DEFAULT_KNOB, {})]
    seen = {max(1, math.ceil(grad_mb / 25.0))}
    for cap in CAPS_MB:
        buckets = max(1, math.ceil(grad_mb / cap))
        if buckets in seen:
            continue  # the same buckets as a setting already timed: nothing new to learn
        seen.add(buckets)
        settings.append((f"bucket_cap_mb={cap:g}", {"bucket_cap_mb": cap}))
    settings.append(("gradient_as_bucket_view=True", {"gradient_as_bucket_view": True}))
    settings.append((f"no_sync accumulation x{ACCUMULATE}", {"accumulate": ACCUMULATE}))
    return settings


def _one_knob(ctx: RankContext, parts: Parts, n: int, group: Any, steps: int, options: dict[str, Any]) -> KnobRow:
    """A size's training with other DDP settings (`accumulate`: micro-batches per all-reduce)."""
    timed = _one_size(ctx, parts, n, group, steps, **options)
    # Per micro-batch: with accumulation a "step" here is one micro-batch, all-reduced once in `accumulate`.
    return KnobRow(step_ms=timed.step_ms, accumulate=int(options.get("accumulate", 1)),
                   ms_per_batch=round(statistics.fmean(timed.step_ms_all), 4))
