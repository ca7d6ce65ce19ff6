"""The shared DDP workload: one short, real, instrumented training run per check.

Probes reuse its per-step timings instead of each training on their own, which is what
keeps `ddpdoctor check` within a small multiple of a bare init + all-reduce.
"""

from __future__ import annotations

import hashlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor.core.facts import Facts, nested_list
from ddpdoctor.runtime.context import RankContext
from ddpdoctor.measure.slow_compute import SlowCompute
from ddpdoctor.runtime.user_model import UserWorkload, forward, loss_of, to_device



@dataclass
class StepTiming(Facts):
    """One timed step. A Facts type: the ddp-smoke probe publishes these as its facts."""

    data_ms: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0  # includes waiting for the gradient all-reduce to finish
    comm_ms: float = 0.0  # sum over buckets, from hook launch to all-reduce completion
    optimizer_ms: float = 0.0
    step_ms: float = 0.0
    injected_delay_ms: float = 0.0


@dataclass
class WorkloadResult(Facts):
    """One rank's run of the shared DDP workload; its JSON is the ddp-smoke probe's facts (a
    default for every key, as a file written by another version may lack one)."""

    device: str = ""
    backend: str = ""
    parameters: int = 0
    gradient_bytes: int = 0
    batch_size: int = 0
    steps: list[StepTiming] = field(default_factory=list, metadata=nested_list(StepTiming))
    warmup_steps: int = 0
    comm_calls: int = 0
    comm_bytes: int = 0
    param_sha256: str = ""
    param_sum: float = 0.0
    # Per tensor the optimizer steps, its name and the exact sum of its bits (measure/replica_digest.py):
    # what the replicas are compared by, with the training callback's rule (judge/replicas.py).
    param_names: list[str] = field(default_factory=list)
    param_bitsums: list[float] = field(default_factory=list)
    peak_mem_bytes: int = 0
    loss_first: float = 0.0
    loss_last: float = 0.0


def model_dims(device_type: str) -> tuple[int, int, int]:
    # CPU: a few ms a step on one thread. GPU: big enough that a step is not all launch overhead.
    return (256, 512, 10) if device_type == "cpu" else (1024, 4096, 10)


def build_model(device: Any, seed: int) -> Any:
    """The workload's MLP. Seeded per rank on purpose: DDP must broadcast rank 0's weights."""
    import torch
    from torch import nn

    n_in, n_hidden, n_out = model_dims(device.type)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_hidden),
                         nn.ReLU(), nn.Linear(n_hidden, n_out)).to(device)


class _CommTimer:
    """DDP comm hook state: an ordinary all-reduce, timed from launch to completion."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.calls = 0
        self.bytes = 0
        self.ms = 0.0

    def take_ms(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms


def _timed_allreduce_hook(state, bucket):
    # No annotations: DDP rejects a hook whose `bucket` is annotated with anything but
    # dist.GradBucket, and postponed (string) annotations never match it.
    import torch.distributed as dist

    started = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def finished(fut: Any) -> Any:
        state.ms += (time.perf_counter() - started) * 1000.0
        state.calls += 1
        state.bytes += buffer.numel() * buffer.element_size()
        return fut.value()[0]

    return future.then(finished)


def sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def peak_mem(device: Any) -> int:
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def tensor_bytes(tensor: Any) -> bytearray:
    """A tensor's bytes in memory order, as `numpy().tobytes()` gave them, without numpy (torch
    does not install it). Copied through a uint8 tensor sharing the buffer's memory: going element
    by element (`bytes(t.untyped_storage())`, `bytes(t.tolist())`) takes seconds per MB."""
    import torch

    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    buffer = bytearray(raw.numel())
    if buffer:  # torch.frombuffer refuses an empty buffer
        torch.frombuffer(buffer, dtype=torch.uint8).copy_(raw)
    return buffer


def weights_sha256(flat: Any) -> str:
    """The sha256 of a tensor's bytes in memory order: the digest `numpy().tobytes()` gave."""
    return hashlib.sha256(tensor_bytes(flat)).hexdigest()


def run_workload(ctx: RankContext) -> WorkloadResult:
    """Construct DDP, train warm-up + measured steps, fingerprint the weights.

    Cached on the context: the first probe that needs it pays for it.
    """
    if ctx.shared.workload is not None:
        return ctx.shared.workload
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    device = ctx.device
    n_in, _, n_out = model_dims(device.type)
    batch = 32
    total_steps = ctx.cfg.warmup + ctx.cfg.workload_steps
    slow = SlowCompute(ctx.injector.slow_factor(), device)
    data_delay_s = ctx.injector.data_delay_s()

    user = None if ctx.cfg.model.builtin else UserWorkload(ctx.cfg.model)
    with ctx.stage("ddp"):
        model = build_model(device, 1234 + ctx.rank) if user is None else user.model(device, 1234 + ctx.rank)
        slow.install(model)
        with ctx.collective("ddp_construct_broadcast"):
            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        timer = _CommTimer(ctx.world_size)
        ddp.register_comm_hook(timer, _timed_allreduce_hook)
        if user is None:
            generator = torch.Generator().manual_seed(42)
            samples = batch * ctx.world_size * total_steps
            data = TensorDataset(torch.randn(samples, n_in, generator=generator),
                                 torch.randint(0, n_out, (samples,), generator=generator))
            sampler: Optional[DistributedSampler] = DistributedSampler(
                data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=7)
            loader: Any = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=0, drop_last=True)
            loss_fn: Any = nn.CrossEntropyLoss()
        else:  # the user's batches, one per step, drawn with a per-rank seed as a sampler would shard
            sampler = None
            loader = user.batches(batch, ctx.rank, total_steps)
            loss_fn = loss_of
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        params = sum(p.numel() for p in model.parameters())
        result = WorkloadResult(device=str(device), backend=ctx.backend, parameters=params,
                                gradient_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                                batch_size=batch, warmup_steps=ctx.cfg.warmup)
        if ctx.injector.diverges():
            # A rank whose weights silently drift after DDP's one-time broadcast.
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)

    with ctx.stage("train"):
        if sampler is not None:
            sampler.set_epoch(0)
        batches = iter(loader)
        for step in range(total_steps):
            t0 = time.perf_counter()
            inputs, targets = next(batches)
            if data_delay_s:
                time.sleep(data_delay_s)  # an injected loader stall
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            sync(device)
            t1 = time.perf_counter()
            loss = loss_fn(forward(ddp, inputs), targets)
            sync(device)
            t2 = time.perf_counter()
            if step == 0 and ctx.injector.desyncs():
                # A rank-dependent code path that issues another collective than its peers
                # (a rank-0-only barrier, say): they wait in the gradient all-reduce.
                import torch.distributed as dist

                with ctx.collective("barrier", step=step):
                    dist.barrier()
            dtype = ctx.injector.metrics_dtype() if step == 0 else None
            if dtype is not None:
                # A metrics all-reduce of the same 192 bytes, in another dtype on the faulty rank.
                import torch.distributed as dist

                metrics = torch.ones(24 if dtype == "float64" else 48, dtype=getattr(torch, dtype), device=device)
                with ctx.collective("metrics_allreduce", step=step):
                    dist.all_reduce(metrics)
            with ctx.collective("ddp_gradient_allreduce", step=step):
                if step == 0:
                    ctx.injector.at_stage("collective")
                loss.backward()
                sync(device)
            t3 = time.perf_counter()
            t_opt = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            t4 = time.perf_counter()
            timing = StepTiming(data_ms=(t1 - t0) * 1e3, forward_ms=(t2 - t1) * 1e3,
                                backward_ms=(t3 - t2) * 1e3, comm_ms=timer.take_ms(),
                                optimizer_ms=(t4 - t_opt) * 1e3, step_ms=(t4 - t0) * 1e3,
                                injected_delay_ms=slow.take_spun_ms())
            if step == 0:
                result.loss_first = float(loss.detach())
            result.loss_last = float(loss.detach())
            if step >= ctx.cfg.warmup:
                result.steps.append(timing)

    with ctx.stage("verify"):
        flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])
        result.param_sha256 = weights_sha256(flat)
        result.param_sum = float(flat.double().sum())
        from ddpdoctor.measure import replica_digest

        replicas = replica_digest.layout(optimizer, model)
        result.param_names = [" + ".join(e.names) for e in replicas.entries]
        result.param_bitsums = [float(v) for v in replica_digest.digest(replicas).tolist()]
        result.comm_calls, result.comm_bytes = timer.calls, timer.bytes
        result.peak_mem_bytes = peak_mem(device)

    ctx.shared.workload = result
    return result
