"""Collective bandwidth arithmetic for `ddpdoctor allreduce-bench`, as nccl-tests defines it.

The figures follow nccl-tests' doc/PERFORMANCE.md so a number printed here can be laid
next to an `all_reduce_perf` run on the same machines and mean the same thing:

* time: the time of one operation. On small sizes it is the fixed cost (latency) of a
  collective; on large sizes it grows linearly with the size and says little by itself.
* algbw = S / t, S the operation's size in bytes, GB = 1e9 bytes. It answers "how long
  would an operation of this size take", but for collectives it falls as ranks are added,
  so it cannot be compared with a link's speed.
* busbw = algbw × factor, the factor being the share of S each rank must move through its
  own link at best (`bus_factor`). It is meant to be independent of the number of ranks
  and comparable with the hardware bottleneck's peak: NVLink, PCIe, QPI or the network.

Nothing here touches torch: the rank-side code measures, this module only does sums, so
every formula can be unit-tested against figures worked out by hand.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# Ops whose size S is n equal per-rank chunks: S must split evenly across the ranks.
_CHUNKED_OPS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})

# DDP's default gradient bucket: bucket_cap_mb=25 is in MiB, not MB. torch's own docstring
# says "bucket_cap_mb controls the bucket size in MebiBytes (MiB)" and
# torch/nn/parallel/distributed.py converts with _MB_TO_BYTES = 1024 * 1024 (checked on
# torch 2.13). The size a DDP job actually all-reduces, so the one worth reporting.
# (DDP's first bucket is smaller, torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB,
# so the last gradients of backward start their reduction early.)
DDP_BUCKET_BYTES = 25 * 1024 * 1024

# (min_bytes, max_bytes, factor), as nccl-tests' usual `-b 8 -e 256M -f 2`.
DEFAULT_GPU_RANGE = (8, 256 * 2**20, 2)
# gloo on CPU is orders of magnitude slower and a 256 MiB all_reduce per iteration makes a
# pre-flight check crawl; ×4 steps keep the curve's shape with a third of the points. The
# top reaches past DDP's 25 MiB bucket so the default sweep always includes it.
DEFAULT_CPU_RANGE = (1024, 32 * 2**20, 4)

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(I?B)?\s*$", re.IGNORECASE)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")


def _check_ranks(n: int) -> None:
    if n < 1:
        raise ValueError(f"world size must be at least 1, got {n}")


def bus_factor(op: str, n: int) -> float:
    """The share of S that crosses each rank's link at best, from nccl-tests' PERFORMANCE.md.

    all_reduce: 2(n-1)/n. Every element needs n-1 additions and n assignments, i.e. 2(n-1)
    transfers spread over n links, whatever the algorithm (ring, tree) as long as it is
    built from sends and receives.
    reduce_scatter: (n-1)/n, only the addition half of an all_reduce.
    all_gather: (n-1)/n, only the assignment half.
    broadcast: 1. All data must leave the root through its one link, so no spreading.
    all_to_all: (n-1)/n. Each rank keeps its own 1/n chunk and sends the rest.

    n == 1 gives 0 for all but broadcast, and that is kept on purpose: a single rank moves
    nothing over a bus, so a non-zero busbw would be a figure for memory copies.
    """
    _check_op(op)
    _check_ranks(n)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """S/t in GB/s with GB = 1e9 bytes, as nccl-tests prints it (not GiB: link speeds are decimal)."""
    if size_bytes < 0:
        raise ValueError(f"size must not be negative, got {size_bytes}")
    if not seconds > 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, n: int, size_bytes: int, seconds: float) -> float:
    """algbw corrected by `bus_factor`, the figure to compare with a link's peak."""
    return algbw_gbps(size_bytes, seconds) * bus_factor(op, n)


def _granule(op: str, elem_size: int, n: int) -> int:
    """The unit sizes must be a multiple of: one element, or one element per rank when S is n chunks."""
    return elem_size * n if op in _CHUNKED_OPS else elem_size


def count_per_rank(op: str, size_bytes: int, elem_size: int, n: int) -> int:
    """The element count each rank hands to torch for an operation of nccl-tests size S.

    S is the whole array, as in nccl-tests: all_gather's output (n × each rank's chunk),
    reduce_scatter's input (n × each rank's output chunk), the buffer for all_reduce and
    broadcast, each rank's send buffer for all_to_all. torch wants the per-rank chunk for
    all_gather (input) and reduce_scatter (output) and the whole buffer otherwise.

    A size that does not split evenly is refused rather than truncated: the bandwidth
    would be computed for bytes that were never moved. `sweep_sizes` never yields one.
    """
    _check_op(op)
    _check_ranks(n)
    if elem_size < 1:
        raise ValueError(f"element size must be at least 1 byte, got {elem_size}")
    granule = _granule(op, elem_size, n)
    if size_bytes < granule or size_bytes % granule:
        raise ValueError(
            f"{op} of {size_bytes} bytes on {n} ranks does not split into whole "
            f"{elem_size}-byte elements per rank: use a positive multiple of {granule} bytes"
        )
    if op in ("all_gather", "reduce_scatter"):
        return size_bytes // granule
    return size_bytes // elem_size


def _round_size(size: int, granule: int) -> int:
    return max(granule, size // granule * granule)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int, elem_size: int, n: int, op: str,
                include: Iterable[int] = (DDP_BUCKET_BYTES,)) -> list[int]:
    """The sizes to measure: min, min×factor, ... up to max, as nccl-tests' -b/-e/-f.

    Each size is rounded down to a multiple of elem_size × n for the ops whose S is n
    chunks (all_gather, reduce_scatter, all_to_all), of elem_size otherwise, and never
    below one element per rank, so the size reported is the size moved (this can lift a
    tiny min above itself). `include` adds sizes the geometric steps would skip, above
    all DDP's 25 MiB bucket, the one size a DDP job really reduces; each is added only
    if it lies within [min, max] so a narrow sweep stays narrow.
    """
    _check_op(op)
    _check_ranks(n)
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise ValueError(f"step factor must be an integer of at least 2, got {factor!r}")
    if elem_size < 1:
        raise ValueError(f"element size must be at least 1 byte, got {elem_size}")
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"size range must satisfy 1 <= min <= max, got {min_bytes}..{max_bytes}")
    granule = _granule(op, elem_size, n)
    sizes: set[int] = set()
    size = min_bytes
    while size <= max_bytes:
        sizes.add(_round_size(size, granule))
        size *= factor
    for extra in include:
        if min_bytes <= extra <= max_bytes:
            sizes.add(_round_size(extra, granule))
    return sorted(sizes)


def default_range(device_type: str) -> tuple[int, int, int]:
    """(min_bytes, max_bytes, factor): nccl-tests' usual sweep on accelerators, a lighter one on CPU.

    Anything but "cpu" counts as an accelerator: NCCL-class backends (cuda, xpu, ...) are
    fast enough for the full sweep.
    """
    return DEFAULT_CPU_RANGE if device_type == "cpu" else DEFAULT_GPU_RANGE


def parse_size(text: str) -> int:
    """"25M" -> 26214400: nccl-tests' -b/-e syntax, K/M/G being 1024-based there as here.

    "25MB" and "25MiB" are taken as the same 1024-based size (people write either for a
    bucket of bucket_cap_mb=25), as is a trailing "B" on a plain byte count ("8B").
    Whole numbers only, as nccl-tests: a fractional size has no meaning in elements.
    """
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None or (match.group(3) and match.group(3).upper() == "IB" and not match.group(2)):
        raise ValueError(
            f"bad size {text!r}: expected a whole number of bytes with an optional K, M or G "
            f"suffix (1024-based), e.g. 8, 64K, 25M, 25MiB, 1G"
        )
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"bad size {text!r}: must be at least 1 byte")
    return value


def format_size(size_bytes: int) -> str:
    """The inverse of `parse_size` for display: 8B, 1K, 25M, 256M, 1G; exact, never rounded."""
    for suffix in ("G", "M", "K"):
        unit = _UNITS[suffix]
        if size_bytes >= unit and size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return f"{size_bytes}B"


def slowest_per_iteration(per_rank: Mapping[int, Sequence[float]]) -> list[float]:
    """Element-wise max across ranks: a collective is done only when its last rank is.

    Each rank times the same iterations; taking one rank's clock (say rank 0's) would
    report a fast figure while a slow peer holds everybody else up.
    """
    if not per_rank:
        raise ValueError("no rank timings to combine")
    lengths = {rank: len(times) for rank, times in per_rank.items()}
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"rank {rank}: {count}" for rank, count in sorted(lengths.items()))
        raise ValueError(
            f"ranks timed different numbers of iterations ({detail}); "
            f"every rank must report one time per timed iteration"
        )
    return [float(max(column)) for column in zip(*per_rank.values())]


def _nearest_rank(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile: always a value that was measured, never an interpolation."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class SizeResult:
    """One size of one collective, as measured across the whole world.

    per_iter_s holds one time per timed iteration, each the SLOWEST rank's time for that
    iteration (`slowest_per_iteration`). The bandwidths come from the median: a median
    shrugs off one iteration hit by a page fault or a neighbour's job, where a mean would
    not. wrong counts elements whose value did not match the expected result; None when
    the results were not checked (--no-check), which is not the same as none wrong.
    """

    op: str
    size_bytes: int
    count: int
    dtype: str
    in_place: bool
    world_size: int
    per_iter_s: list[float]
    wrong: Optional[int]

    def __post_init__(self) -> None:
        _check_op(self.op)
        _check_ranks(self.world_size)
        if not self.per_iter_s:
            raise ValueError(f"{self.op} at {self.size_bytes} bytes: no timed iterations")
        self.per_iter_s = [float(t) for t in self.per_iter_s]

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.per_iter_s))

    @property
    def p95_s(self) -> float:
        return _nearest_rank(sorted(self.per_iter_s), 0.95)

    @property
    def min_s(self) -> float:
        return min(self.per_iter_s)

    @property
    def algbw_gbps(self) -> float:
        return algbw_gbps(self.size_bytes, self.median_s)

    @property
    def busbw_gbps(self) -> float:
        return busbw_gbps(self.op, self.world_size, self.size_bytes, self.median_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "size_bytes": self.size_bytes,
            "count": self.count,
            "dtype": self.dtype,
            "in_place": self.in_place,
            "world_size": self.world_size,
            "per_iter_s": list(self.per_iter_s),
            "wrong": self.wrong,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SizeResult":
        return cls(
            op=data["op"],
            size_bytes=int(data["size_bytes"]),
            count=int(data["count"]),
            dtype=data["dtype"],
            in_place=bool(data["in_place"]),
            world_size=int(data["world_size"]),
            per_iter_s=[float(t) for t in data["per_iter_s"]],
            wrong=None if data["wrong"] is None else int(data["wrong"]),
        )


def series(results: Iterable[SizeResult]) -> dict[tuple[str, bool], list[SizeResult]]:
    """Results grouped by (op, in_place), each group sorted by size: one curve each.

    In-place and out-of-place runs are kept apart, as nccl-tests prints them in separate
    columns: an in-place collective skips a copy and can be measurably faster.
    """
    grouped: dict[tuple[str, bool], list[SizeResult]] = {}
    for result in results:
        grouped.setdefault((result.op, result.in_place), []).append(result)
    return {key: sorted(group, key=lambda r: r.size_bytes) for key, group in sorted(grouped.items())}


@dataclass
class Summary:
    """A few figures that stand for one op's sweep.

    Never a mean across sizes (nccl-tests' "Avg bus bandwidth" line is one): small
    messages are latency-bound, their busbw is near zero whatever the links, so a mean
    mostly measures how many small sizes the sweep happened to include.
    """

    op: str
    in_place: bool | None  # None: both placements given, each size at the faster one
    world_size: int
    peak_busbw_gbps: float
    peak_size_bytes: int
    largest_size_bytes: int
    busbw_at_largest_gbps: float
    # The measured size nearest DDP's bucket, which sweep_sizes includes by default.
    bucket_size_bytes: int
    busbw_at_bucket_gbps: float
    # Median time of the smallest size: what a tiny collective costs however fast the links.
    latency_size_bytes: int
    latency_us: float
    wrong: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarise(results: list[SizeResult], bucket_bytes: int = DDP_BUCKET_BYTES) -> Summary:
    """Peak, largest-size, bucket-size busbw, small-message latency and wrong elements of one op.

    One collective only: busbw of different ops in one peak would hide which one is slow.
    When both in-place and out-of-place runs are given, each size counts with the faster
    of the two, as one reads nccl-tests' two columns: the links can do at least that, and
    Summary.in_place is then None. Pass one `series` group to summarise one placement.
    The bucket figure takes the measured size nearest bucket_bytes, the larger on a tie.
    Wrong elements are totalled over every result given, both placements included.
    """
    if not results:
        raise ValueError("nothing to summarise: no results")
    ops = sorted({r.op for r in results})
    if len(ops) > 1:
        raise ValueError(f"summarise takes one collective, got {ops}; group with series()")
    worlds = sorted({r.world_size for r in results})
    if len(worlds) > 1:
        raise ValueError(f"results measured on different world sizes: {worlds}")
    keys = [(r.size_bytes, r.in_place) for r in results]
    if len(set(keys)) != len(keys):
        raise ValueError("a size appears twice for the same placement")
    best: dict[int, SizeResult] = {}
    for r in results:
        if r.size_bytes not in best or r.busbw_gbps > best[r.size_bytes].busbw_gbps:
            best[r.size_bytes] = r
    ordered = [best[size] for size in sorted(best)]
    placements = {r.in_place for r in results}
    peak = max(ordered, key=lambda r: r.busbw_gbps)
    largest = ordered[-1]
    smallest = ordered[0]
    at_bucket = min(ordered, key=lambda r: (abs(r.size_bytes - bucket_bytes), -r.size_bytes))
    return Summary(
        op=ops[0],
        in_place=placements.pop() if len(placements) == 1 else None,
        world_size=worlds[0],
        peak_busbw_gbps=peak.busbw_gbps,
        peak_size_bytes=peak.size_bytes,
        largest_size_bytes=largest.size_bytes,
        busbw_at_largest_gbps=largest.busbw_gbps,
        bucket_size_bytes=at_bucket.size_bytes,
        busbw_at_bucket_gbps=at_bucket.busbw_gbps,
        latency_size_bytes=smallest.size_bytes,
        latency_us=smallest.median_s * 1e6,
        wrong=sum(r.wrong or 0 for r in results),
    )


def per_accelerator_network_gbps(busbw: float, nodes: int, n: int) -> float:
    """busbw × (k-1)/(n-1): what each accelerator's NIC carried across k nodes, n ranks.

    busbw counts traffic over every link, NVLink included. With a hierarchical (tree-like)
    all_reduce, each of the g = n/k ranks of a node sends 2(k-1)/k × S/g across the
    network, i.e. 2(k-1)/n × algbw per NIC; busbw = 2(n-1)/n × algbw, so the NIC's share
    is busbw × (k-1)/(n-1). all_gather and reduce_scatter give the same ratio. This is
    the figure to hold against one NIC's line rate (e.g. 400 Gb/s ≈ 50 GB/s). One node,
    or one rank, sends nothing over the network: 0.0.
    """
    _check_ranks(n)
    if nodes < 1 or nodes > n:
        raise ValueError(f"nodes must be between 1 and the world size {n}, got {nodes}")
    if nodes == 1 or n == 1:
        return 0.0
    return busbw * (nodes - 1) / (n - 1)


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """(i, i+1 mod n) for every rank: n point-to-point tests instead of an n² sweep.

    Every rank appears in exactly two pairs, so a slow rank shows up as two slow
    neighbouring pairs and a slow link as one (see `suspect_ranks`). Two ranks make one
    pair, not (0,1) and (1,0); one rank makes none.
    """
    _check_ranks(n)
    if n == 1:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def slowest_link(pair_busbw: Mapping[tuple[int, int], float], threshold: float = 0.8) -> list[tuple[int, int]]:
    """Pairs below threshold × the median pair, worst first.

    Against the median, not the best pair: the best may be a lucky outlier, and the median
    is the healthy figure as long as most pairs are healthy. That needs enough pairs: on a
    3-rank ring a slow rank spoils 2 of 3 pairs and becomes the median itself; on 4 ranks
    it is found only when its pairs are under 2/3 of the others at threshold 0.8.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if not pair_busbw:
        return []
    cutoff = threshold * statistics.median(pair_busbw.values())
    slow = [pair for pair, bw in pair_busbw.items() if bw < cutoff]
    return sorted(slow, key=lambda pair: (pair_busbw[pair], pair))


# A slow rank slows its two ring pairs by one cause (its NIC, its link, its CPU), so they are about as slow;
# two slow pairs of one rank this far apart are a slow link and a noisy pair (`suspect_ranks`).
SAME_CAUSE_RATIO = 2.0


def suspect_ranks(slow_pairs: Sequence[tuple[int, int]],
                  pair_bw: Optional[Mapping[tuple[int, int], float]] = None) -> list[int]:
    """The ranks to blame for slow ring pairs, given worst first (as `slowest_link` returns).

    A slow rank slows both its ring neighbours' pairs, so rank k is suspect when both
    (k-1, k) and (k, k+1) are slow: those ranks come back, in the order of their worst
    pair. When no rank is in two slow pairs, the slowest pair is a bad link (cable, NIC,
    switch port) rather than a bad rank, and either end may be at fault: both come back.

    With the pairs' busbw: a rank counts as in two slow pairs only where they are within
    SAME_CAUSE_RATIO of each other. Recorded in CI (`--inject slowlink:ranks=1,2`, 4 CPU ranks on 2
    cores): pair 1-2 at 0.177 GB/s, 0-1 at 0.53 (noise, under half the fastest, 1.24), and rank 1
    was named instead of the link.
    """
    if not slow_pairs:
        return []
    appearances: dict[int, int] = {}  # insertion order = order of each rank's worst pair
    worst_of: dict[int, float] = {}
    for pair in slow_pairs:
        for rank in dict.fromkeys(pair):
            bw = pair_bw.get(pair) if pair_bw else None
            if bw is not None and rank in worst_of and bw > SAME_CAUSE_RATIO * worst_of[rank]:
                continue  # far faster than this rank's worst pair: not the same cause
            if bw is not None:
                worst_of.setdefault(rank, bw)
            appearances[rank] = appearances.get(rank, 0) + 1
    doubly_slow = [rank for rank, count in appearances.items() if count >= 2]
    if doubly_slow:
        return doubly_slow
    return sorted(set(slow_pairs[0]))
