"""Who am I? Reading the rank variables of whichever launcher started this process.

ddpdoctor never brings its own cluster launcher: it is either the parent that spawns
local ranks (no rank variables), one of those ranks, a torchrun worker or a Slurm task.
Each variable is validated here, so a bad environment is one clear line, not a hang.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.runtime import slurm

# Set by our own standalone launcher on the ranks it spawns.
LAUNCHER_PID_VAR = "DDPDOCTOR_LAUNCHER_PID"
RUN_ID_VAR = "DDPDOCTOR_RUN_ID"
BACKEND_VAR = "DDPDOCTOR_BACKEND"
DEVICE_VAR = "DDPDOCTOR_DEVICE"


@dataclass(frozen=True)
class LaunchEnv:
    mode: str  # "ddpdoctor" (our launcher), "torchrun", "slurm" or "env" (set by hand)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_host: str  # who serves the out-of-band store: "launcher", "agent" or "rank0"
    run_id: str
    hostname: str

    @property
    def hosts_store(self) -> bool:
        return self.store_host == "rank0" and self.rank == 0

    @property
    def is_reporter(self) -> bool:
        """Our launcher writes the report itself; elsewhere rank 0 does."""
        return self.store_host != "launcher" and self.rank == 0


NODE_NAME_VAR = "DDPDOCTOR_NODE_NAME"


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    """None means no launcher started us: we are the standalone parent."""
    # DDPDOCTOR_NODE_NAME lets a fire drill (or a container whose hostname says nothing)
    # name the node a rank reports as; grouping by node follows it.
    hostname = environ.get(NODE_NAME_VAR) or socket.gethostname()
    if LAUNCHER_PID_VAR in environ:
        return _from_rank_vars(environ, "ddpdoctor", "launcher", hostname)
    if "RANK" in environ or "WORLD_SIZE" in environ:
        mode = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return _from_rank_vars(environ, mode, "agent" if agent else "rank0", hostname)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return _from_slurm(environ, hostname)
    return None


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None, lo: int = 0,
         hi: Optional[int] = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(f"{name} is not set: launch with torchrun or srun, "
                             "or set it with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer: fix the variable or unset it") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise UsageError(f"{name}={value} is out of range: it must be {bound}")
    return value


def _from_rank_vars(environ: Mapping[str, str], mode: str, store_host: str, hostname: str) -> LaunchEnv:
    world = _int(environ, "WORLD_SIZE", lo=1)
    rank = _int(environ, "RANK", lo=0, hi=world - 1)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", default=world, lo=1, hi=world)
    local_rank = _int(environ, "LOCAL_RANK", default=rank % local_world, lo=0, hi=local_world - 1)
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise UsageError("MASTER_ADDR is not set: set it to the address of the rank-0 host "
                         "(torchrun and srun scripts usually do)")
    port = _int(environ, "MASTER_PORT", lo=1, hi=65535)
    run_id = environ.get(RUN_ID_VAR) or environ.get("TORCHELASTIC_RUN_ID") or f"{addr}:{port}"
    return LaunchEnv(mode, rank, world, local_rank, local_world, addr, port, store_host, run_id, hostname)


def _from_slurm(environ: Mapping[str, str], hostname: str) -> LaunchEnv:
    world = _int(environ, "SLURM_NTASKS", lo=1)
    rank = _int(environ, "SLURM_PROCID", lo=0, hi=world - 1)
    per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or str(world)
    local_world = min(slurm.tasks_per_node(per_node), world)
    local_rank = _int(environ, "SLURM_LOCALID", default=0, lo=0)
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise UsageError("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: export MASTER_ADDR in the sbatch script")
        addr = slurm.first_host(nodelist)
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT", lo=1, hi=65535)
    else:
        # Same on every task of the step, different for concurrent jobs on one node.
        job = _int(environ, "SLURM_JOB_ID", default=0)
        port = 20000 + job % 20000
    job_id = environ.get("SLURM_JOB_ID", "0")
    step_id = environ.get("SLURM_STEP_ID", "0")
    return LaunchEnv("slurm", rank, world, local_rank, local_world, addr, port, "rank0",
                     f"slurm-{job_id}.{step_id}", hostname)


# OpenMP's syntax: a thread count per nesting level, e.g. "8" or "8,2" (blanks allowed, as
# strtoul reads them); at most 999999 threads, so a typo of extra digits is caught too.
_COUNT = r"[ \t]*0*[1-9][0-9]{0,5}[ \t]*"
_THREAD_LIST = re.compile(rf"{_COUNT}(,{_COUNT})*")


def check_thread_vars(environ: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS that OpenMP cannot read is ignored with a warning, and every rank then
    starts one thread per core: a crowded node that looks like a slow one. Refused here."""
    raw = environ.get("OMP_NUM_THREADS")
    if raw is None or _THREAD_LIST.fullmatch(raw):
        return
    raise UsageError(f"OMP_NUM_THREADS={raw!r} is not a number of threads: set it to a whole number from 1 "
                     "(e.g. cores per rank), or unset it")


def launcher_pid(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    raw = environ.get(LAUNCHER_PID_VAR)
    return int(raw) if raw and raw.isdigit() else None
