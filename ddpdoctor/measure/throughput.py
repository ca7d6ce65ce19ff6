"""A rank's own compute speed: dense matmul throughput, time-boxed.

Two GPUs of one model can differ by 20% (clocks held low, a failing fan, a power cap
someone forgot), and a CPU rank can sit on a busy core. Identical facts do not prove
identical speed; a measured figure, compared across peers, does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ddpdoctor.measure.contention import ContentionFacts, Window
from ddpdoctor.measure.slow_compute import spin

# Big enough that a GPU matmul is not launch-bound, small enough for a pre-flight check.
GPU_SIZE = 8192
CPU_SIZE = 384
ROUNDS = 8
ROUND_S = 0.03  # 8 x 30 ms measured per rank, warm-up excluded
MAX_REPS_PER_ROUND = 100


@dataclass(frozen=True)
class MatmulThroughput:
    device: str
    dtype: str
    size: int
    reps: int
    median_ms: float  # per matmul, over all repetitions
    flops_per_s: float  # from that median
    # One figure per round; every rank's round k ran at the same time as its peers', so
    # the diagnosis compares like with like and a burst of noise spoils one round, not the verdict.
    round_flops_per_s: list[float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Got:
    """What the rank really got over the rounds: every repetition's flops over the rounds' wall
    time, the time it was descheduled, throttled or stopped included (its best round leaves
    exactly that out), and the CPU it was denied meanwhile."""

    flops_per_s: float
    contention: ContentionFacts


def measure_matmul(device: Any, barrier: Callable[[], None] = lambda: None, slow_factor: float = 1.0,
                   rounds: int = ROUNDS, round_s: float = ROUND_S) -> MatmulThroughput:
    """`measure_matmul_got` without what the rank got: a snapshot measures one device alone."""
    return measure_matmul_got(device, barrier, slow_factor, rounds, round_s)[0]


def _gpu_dtype(torch: Any, device: Any) -> Any:
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def measure_matmul_got(device: Any, barrier: Callable[[], None] = lambda: None, slow_factor: float = 1.0,
                       rounds: int = ROUNDS, round_s: float = ROUND_S,
                       peers: frozenset[int] = frozenset()) -> tuple[MatmulThroughput, Got]:
    """Median time of one n×n matmul, per round; `barrier` lines the rounds up across ranks.

    `slow_factor` > 1 is an injected fault: the rank really takes that much longer per
    repetition, busy on its CPU for the difference inside the timed window, as a slower
    device or a CPU hog sharing its core would. `peers`: the pids of the job's other ranks on this
    machine, never named as co-runners (core/hello.py `peer_pids`).
    """
    import torch

    on_gpu = device.type == "cuda"
    size = GPU_SIZE if on_gpu else CPU_SIZE
    dtype = _gpu_dtype(torch, device) if on_gpu else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    timer = _cuda_timer(torch, device) if on_gpu else _cpu_timer()
    for _ in range(2):  # warm-up: allocator, cuBLAS heuristics, caches
        timer(lambda: torch.mm(a, b))
    every: list[float] = []
    per_round: list[float] = []
    waited = worked = 0.0
    window = Window(exclude=peers)
    for _ in range(rounds):
        before = time.perf_counter()
        barrier()
        times: list[float] = []
        started = time.perf_counter()
        waited += started - before
        while len(times) < MAX_REPS_PER_ROUND and (time.perf_counter() - started < round_s or len(times) < 3):
            elapsed = timer(lambda: torch.mm(a, b))
            if slow_factor > 1.0:
                spin(elapsed * (slow_factor - 1.0))
                elapsed *= slow_factor
            times.append(elapsed)
        worked += time.perf_counter() - started
        per_round.append(2.0 * size**3 / statistics.median(times))
        every += times
    # On a GPU the thread waits for the device on purpose: only a CPU rank's off-CPU time is lost.
    contention = window.take(wait_s=waited if not on_gpu else None)
    window.close()
    median = statistics.median(every)
    return (MatmulThroughput(device=str(device), dtype=str(dtype).replace("torch.", ""), size=size, reps=len(every),
                             median_ms=round(median * 1e3, 4), flops_per_s=2.0 * size**3 / median,
                             round_flops_per_s=per_round),
            Got(flops_per_s=2.0 * size**3 * len(every) / max(worked, 1e-9), contention=contention))


def _cpu_timer() -> Callable[[Callable[[], Any]], float]:
    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return timed


def _cuda_timer(torch: Any, device: Any) -> Callable[[Callable[[], Any]], float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn: Callable[[], Any]) -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return timed
