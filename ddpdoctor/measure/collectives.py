"""One collective, its buffers, its timing loop and its correctness check, on one rank.

Inputs are small integers chosen per rank and element, so every rank can compute the
exact expected result locally (sums stay exactly representable, even in bf16, for up to
85 ranks) and count wrong elements without any extra communication.

torch.distributed has no out-of-place all_reduce or broadcast, so those run in place
only; timing a copy plus an in-place call would misreport the collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

# Which placements each op has in torch.distributed.
PLACEMENTS = {"all_reduce": (True,), "broadcast": (True,), "all_gather": (False, True),
              "reduce_scatter": (False, True), "all_to_all": (False,)}


@dataclass
class Buffers:
    run: Callable[[], object]  # the collective, on these buffers (called for its effect, its Work ignored)
    output: Any
    expected: Callable[[], Any]  # computed lazily: only the correctness check needs it
    refill: Callable[[], object]  # restore the inputs (in-place ops overwrite them; the copy's result is ignored)


def _pattern(torch: Any, numel: int, offset: int, modulus: int, device: Any, dtype: Any) -> Any:
    index = torch.arange(numel, device=device, dtype=torch.int64)
    return ((index + offset) % modulus).to(dtype)


def make_buffers(op: str, count: int, n: int, rank: int, in_place: bool, dtype: Any, device: Any,
                 group: Any = None) -> Buffers:
    """`count` as busbw.count_per_rank gives it: elements each rank passes to torch."""
    import torch
    import torch.distributed as dist

    P = lambda numel, offset, modulus: _pattern(torch, numel, offset, modulus, device, dtype)  # noqa: E731
    if op == "all_reduce":
        buf = torch.empty(count, device=device, dtype=dtype)

        def expected() -> Any:
            total = torch.zeros(count, device=device, dtype=torch.float64)
            for r in range(n):
                total += P(count, r, 3).double()
            return total

        return Buffers(lambda: dist.all_reduce(buf, group=group), buf, expected, lambda: buf.copy_(P(count, rank, 3)))
    if op == "broadcast":
        buf = torch.empty(count, device=device, dtype=dtype)
        root = dist.get_global_rank(group, 0) if group is not None else 0
        return Buffers(lambda: dist.broadcast(buf, root, group=group), buf, lambda: P(count, 1, 5).double(),
                       lambda: buf.copy_(P(count, 1, 5) if rank == 0 else torch.full_like(buf, -1)))
    if op == "all_gather":
        out = torch.empty(count * n, device=device, dtype=dtype)
        inp = out[rank * count:(rank + 1) * count] if in_place else torch.empty(count, device=device, dtype=dtype)

        def expected() -> Any:
            return torch.cat([P(count, 7 * r, 5).double() for r in range(n)])

        return Buffers(lambda: dist.all_gather_into_tensor(out, inp, group=group), out, expected,
                       lambda: inp.copy_(P(count, 7 * rank, 5)))
    if op == "reduce_scatter":
        inp = torch.empty(count * n, device=device, dtype=dtype)
        out = inp[rank * count:(rank + 1) * count] if in_place else torch.empty(count, device=device, dtype=dtype)

        def expected() -> Any:
            total = torch.zeros(count, device=device, dtype=torch.float64)
            for r in range(n):
                total += P(count * n, r, 3)[rank * count:(rank + 1) * count].double()
            return total

        return Buffers(lambda: dist.reduce_scatter_tensor(out, inp, group=group), out, expected,
                       lambda: inp.copy_(P(count * n, rank, 3)))
    if op == "all_to_all":
        inp = torch.empty(count, device=device, dtype=dtype)
        out = torch.empty(count, device=device, dtype=dtype)
        chunk = count // n

        def expected() -> Any:
            # Rank s sent us its chunk number `rank`: pattern offset 3*s + rank*chunk.
            return torch.cat([P(count, 3 * s, 7)[rank * chunk:(rank + 1) * chunk].double() for s in range(n)])

        return Buffers(lambda: dist.all_to_all_single(out, inp, group=group), out, expected,
                       lambda: inp.copy_(P(count, 3 * rank, 7)))
    raise ValueError(f"unknown collective {op!r}")


def count_wrong(buffers: Buffers) -> int:
    """Every expected value is an integer, exact in the dtype while it stays under 2^mantissa: then
    an element off by one is wrong, whatever the rank count (a relative tolerance would let an
    off-by-one pass once sums reach 100). Past that, the dtype's own rounding of the sum is allowed."""
    import torch

    got = buffers.output.double()
    want = buffers.expected()
    if got.numel() == 0:
        return 0
    dtype = buffers.output.dtype
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    tolerance = max(0.25, 2.0 * eps * float(want.abs().max()))
    return int(torch.count_nonzero((got - want).abs() > tolerance))


def time_iterations(buffers: Buffers, device: Any, warmup: int, iters: int, extra_delay_s: float = 0.0) -> list[float]:
    """Seconds per iteration as this rank saw it: CUDA events on a GPU, a monotonic clock on CPU.

    Every call is timed on its own (not a loop divided by its length) so the slowest
    rank's time can be taken per iteration. `extra_delay_s` is an injected slow link.
    """
    import torch

    buffers.refill()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(warmup + iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            buffers.run()
            if extra_delay_s:  # inside the timed window, as a slow wire would be
                torch.cuda._sleep(int(extra_delay_s * 1.4e9))  # ~cycles at 1.4 GHz
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in events[warmup:]]
    times: list[float] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        buffers.run()
        if extra_delay_s:
            time.sleep(extra_delay_s)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def check_once(buffers: Buffers, corrupt: bool = False) -> int:
    """Fresh inputs, one call, count wrong elements. `corrupt` is an injected fault on this rank."""
    buffers.refill()
    buffers.run()
    if corrupt:
        flat = buffers.output.view(-1)
        flat[:: max(1, flat.numel() // 8)] += 1  # a handful of elements arrive wrong
    return count_wrong(buffers)


def element_size(dtype_name: str) -> int:
    import torch

    return torch.tensor([], dtype=torch_dtype(dtype_name)).element_size()


def torch_dtype(name: str) -> Optional[Any]:
    import torch

    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None
