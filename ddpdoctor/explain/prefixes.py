"""Who printed a log line, and when: the prefixes launchers and libraries put in front.

One job's output mixes every rank's lines. torchrun prefixes them `[rank3]:` (and, with
`--tee`, `[default0]:` for the local rank), `srun --label` with `3: `, NCCL's own lines
start `host:pid:tid [dev]`, torch's C++ and the elastic agent log with glog's
`E1023 12:34:56.789`, Python logging with ISO dates. Stripping them yields the message
the signatures match, and the rank, host and time the diagnosis needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ddpdoctor.explain.collectors import LineStyle, pdsh_hosts, strip_collectors

# torchrun's `[rank3]:` / `[default0]:`, Lightning's `[rank: 3] `, OpenMPI --tag-output's `[1,3]<stderr>:`.
_LAUNCHER_PREFIX = re.compile(r"\[(?P<role>[A-Za-z_][A-Za-z_-]*?)(?P<num>\d+)\]:|\[(?P<lightning>rank): (?P<lnum>\d+)\] |"
                              r"\[\d+,(?P<mpi>\d+)\]<std(?:out|err|diag)>: ?")
_MPI_RANK = re.compile(r"\[(?P<rank>\d{1,6})\] ")
_MPI_LAUNCH = re.compile(r"mpirun|mpiexec|prterun|\[proxy:|HYDRA|BAD TERMINATION")
_SRUN_LABEL = re.compile(r"\s{0,6}(?P<task>\d{1,6}): ")
# `host:pid:tid [dev] NCCL WARN ...`; newer NCCL puts the source file between: `[1] transport/net_ib.cc:1295 NCCL`.
_NCCL_LINE = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\](?: [\w./-]+:\d+)? NCCL ")
# The rank torch names inside a message: `[Rank 3]`, `[PG ID 0 PG GUID 0(default_pg) Rank 3]`.
_MESSAGE_RANK = re.compile(r"\[(?:PG ID (?P<pg>\d+)[^\]]*?)?Rank (?P<rank>\d+)\]")
# glog pads the month (E0429); torch's own c10 logger does not (E429 for April 29, E1123 for November 23).
_GLOG_TIME = re.compile(r"\[?[IWEF](?P<mo>[01]?\d)(?P<d>\d\d) (?P<h>\d\d):(?P<mi>\d\d):(?P<s>\d\d)(?:\.(?P<f>\d+))?")
_ISO_TIME = re.compile(r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)[ T_](?P<h>\d\d):(?P<mi>\d\d):(?P<s>\d\d)(?:[.,](?P<f>\d+))?")


@dataclass(frozen=True)
class Origin:
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    task: Optional[int] = None  # srun's task id when it is not the rank (one torchrun per node)


# Under a label, torchrun's own lines (any torch), or its --tee prefix `[default0]:`.
_LAUNCHER_UNDER_LABEL = re.compile(r"(?m)^\s{0,6}\d{1,6}: (?:\[(?!rank\d)[A-Za-z_][\w-]*?\d+\]:|.*(?:"
                                   r"torch\.distributed\.run|torch/distributed/run\.py|elastic/multiprocessing|"
                                   r"ChildFailedError))")
_LABELLED_RANK = re.compile(r"(?m)^\s{0,6}(\d{1,6}): \[rank(\d+)\]:")


def srun_runs_launchers(text: str) -> bool:
    """`srun --label torchrun ...`: labels are node-level tasks (one torchrun each), not ranks.

    torch itself prefixes `[rankN]:` (2.3 and later) even when srun starts the ranks, so a
    label followed by the same rank says nothing; a label followed by another rank, or
    torchrun's own lines under a label, do.
    """
    if _LAUNCHER_UNDER_LABEL.search(text):
        return True
    return any(a != b for a, b in _LABELLED_RANK.findall(text))


def detect_style(text: str) -> LineStyle:
    """What the prefixes of a file mean, from its first chunk."""
    return LineStyle(srun_label_is_rank=not srun_runs_launchers(text), pdsh_hosts=pdsh_hosts(text),
                     mpi_rank_brackets=bool(_MPI_LAUNCH.search(text)))


def _seconds(m: "re.Match[str]") -> float:
    """Seconds since the start of a year of 31-day months: glog has no year, so neither may ISO.

    Only the order matters (first error wins), and a job rarely spans New Year.
    """
    frac = float("0." + m.group("f")) if m.group("f") else 0.0
    return ((int(m.group("mo")) * 31 + int(m.group("d"))) * 86400 + int(m.group("h")) * 3600
            + int(m.group("mi")) * 60 + int(m.group("s")) + frac)


def line_time(message: str, line: str = "") -> Optional[float]:
    """The line's own timestamp, if it carries one near its start: the message's, else the
    one a collector put in front of the whole line."""
    for text in (message, line):
        head = text[:64]
        m = _GLOG_TIME.match(head) or _ISO_TIME.search(head)
        if m:
            return _seconds(m)
    return None


def split_prefixes(line: str, style: LineStyle = LineStyle()) -> tuple[Origin, str]:
    """(who printed it, the message without collectors' and launchers' prefixes)."""
    rank = local_rank = task = None
    pid = None
    host, line = strip_collectors(line, style)
    pos = 0
    label = _SRUN_LABEL.match(line)
    mpi = _MPI_RANK.match(line) if style.mpi_rank_brackets else None
    if label:
        if style.srun_label_is_rank:
            rank = int(label.group("task"))
        else:
            task = int(label.group("task"))
        pos = label.end()
    elif mpi:
        rank, pos = int(mpi.group("rank")), mpi.end()
    while True:
        m = _LAUNCHER_PREFIX.match(line, pos)
        if not m:
            break
        if m.group("lightning") or m.group("mpi"):
            rank = int(m.group("lnum") or m.group("mpi"))
        elif m.group("role").lower() == "rank":
            rank = int(m.group("num"))
        else:
            local_rank = int(m.group("num"))
        pos = m.end()
        while pos < len(line) and line[pos] == " ":
            pos += 1
    message = line[pos:]
    nccl = _NCCL_LINE.match(message)
    if nccl:
        host = host or nccl.group("host")
        pid = int(nccl.group("pid"))
    if rank is None:
        named = _MESSAGE_RANK.search(message)
        # A subgroup's `Rank N` is its rank within that group, not the job's.
        if named and named.group("pg") in (None, "0"):
            rank = int(named.group("rank"))
    return Origin(rank, local_rank, host, pid, task), message
