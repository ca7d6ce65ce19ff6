"""The limits of a rank's own container and node, as the rank sees them: /dev/shm, its rlimits,
its cgroup's pids, memory and CPU quota, the RDMA devices, the transport environment, free disk.

Why as the rank sees them: in a container the host's numbers lie. `/dev/shm` is the container's
own tmpfs (Docker gives 64 MB), the cgroup is the pod's or the Slurm job's, and the rlimits are
those the job script, the scheduler or `docker run --ulimit` set. So every reading here is made
from inside the rank's process: `os.statvfs` on its mount namespace's paths, `getrlimit`, and its
own `/proc/self/cgroup` paths.

Why cheap: `check` reads these before every job; each is a file read, one `getrlimit` or one
`statvfs` (a few ms in all, no subprocess). Reading only: what the readings mean for a job is
the limits probe's business (probes/limits/), so a snapshot can record them and be judged later.
"""

from __future__ import annotations

import os
import resource
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from ddpdoctor.core.facts import Facts, nested, nested_list
from ddpdoctor.measure.contention import cpu_cgroup_dir, cpu_quota

SHM_PATH = "/dev/shm"
INFINIBAND_PATH = "/sys/class/infiniband"
CGROUP_ROOT = "/sys/fs/cgroup"
# The environment the limits probe judges: transports switched off, devices named, and the
# settings whose cost the report should say. *_SOCKET_IFNAME is read by init-hang (INIT001).
ENV_KEYS = ("NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET",
            "CUDA_DEVICE_MAX_CONNECTIONS", "TMPDIR")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712).
UNLIMITED_BYTES = 1 << 60


@dataclass
class SpaceReading(Facts):
    """One filesystem as `os.statvfs` sees it from this rank (its own mount namespace)."""

    path: str = ""
    size_bytes: Optional[int] = None
    free_bytes: Optional[int] = None  # what an unprivileged writer may still use (f_bavail)
    error: Optional[str] = None

    OMIT_NONE = frozenset({"error"})


@dataclass
class Rlimit(Facts):
    """A `getrlimit` pair; None is RLIM_INFINITY (unlimited)."""

    soft: Optional[int] = None
    hard: Optional[int] = None


@dataclass
class CgroupLimits(Facts):
    """This process's cgroup limits (v2 unified, else the v1 controllers'); None: no limit or unreadable."""

    version: Optional[int] = None  # 1 or 2; None where /proc/self/cgroup could not be read
    pids_max: Optional[int] = None
    pids_current: Optional[int] = None
    memory_max_bytes: Optional[int] = None
    memory_current_bytes: Optional[int] = None
    cpu_quota: Optional[float] = None  # CPUs' worth per period (measure.contention.cpu_quota)


@dataclass
class LimitsFacts(Facts):
    """One rank's limits and what it holds of them now (read before the DDP workload)."""

    host: Optional[str] = None
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 0
    world_size: int = 0
    uid: Optional[int] = None  # RLIMIT_NPROC does not hold root back
    cpus: Optional[int] = None  # CPUs this rank may run on (its affinity)
    gpus: int = 0  # GPUs the node's ranks see (the hellos' CUDA devices): the job will use NCCL
    backend: Optional[str] = None
    # DataLoader workers per rank where the caller knows the loader (the callback); None: unknown (check).
    loader_workers: Optional[int] = None
    loader_batch_bytes: Optional[int] = None
    open_files: Optional[int] = None  # descriptors this rank holds now
    threads: Optional[int] = None  # threads this rank runs now
    rss_bytes: Optional[int] = None
    shm: SpaceReading = field(default_factory=SpaceReading, metadata=nested(SpaceReading))
    nofile: Rlimit = field(default_factory=Rlimit, metadata=nested(Rlimit))
    memlock: Rlimit = field(default_factory=Rlimit, metadata=nested(Rlimit))
    nproc: Rlimit = field(default_factory=Rlimit, metadata=nested(Rlimit))
    cgroup: CgroupLimits = field(default_factory=CgroupLimits, metadata=nested(CgroupLimits))
    rdma_devices: Optional[list[str]] = None  # /sys/class/infiniband; [] none, None unreadable
    env: dict[str, Optional[str]] = field(default_factory=dict)  # ENV_KEYS that are set
    disks: list[SpaceReading] = field(default_factory=list, metadata=nested_list(SpaceReading))


def space(path: str) -> SpaceReading:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return SpaceReading(path=path, error=f"{type(exc).__name__}: {exc.strerror or exc}")
    return SpaceReading(path=path, size_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


def rlimit(which: int) -> Rlimit:
    soft, hard = resource.getrlimit(which)
    return Rlimit(soft=None if soft == resource.RLIM_INFINITY else soft,
                  hard=None if hard == resource.RLIM_INFINITY else hard)


def _count(path: str) -> Optional[int]:
    try:
        return len(os.listdir(path))
    except OSError:
        return None


def _read_int(path: str) -> Optional[int]:
    """A cgroup number; None for "max", an absent file, or a v1 "unlimited" (UNLIMITED_BYTES and up)."""
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    if not text.lstrip("-").isdigit():
        return None
    value = int(text)
    return None if value < 0 or value >= UNLIMITED_BYTES else value


def _cgroup_paths(pid: str = "self") -> tuple[Optional[int], dict[str, str]]:
    """(version, controller -> directory) of this process's cgroups; v2 maps every controller to one."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None, {}
    dirs: dict[str, str] = {}
    for _, controllers, path in lines:
        for c in controllers.split(","):
            if c in ("pids", "memory") and os.path.isdir(f"/sys/fs/cgroup/{c}{path}"):
                dirs[c] = os.path.normpath(f"/sys/fs/cgroup/{c}{path}")
    if dirs:
        return 1, dirs
    for hid, controllers, path in lines:
        if hid == "0" and not controllers:
            base = os.path.normpath(f"/sys/fs/cgroup{path}")
            return 2, {"pids": base, "memory": base}
    return 1, {}


def _first(directory: Optional[str], *names: str) -> Optional[int]:
    if directory is None:
        return None
    for name in names:
        if os.path.exists(os.path.join(directory, name)):
            return _read_int(os.path.join(directory, name))
    return None


def _pids_max(directory: Optional[str], root: str = CGROUP_ROOT) -> Optional[int]:
    """The tightest pids.max on the way up: a v1 child group under a limited parent shows "max"."""
    tightest = None
    while directory and directory.startswith(root) and os.path.isdir(directory):
        value = _first(directory, "pids.max")
        if value is not None:
            tightest = value if tightest is None else min(tightest, value)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return tightest


def _memory(directory: Optional[str], root: str = CGROUP_ROOT) -> tuple[Optional[int], Optional[int]]:
    """(limit, usage) of the tightest memory limit on the way up, with the usage of that group: a
    Slurm job's limit sits on the job's group, above the step's and the task's."""
    best: tuple[Optional[int], Optional[int]] = (None, _first(directory, "memory.current", "memory.usage_in_bytes"))
    while directory and directory.startswith(root) and os.path.isdir(directory):
        limit = _first(directory, "memory.max", "memory.limit_in_bytes")
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, _first(directory, "memory.current", "memory.usage_in_bytes"))
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return best


def cgroup_limits(pid: str = "self") -> CgroupLimits:
    version, dirs = _cgroup_paths(pid)
    pids = dirs.get("pids")
    memory_max, memory_current = _memory(dirs.get("memory"))
    return CgroupLimits(
        version=version, pids_max=_pids_max(pids), pids_current=_first(pids, "pids.current"),
        memory_max_bytes=memory_max, memory_current_bytes=memory_current,
        cpu_quota=cpu_quota(cpu_cgroup_dir(pid)))


def rdma_devices() -> Optional[list[str]]:
    """InfiniBand/RoCE devices (mlx5_0, ...): NCCL's IB transport registers memory on them."""
    if not os.path.isdir(INFINIBAND_PATH):
        return []
    try:
        return sorted(os.listdir(INFINIBAND_PATH))
    except OSError:
        return None


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def write_paths(report_path: Optional[str]) -> list[str]:
    """Where the job writes: the report's folder (else the working directory) and TMPDIR, once each."""
    folder = os.path.dirname(os.path.abspath(report_path)) if report_path else os.getcwd()
    return list(dict.fromkeys([folder, tempfile.gettempdir()]))


def read_limits(report_path: Optional[str] = None) -> LimitsFacts:
    """This process's limits; the caller fills in who the rank is and what the job runs."""
    try:
        cpus: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    return LimitsFacts(
        uid=os.getuid(), cpus=cpus, open_files=_count("/proc/self/fd"), threads=_count("/proc/self/task"),
        rss_bytes=_rss_bytes(), shm=space(SHM_PATH),
        nofile=rlimit(resource.RLIMIT_NOFILE), memlock=rlimit(resource.RLIMIT_MEMLOCK),
        nproc=rlimit(resource.RLIMIT_NPROC), cgroup=cgroup_limits(), rdma_devices=rdma_devices(),
        env={k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        disks=[space(p) for p in write_paths(report_path)])
