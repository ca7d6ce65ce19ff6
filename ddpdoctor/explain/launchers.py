"""Launchers' summaries of a worker's end: who ended, how, and what a signal usually means.

torchrun, srun, mpirun, mpiexec, the DeepSpeed launcher and `subprocess` (the old
`torch.distributed.launch`, `accelerate launch`) each report a worker's end in their own
words. They are exit records: a rank's own error, when it printed one, says more and wins;
without one, the signal is the cause (SIGKILL: the OOM killer or a scheduler; SIGSEGV: a
crash in native code; SIGABRT: an abort). Some of them do not know the rank: the DeepSpeed
launcher prints the command line of the last worker it started, not the one that failed,
and `subprocess` the same, so a rank is never read from their command line.
"""

from __future__ import annotations

import re
from typing import Any, Optional

EXIT_RECORDS = frozenset({"elastic_block", "elastic_failed", "srun_task", "deepspeed_exit", "called_process",
                          "mpi_signal", "mpi_exit", "hydra_exit"})
# Exit records that name the rank (MPI ranks are the job's ranks) or the host in their own words.
RANK_FIELD = frozenset({"mpi_signal", "mpi_exit", "hydra_exit"})
# Causes that end the whole job, never one rank's: not given to "the only rank that failed".
JOB_LEVEL = frozenset({"launcher_signal", "slurm_cancelled"})
LAUNCHER_LINES = (EXIT_RECORDS | JOB_LEVEL) - {"elastic_block"}
HOST_FIELD = frozenset({"mpi_signal", "hydra_exit", "slurm_cancelled"})

_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL", 11: "SIGSEGV",
            15: "SIGTERM"}
_SRUN_WORDS = {"Killed": "SIGKILL", "Out Of Memory": "SIGKILL", "Segmentation fault": "SIGSEGV",
               "Aborted": "SIGABRT", "Bus error": "SIGBUS", "Terminated": "SIGTERM"}
# The launcher's own stop (SIGTERM, exit 143) is never a worker's cause.
STOPPED = ("SIGTERM", "SIGHUP", "SIGINT")

_HYDRA_FIELD = re.compile(r"=\s+(?:RANK (?P<rank>\d+) )?PID (?P<pid>\d+) RUNNING AT (?P<host>\S+)|"
                          r"=\s+EXIT CODE: (?P<exitcode>-?\d+)|KILLED BY SIGNAL: (?P<signum>\d+)|"
                          r"EXIT STRING: .*\(signal (?P<strsig>\d+)\)")
_CMD_LOCAL_RANK = re.compile(r"--local[_-]rank['=, ]+(?P<local>\d+)")
_MPI_EXIT_CODE = re.compile(r"Exit code:\s+(?P<exitcode>-?\d+)")


def signal_name(number: Any) -> Optional[str]:
    try:
        n = int(number)
    except (TypeError, ValueError):
        return None
    return _SIGNALS.get(n, f"signal {n}")


def exit_signal(fields: dict[str, Any], sig: str) -> Optional[str]:
    """The signal that ended the worker, as the exit record says it or as its exit code implies
    (-9 from Python's subprocess, 137 = 128 + 9 from a shell or a container)."""
    if fields.get("signal"):
        named = str(fields["signal"])
        return named if named.startswith("SIG") else signal_name(named)
    for key in ("signum", "strsig"):
        if fields.get(key):
            return signal_name(fields[key])
    if sig == "srun_task" and str(fields.get("what")) in _SRUN_WORDS:
        return _SRUN_WORDS[str(fields["what"])]
    code = fields.get("exitcode", fields.get("code"))
    try:
        value = int(code)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if value < 0:
        return signal_name(-value)
    if 128 < value <= 128 + 15 and value - 128 in (6, 9, 11):
        return signal_name(value - 128)
    return None


def ended_badly(fields: dict[str, Any], sig: str) -> bool:
    """A worker's end that is a failure of its own: a signal its launcher did not send, or a non-zero exit."""
    signal = exit_signal(fields, sig)
    if signal:
        return signal not in STOPPED
    code = str(fields.get("exitcode", fields.get("code")))
    return code not in ("0", "None", "143", "-15")


def command_rank(fields: dict[str, Any], host: Optional[str]) -> Optional[int]:
    """The rank behind a launcher's command line. The DeepSpeed launcher prints the last worker
    it started, which is the failed one only when it is the only one: `--local_rank=0` on a
    one-node job (no pdsh host) is rank 0. The old `torch.distributed.launch` raised with its
    loop variable (`cmd=cmd`: the last worker started, never read) or, in the versions whose
    traceback shows `cmd=process.args` (`failed_args`), with the failed worker's own command:
    its local rank, the rank on one node (no pdsh host)."""
    m = _CMD_LOCAL_RANK.search(str(fields.get("cmd", "")))
    if not m or host is not None:
        return None
    if fields.get("failed_args"):
        return int(m.group("local"))
    return 0 if m.group("local") == "0" else None


def read_block(sig: str, chunk: str, end: int) -> dict[str, Any]:
    """What a multi-line exit report says below its first line (OpenMPI's `Exit code:`, Hydra's
    `RANK 3 PID 123 RUNNING AT node01` and `KILLED BY SIGNAL: 9`)."""
    after = chunk[end + 1:end + 800].splitlines()[:6]
    out: dict[str, Any] = {}
    pattern = _HYDRA_FIELD if sig == "hydra_exit" else _MPI_EXIT_CODE
    for line in after:
        m = pattern.search(line)
        if m:
            out.update({k: v for k, v in m.groupdict().items() if v is not None})
    return out
