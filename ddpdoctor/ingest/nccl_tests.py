"""nccl-tests output (all_reduce_perf, all_gather_perf, reduce_scatter_perf, broadcast_perf,
alltoall_perf, reduce_perf, sendrecv_perf, ...) read into the allreduce probe's own facts.

What the file shows: the rank lines ("#  Rank  3 Group  0 Pid ... on HOST device  3 [0x1b]
NAME"; older versions print no Group), one node per host and one rank per line; the header
(iters, warmup); and the table, one row per size with each placement's time and `#wrong`
(`error` in older versions). Each rank's facts carry nccl-tests' time as that rank's one timed
call, so the probe derives algbw and busbw exactly as nccl-tests printed them, and `#wrong`
reaches BW001. nccl-tests prints one time per size (its average over iterations) and one sum
of wrong elements over all ranks: the wrong elements are put on the first rank, and the
output says so in what it cannot show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest.model import ToolOutput
from ddpdoctor.judge import busbw
from ddpdoctor.probes.allreduce.facts import AllReduceFacts, SizeTiming

KIND = "nccl-tests"
PROBE = "allreduce"

# mpirun --tag-output writes "[1,0]<stdout>:" before every line.
_TAG = re.compile(r"^\s*\[\d+,\d+\]<std(?:out|err)>:")
_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+"
                   r"\[([^\]]*)\]\s*(.*?)\s*$")
_COLUMNS = re.compile(r"^#\s+size\s+count\s+type\s+", re.I)
_TABLE_END = re.compile(r"^#\s*(Out of bounds values|Avg bus bandwidth)\b")
_ROW = re.compile(r"^\d+\s+\d+\s+\S+")
_ITERS = re.compile(r"(?<!warmup )(?<!agg )\biters:\s*(\d+)")
_WARMUP = re.compile(r"\bwarmup iters:\s*(\d+)")
# The binary's name in a prompt, an mpirun line or "# Collective test starting: X_perf".
_BINARY = re.compile(r"\b(all_reduce|all_gather|reduce_scatter|broadcast|reduce|alltoall|sendrecv|gather|scatter"
                     r"|hypercube)_perf")
# nccl-tests' collective -> the op ddpdoctor models with the same bus factor and count.
_MODELLED = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
             "broadcast": "broadcast", "alltoall": "all_to_all", "reduce": "broadcast", "sendrecv": "broadcast",
             "gather": "all_gather", "scatter": "all_gather", "hypercube": "all_gather"}
_DTYPES = {"half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16"}

CANNOT_SHOW = ["each rank's own timings (nccl-tests prints one average per size)",
               "which rank received wrong values (nccl-tests sums #wrong over all ranks)",
               "the links the ring used (read nvidia-smi topo -m beside it)"]


@dataclass
class _Rank:
    rank: int
    host: str
    device: int
    name: str


@dataclass
class _Row:
    size: int
    count: int
    dtype: str
    redop: str
    root: str
    # placement (False: out-of-place, True: in-place) -> (time in us, algbw, busbw, wrong or None)
    cells: dict[bool, tuple[float, float, float, Optional[int]]] = field(default_factory=dict)


def _lines(text: str) -> list[str]:
    return [_TAG.sub("", line).strip() for line in text.splitlines()]


def _ranks(lines: list[str]) -> list[_Rank]:
    """Each rank line once (a run of several processes may print the list more than once)."""
    seen: dict[int, _Rank] = {}
    for line in lines:
        m = _RANK.match(line)
        if m:
            seen.setdefault(int(m[1]), _Rank(int(m[1]), m[2], int(m[3]), m[5]))
    return [seen[r] for r in sorted(seen)]


def _number(path: str, text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{path}: nccl-tests row has {text!r} where its {what} belongs: was the table cut?") from None


def _wrong(text: str) -> Optional[int]:
    """`#wrong` (or `error`): a count, or N/A when the run did not check (-c 0)."""
    try:
        return int(float(text))
    except ValueError:
        return None


def _row(path: str, tokens: list[str], columns: list[str]) -> _Row:
    if len(tokens) != len(columns):
        raise UsageError(f"{path}: an nccl-tests row has {len(tokens)} columns where the header has "
                         f"{len(columns)}: the table was cut mid-row")
    at = {name: i for i, name in reversed(list(enumerate(columns)))}  # first occurrence of each name
    row = _Row(int(tokens[0]), int(tokens[1]), tokens[2], tokens[at["redop"]] if "redop" in at else "",
               tokens[at["root"]] if "root" in at else "-1")
    times = [i for i, name in enumerate(columns) if name == "time"]
    for in_place, start in zip((False, True), times):
        # Older versions print `error`, the largest deviation (a float), not a count of wrong elements.
        counted = start + 3 < len(columns) and columns[start + 3] == "#wrong"
        wrong = tokens[start + 3] if counted else "N/A"
        row.cells[in_place] = (_number(path, tokens[start], "time"), _number(path, tokens[start + 1], "algbw"),
                               _number(path, tokens[start + 2], "busbw"), _wrong(wrong))
    return row


def _table(path: str, lines: list[str]) -> list[_Row]:
    """The rows under the first column header; a row cut short is an error, not a smaller table."""
    columns: list[str] = []
    rows: list[_Row] = []
    for line in lines:
        if not columns:
            if _COLUMNS.match(line):
                columns = line.lstrip("#").split()
            continue
        if _ROW.match(line):
            rows.append(_row(path, line.split(), columns))
        elif rows and (line and not line.startswith("#") or _TABLE_END.match(line)):
            break  # the table is over: its summary lines, a shell line, the next run of a concatenated file
    if not columns:
        raise UsageError(f"{path} looks like nccl-tests output but has no table header "
                         "('#       size         count      type ...'): paste the whole output")
    if not rows:
        raise UsageError(f"{path} looks like nccl-tests output but its table has no row: was it cut short?")
    return rows


def _collective(text: str, rows: list[_Row], n: int) -> str:
    """The binary named in the output, else what the columns and busbw/algbw say."""
    named = _BINARY.search(text)
    if named:
        return named[1]
    top = max(rows, key=lambda r: r.size)
    _, algbw, bus, _ = top.cells[False]
    ratio = bus / algbw if algbw > 0 else None
    if top.redop == "none":
        return "broadcast" if top.root != "-1" else "all_gather"
    if top.root != "-1":
        return "reduce"
    if ratio is not None and n > 2 and abs(ratio - (n - 1) / n) < 0.05:
        return "reduce_scatter"
    return "all_reduce"


def _ranks_from_ratio(path: str, rows: list[_Row], op: str) -> int:
    """Without rank lines: the number of ranks busbw/algbw implies for the op."""
    top = max(rows, key=lambda r: r.size)
    _, algbw, bus, _ = top.cells[False]
    for n in range(2, 4097):
        if algbw > 0 and abs(busbw.bus_factor(op, n) * algbw - bus) <= 0.01 * bus + 0.01:
            return n
    raise UsageError(f"{path}: nccl-tests output without its '#  Rank ...' lines: the ranks and GPUs "
                     "cannot be told; paste it from the '# nThread' line on")


def _timings(rows: list[_Row], first: bool) -> list[SizeTiming]:
    out = []
    for in_place in (False, True):
        for row in rows:
            if in_place in row.cells:
                time_us, _, _, wrong = row.cells[in_place]
                out.append(SizeTiming(size_bytes=row.size, count=row.count, in_place=in_place,
                                      times_s=[time_us / 1e6], wrong=wrong if first else None))
    return out


def _int_after(pattern: re.Pattern[str], text: str) -> int:
    m = pattern.search(text)
    return int(m[1]) if m else 0


def read(path: str, text: str) -> ToolOutput:
    """The first run in the file (a file of several runs, all_reduce_perf then all_gather_perf, is read
    up to the end of the first table), as one ToolOutput per host."""
    lines = _lines(text)
    rows = _table(path, lines)
    ranks = _ranks(lines)
    collective = _collective(text, rows, len(ranks))
    op = _MODELLED[collective]
    if not ranks:
        ranks = [_Rank(r, "", r, "") for r in range(_ranks_from_ratio(path, rows, op))]
    warmup, iters = _int_after(_WARMUP, text), _int_after(_ITERS, text)
    cannot = list(CANNOT_SHOW)
    if op != collective.replace("alltoall", "all_to_all"):
        cannot.append(f"nccl-tests' {collective} as such (judged as {op}, which has the same bus factor)")
    if not any(_COLUMNS.match(line) and "#wrong" in line for line in lines):
        cannot.append("whether any element was wrong (this nccl-tests version prints no #wrong count)")
    if not any(r.host for r in ranks):
        cannot.append("the host names (no '#  Rank ... on HOST' lines)")
    outputs: dict[str, ToolOutput] = {}
    for local, rank in _local_ranks(ranks):
        out = outputs.setdefault(rank.host, ToolOutput(path, KIND, host=rank.host or None, cannot_show=cannot))
        facts = AllReduceFacts(host=rank.host, rank=rank.rank, local_rank=local, device=f"cuda:{rank.device}",
                               backend="nccl", op=op, dtype=_DTYPES.get(rows[0].dtype, rows[0].dtype),
                               world_size=len(ranks), warmup=warmup, iters=iters,
                               results=_timings(rows, rank is ranks[0]), gpu_name=rank.name or None)
        out.gpus[rank.device] = {PROBE: facts}
    first, *others = outputs.values()
    first.more = others
    return first


def _local_ranks(ranks: list[_Rank]) -> list[tuple[int, _Rank]]:
    """(position on its host, rank) for every rank, in rank order."""
    seen: dict[str, int] = {}
    out = []
    for rank in ranks:
        out.append((seen.get(rank.host, 0), rank))
        seen[rank.host] = seen.get(rank.host, 0) + 1
    return out
