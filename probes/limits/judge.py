"""The limits judged against what the job needs, per node (pure, on recorded facts).

A node's ranks share its /dev/shm and usually its cgroup; each rank has its own rlimits. So each
rule groups the ranks by host, takes the tightest reading among them, and raises one finding per
cause with every rank it concerns.

What a job needs, and why these numbers:
- /dev/shm. NCCL's shared-memory transport and proxy keep per-peer buffers there (4 MiB Simple +
  about 4.6 MiB LL128 + 0.5 MiB LL per channel and direction); NCCL's own advice for a container
  of 8 GPUs is `--shm-size=1g`, so 128 MiB a GPU rank (NCCL_SHM_PER_RANK). A DataLoader worker
  keeps `prefetch_factor` (2, torch's default) batches in /dev/shm; `check` does not know the
  loader, so it assumes one worker per spare core of the rank and an ImageNet batch of 64 in
  float32 (37 MiB): what a usual image loader holds, and what Docker's 64 MB cannot.
- Open files: what the rank holds now, plus FD_GROWTH for what training opens, FD_PER_PEER per
  other rank (gloo's pairs, NCCL's bootstrap and proxy sockets), FD_PER_GPU per GPU of the node
  (/dev/nvidia*, CUDA IPC handles), FD_PER_WORKER per DataLoader worker (its pipes, and one
  descriptor per tensor in flight under the file_descriptor sharing strategy).
- Pids: THREAD_GROWTH threads a rank adds once it trains (torch's intra-op pool, autograd's, the
  DDP reducer's, NCCL's or gloo's), TASKS_PER_WORKER per DataLoader worker (its process, its
  feeder thread, the pin-memory thread).
- Memory: a rank at least doubles the memory it holds before training (the model, its
  gradients, optimizer state and batches come on top of torch's import), so the cgroup must
  hold RSS_GROWTH times what the ranks hold now.
- CPU quota: a core per rank, and one per DataLoader worker where the loader is known (the
  reading is measure.contention's, the fix the stragglers' CPU-quota fix: one rule, two moments,
  before the job here and while it runs there).
- Free disk below DISK_MIN_FREE and the environment's costs are information: they slow or fail a
  job late, not at once. *_SOCKET_IFNAME naming an absent interface is init-hang's INIT001.
A limit below what the ranks hold now and must add for certain (their peers, their GPUs, NCCL's
buffers, a loader the caller knows) is CRITICAL: the job fails. Below that plus the estimates
(FD_GROWTH, THREAD_GROWTH, a loader check assumes) it is WARN: a usual job fails. Measured on the
project's 2-core VM (gloo, 2 ranks, torch 2.13): a rank holds 8 descriptors and 1 thread after its
imports, 14 to 25 and 4 to 5 after init_process_group, the same after 5 DDP steps, and 11 more
descriptors and 2 more threads with a DataLoader of 2 workers (each worker is a process of its own).
`check`'s own ranks ran under `ulimit -n 40`: the estimates are for the job, which opens more
(its data, logs, checkpoints, its loader's tensors).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.measure.limits import LimitsFacts, SpaceReading

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.stragglers.contention import FIX as CONTENTION_FIX

NAME = "limits"
MiB = 1 << 20
GiB = 1 << 30
NCCL_SHM_PER_RANK = 128 * MiB
LOADER_BATCH_BYTES = 64 * 3 * 224 * 224 * 4
PREFETCH_FACTOR = 2
FD_GROWTH = 64
FD_PER_PEER = 4
FD_PER_GPU = 16
FD_PER_WORKER = 32
THREAD_GROWTH = 16
TASKS_PER_WORKER = 3
RSS_GROWTH = 2.0
# Free space below this where the job writes is worth a line: a checkpoint or a compile cache is GBs.
DISK_MIN_FREE = 1 * GiB

# What setting each variable costs (LIM008), and when it matters.
ENV_COSTS = {
    "NCCL_P2P_DISABLE": ("GPUs of one node no longer copy to each other directly (NVLink, PCIe P2P): NCCL goes "
                         "through host memory (\"via SHM\"), several times slower.",
                         "Unset it unless a broken P2P path (TOP004) makes NCCL hang; fix that path instead."),
    "NCCL_SHM_DISABLE": ("NCCL may no longer use shared memory between the ranks of a node where P2P is not "
                         "possible: it goes through the network stack instead, slower.",
                         "Unset it once /dev/shm is large enough (LIM001)."),
    "NCCL_IB_DISABLE": ("NCCL does not use the InfiniBand/RoCE devices this node has: traffic between nodes "
                        "goes over TCP sockets, many times slower.",
                        "Unset it (or set NCCL_IB_HCA to the devices to use)."),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("The GPU runs the work of every stream through this many hardware queues; at "
                                    "1, DDP's gradient all-reduce cannot overlap the backward pass unless the "
                                    "framework orders it (Megatron sets it on purpose for tensor parallelism).",
                                    "Unset it unless your framework asks for it."),
}


@dataclass(frozen=True)
class Node:
    """One host's ranks and the readings the rules take from them."""

    host: str
    ranks: tuple[int, ...]
    facts: Mapping[int, LimitsFacts]
    local: int  # ranks on the node, as the launcher says or as counted
    world: int
    gpus: int

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.host,)

    @property
    def first(self) -> LimitsFacts:
        return self.facts[self.ranks[0]]

    @property
    def loader_known(self) -> bool:
        return self.first.loader_workers is not None

    @property
    def workers(self) -> int:
        """DataLoader workers per rank: the caller's, else one per spare core of the rank."""
        if self.first.loader_workers is not None:
            return int(self.first.loader_workers)
        cpus = max((int(self.facts[r].cpus or 0) for r in self.ranks), default=0)
        return max(1, cpus // max(self.local, 1) - 1)

    @property
    def batch_bytes(self) -> int:
        return int(self.first.loader_batch_bytes or LOADER_BATCH_BYTES)

    def loader_note(self) -> str:
        how = "as the job's loader has" if self.loader_known else "assumed: check does not know the job's loader"
        return (f"{self.workers} DataLoader worker(s) per rank, {PREFETCH_FACTOR} batches of "
                f"{_size(self.batch_bytes)} each in flight ({how})")


def _size(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def nodes_of(facts: Mapping[int, LimitsFacts], run: RunView) -> list[Node]:
    by_host: dict[str, list[int]] = defaultdict(list)
    for r in sorted(facts):
        by_host[run.hosts.get(r) or str(facts[r].host or "?")].append(r)
    out = []
    for host, ranks in sorted(by_host.items()):
        local = max(len(ranks), max(int(facts[r].local_world_size or 0) for r in ranks))
        world = max(run.world_size, max(int(facts[r].world_size or 0) for r in ranks))
        gpus = max(int(facts[r].gpus or 0) for r in ranks)
        out.append(Node(host, tuple(ranks), facts, local, world, gpus))
    return out


def _number_or_none(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            setattr(obj, name, None)


def readable(f: LimitsFacts) -> LimitsFacts:
    """The facts with every number that is not one (a damaged or foreign file) read as unknown:
    judged as not measured, never a crash (the facts' tolerant reading keeps what None-defaulted
    fields hold, whatever its kind)."""
    _number_or_none(f, ("uid", "cpus", "loader_workers", "loader_batch_bytes", "open_files", "threads", "rss_bytes"))
    for reading in (f.shm, *f.disks):
        _number_or_none(reading, ("size_bytes", "free_bytes"))
    for limit in (f.nofile, f.memlock, f.nproc):
        _number_or_none(limit, ("soft", "hard"))
    _number_or_none(f.cgroup, ("pids_max", "pids_current", "memory_max_bytes", "memory_current_bytes", "cpu_quota"))
    if not isinstance(f.rdma_devices, list) or not all(isinstance(d, str) for d in f.rdma_devices):
        f.rdma_devices = None
    f.env = {k: v for k, v in f.env.items() if isinstance(v, str)}
    return f


def judge(facts: Mapping[int, LimitsFacts], run: RunView) -> list[Finding]:
    facts = {r: readable(f) for r, f in facts.items()}
    findings: list[Finding] = []
    nodes = nodes_of(facts, run)
    for node in nodes:
        for rule in (shm, open_files, memlock, pids, memory, cpu_quota, ib_hca):
            found = rule(node)
            if found is not None:
                findings.append(found)
    findings += environment(nodes) + disk_space(nodes)
    if facts and not any(f.severity >= Severity.WARN for f in findings):
        findings.append(_all_clear(nodes, run))
    return findings


def _grade(limit: float, need_known: float, need_assumed: float) -> Optional[Severity]:
    if limit < need_known:
        return Severity.CRITICAL
    if limit < need_assumed:
        return Severity.WARN
    return None


def shm(node: Node) -> Optional[Finding]:
    """LIM001: /dev/shm's free space against NCCL's shared-memory buffers and the loader's batches."""
    readings = [node.facts[r].shm for r in node.ranks if node.facts[r].shm.free_bytes is not None]
    if not readings:
        return None
    tight = min(readings, key=lambda s: int(s.free_bytes or 0))
    free = int(tight.free_bytes or 0)
    nccl = NCCL_SHM_PER_RANK * node.local if node.gpus > 0 and node.local > 1 else 0
    loader = node.local * node.workers * PREFETCH_FACTOR * node.batch_bytes
    severity = _grade(free, nccl + (loader if node.loader_known else 0), nccl + loader)
    if severity is None:
        return None
    return codes.finding(
        "LIM001", NAME,
        f"/dev/shm on {node.host} has {_size(free)} free of {_size(tight.size_bytes)}: the job needs about "
        f"{_size(nccl + loader)} there",
        severity=severity, ranks=node.ranks, nodes=node.nodes,
        evidence={"shm_size_bytes": tight.size_bytes, "shm_free_bytes": free, "needed_bytes": nccl + loader,
                  "nccl_shm_bytes": nccl, "dataloader_shm_bytes": loader, "local_ranks": node.local,
                  "gpus": node.gpus, "dataloader": node.loader_note(),
                  "expected_errors": ["Bus error", "insufficient shared memory (shm)",
                                      "unable to extend /dev/shm" if nccl else "No space left on device"]})


def open_files(node: Node) -> Optional[Finding]:
    """LIM002: RLIMIT_NOFILE against the descriptors the rank holds and will open."""
    limited = [r for r in node.ranks if node.facts[r].nofile.soft is not None]
    if not limited:
        return None
    now = max(int(node.facts[r].open_files or 0) for r in node.ranks)
    base = now + FD_PER_PEER * max(node.world - 1, 0) + FD_PER_GPU * node.gpus
    loader = FD_PER_WORKER * node.workers
    graded = {r: _grade(int(node.facts[r].nofile.soft or 0), base + (loader if node.loader_known else 0),
                        base + FD_GROWTH + loader) for r in limited}
    ranks = tuple(r for r, s in graded.items() if s is not None)
    if not ranks:
        return None
    severity = max(s for s in graded.values() if s is not None)
    soft = min(int(node.facts[r].nofile.soft or 0) for r in ranks)
    hard = node.facts[ranks[0]].nofile.hard
    return codes.finding(
        "LIM002", NAME,
        f"Open files are limited to {soft} (ulimit -n) on rank {rank_ranges(ranks)} ({node.host}): "
        f"the job needs about {base + FD_GROWTH + loader}",
        severity=severity, ranks=ranks, nodes=node.nodes,
        evidence={"nofile_soft": soft, "nofile_hard": "unlimited" if hard is None else hard,
                  "open_now": now, "needed": base + FD_GROWTH + loader, "needed_without_assumptions": base,
                  "world_size": node.world, "gpus": node.gpus,
                  "dataloader": node.loader_note(),
                  "expected_errors": ["Too many open files", "received 0 items of ancdata"]})


def memlock(node: Node) -> Optional[Finding]:
    """LIM003: a finite RLIMIT_MEMLOCK on a node with an InfiniBand/RoCE device."""
    devices = sorted({d for r in node.ranks for d in node.facts[r].rdma_devices or ()})
    limited = tuple(r for r in node.ranks if node.facts[r].memlock.soft is not None)
    if not devices or not limited:
        return None
    soft = min(int(node.facts[r].memlock.soft or 0) for r in limited)
    return codes.finding(
        "LIM003", NAME,
        f"Locked memory is limited to {_size(soft)} (ulimit -l) on rank {rank_ranges(limited)} ({node.host}), "
        f"which has RDMA devices {', '.join(devices)}: NCCL's IB transport needs it unlimited",
        severity=Severity.CRITICAL if node.gpus > 0 else Severity.INFO, ranks=limited, nodes=node.nodes,
        evidence={"memlock_soft_bytes": soft, "memlock_hard_bytes": node.facts[limited[0]].memlock.hard,
                  "rdma_devices": devices, "gpus": node.gpus,
                  "expected_errors": ["ibv_reg_mr failed", "Cannot allocate memory"]})


def pids(node: Node) -> Optional[Finding]:
    """LIM004: the cgroup's pids.max (room left) or RLIMIT_NPROC (non-root) against the threads to come."""
    first = node.first
    threads_now = max(int(node.facts[r].threads or 1) for r in node.ranks)
    growth = node.local * THREAD_GROWTH
    loader = node.local * node.workers * TASKS_PER_WORKER
    cg = next((node.facts[r].cgroup for r in node.ranks if node.facts[r].cgroup.pids_max is not None), None)
    if cg is not None and cg.pids_max is not None:
        current = cg.pids_current if cg.pids_current is not None else node.local * threads_now
        room = int(cg.pids_max) - int(current)
        severity = _grade(room, loader if node.loader_known else 0, growth + loader)
        if severity is not None:
            return codes.finding(
                "LIM004", NAME,
                f"The cgroup of {node.host} allows {cg.pids_max} tasks (pids.max) and holds {current}: room for "
                f"{room}, the ranks will start about {growth + loader} more",
                severity=severity, ranks=node.ranks, nodes=node.nodes,
                evidence={"pids_max": cg.pids_max, "pids_current": current, "room": room,
                          "needed": growth + loader, "threads_per_rank_now": threads_now,
                          "dataloader": node.loader_note(),
                          "expected_errors": ["Resource temporarily unavailable", "can't start new thread"]})
    limited = [r for r in node.ranks if node.facts[r].nproc.soft is not None and node.facts[r].uid != 0]
    if not limited:
        return None  # RLIMIT_NPROC does not hold root (CAP_SYS_RESOURCE) back
    need = node.local * threads_now + growth
    soft = min(int(node.facts[r].nproc.soft or 0) for r in limited)
    severity = _grade(soft, node.local * threads_now + (loader if node.loader_known else 0), need + loader)
    if severity is None:
        return None
    return codes.finding(
        "LIM004", NAME,
        f"Processes and threads are limited to {soft} (ulimit -u) on rank {rank_ranges(limited)} ({node.host}): "
        f"its ranks alone need about {need + loader}",
        severity=severity, ranks=tuple(limited), nodes=node.nodes,
        evidence={"nproc_soft": soft, "needed": need + loader, "threads_per_rank_now": threads_now,
                  "dataloader": node.loader_note(), "uid": first.uid,
                  "expected_errors": ["Resource temporarily unavailable", "can't start new thread"]})


def memory(node: Node) -> Optional[Finding]:
    """LIM005: the cgroup's memory limit against RSS_GROWTH times what the node's ranks hold now."""
    cg = next((node.facts[r].cgroup for r in node.ranks if node.facts[r].cgroup.memory_max_bytes is not None), None)
    if cg is None or cg.memory_max_bytes is None:
        return None
    rss = [int(b) for r in node.ranks if (b := node.facts[r].rss_bytes)]
    if not rss:
        return None
    held = max(rss) * node.local
    used = int(cg.memory_current_bytes) if cg.memory_current_bytes is not None else held
    need = used + (RSS_GROWTH - 1) * held  # what is used now, plus the growth of each rank
    if cg.memory_max_bytes >= need:
        return None
    return codes.finding(
        "LIM005", NAME,
        f"The memory limit of {node.host}'s cgroup is {_size(cg.memory_max_bytes)}, {_size(used)} in use: its "
        f"{node.local} ranks holding {_size(max(rss))} each before training will need about {_size(need)}",
        ranks=node.ranks, nodes=node.nodes,
        evidence={"memory_max_bytes": cg.memory_max_bytes, "memory_current_bytes": cg.memory_current_bytes,
                  "rss_per_rank_bytes": max(rss), "needed_bytes": int(need), "local_ranks": node.local,
                  "expected_errors": ["Killed", "is killed by signal: Killed", "oom-kill"]})


def cpu_quota(node: Node) -> Optional[Finding]:
    """LIM006: the cgroup's CPU quota (measure.contention's reading) below a core per rank (and worker)."""
    quotas = [q for r in node.ranks if (q := node.facts[r].cgroup.cpu_quota) is not None]
    if not quotas:
        return None
    quota = min(quotas)
    need = node.local * (1 + node.workers) if node.loader_known else node.local
    if quota >= need:
        return None
    return codes.finding(
        "LIM006", NAME,
        f"The CPU quota of {node.host}'s cgroup is {quota:.2g} CPUs for {node.local} ranks"
        + (f" and their {node.workers} DataLoader workers each" if node.loader_known else ""),
        ranks=node.ranks, nodes=node.nodes,
        evidence={"cpu_quota_cpus": quota, "cpus_needed": need, "local_ranks": node.local},
        fix=CONTENTION_FIX["CPU quota"])


def _hca_entries(value: str) -> tuple[bool, list[str]]:
    """NCCL_IB_HCA as NCCL reads it: (exact names?, device names) without ports; [] for an exclude list."""
    text = value.strip()
    if text.startswith("^"):
        return False, []
    exact = text.startswith("=")
    names = [e.split(":")[0].strip() for e in text.lstrip("=").split(",") if e.split(":")[0].strip()]
    return exact, names


def ib_hca(node: Node) -> Optional[Finding]:
    """LIM007: NCCL_IB_HCA names RDMA devices this node does not have."""
    value = next((node.facts[r].env.get("NCCL_IB_HCA") for r in node.ranks if node.facts[r].env.get("NCCL_IB_HCA")),
                 None)
    readable = [node.facts[r].rdma_devices for r in node.ranks if node.facts[r].rdma_devices is not None]
    if not value or not readable:
        return None
    devices = sorted({d for ds in readable for d in ds or ()})
    exact, names = _hca_entries(value)
    absent = [n for n in names if not any(d == n if exact else d.startswith(n) for d in devices)]
    if not absent:
        return None
    ranks = tuple(r for r in node.ranks if node.facts[r].env.get("NCCL_IB_HCA") == value)
    return codes.finding(
        "LIM007", NAME, f"NCCL_IB_HCA={value} names {', '.join(absent)}, which {node.host} does not have",
        ranks=ranks, nodes=node.nodes,
        evidence={"NCCL_IB_HCA": value, "absent": absent, "rdma_devices": devices,
                  "expected_errors": ["NET/IB : No device found", "NET/Socket"]})


def _is_set(value: Optional[str]) -> bool:
    return value is not None and value.strip() not in ("", "0")


def environment(nodes: list[Node]) -> list[Finding]:
    """LIM008: variables that switch a transport off or serialise the GPU's queues, one finding per setting."""
    by_setting: dict[tuple[str, str], list[int]] = defaultdict(list)
    hosts: dict[tuple[str, str], set[str]] = defaultdict(set)
    for node in nodes:
        for r in node.ranks:
            env = node.facts[r].env
            for var in ENV_COSTS:
                value = env.get(var)
                if var == "CUDA_DEVICE_MAX_CONNECTIONS":
                    matters = value is not None and value.strip() == "1"
                elif var == "NCCL_IB_DISABLE":
                    matters = _is_set(value) and bool(node.facts[r].rdma_devices)
                else:
                    matters = _is_set(value)
                if matters and value is not None:
                    by_setting[(var, value)].append(r)
                    hosts[(var, value)].add(node.host)
    out = []
    for (var, value), ranks in sorted(by_setting.items()):
        why, fix = ENV_COSTS[var]
        out.append(codes.finding(
            "LIM008", NAME, f"{var}={value} is set on rank {rank_ranges(ranks)}", ranks=tuple(sorted(ranks)),
            nodes=tuple(sorted(hosts[(var, value)])), evidence={"variable": var, "value": value}, why=why, fix=fix))
    return out


def disk_space(nodes: list[Node]) -> list[Finding]:
    """LIM009: free space below DISK_MIN_FREE where the job writes (the report's folder, TMPDIR)."""
    low: dict[tuple[str, str], tuple[SpaceReading, list[int]]] = {}
    for node in nodes:
        for r in node.ranks:
            for d in node.facts[r].disks:
                if d.free_bytes is not None and d.free_bytes < DISK_MIN_FREE:
                    low.setdefault((node.host, d.path), (d, []))[1].append(r)
    out = []
    for (host, path), (d, ranks) in sorted(low.items()):
        out.append(codes.finding(
            "LIM009", NAME, f"{path} on {host} has {_size(d.free_bytes)} free", ranks=tuple(ranks), nodes=(host,),
            evidence={"path": path, "free_bytes": d.free_bytes, "size_bytes": d.size_bytes,
                      "threshold_bytes": DISK_MIN_FREE}))
    return out


def _all_clear(nodes: list[Node], run: RunView) -> Finding:
    ranks = tuple(r for n in nodes for r in n.ranks)
    summary: dict[str, Any] = {}
    for n in nodes:
        f = n.first
        free = [int(b) for r in n.ranks if (b := n.facts[r].shm.free_bytes) is not None]
        nofile = [int(s) for r in n.ranks if (s := n.facts[r].nofile.soft) is not None]
        summary[n.host] = {"shm_free": _size(min(free)) if free else "unknown",
                           "nofile": min(nofile) if nofile else "unlimited",
                           "pids_max": f.cgroup.pids_max if f.cgroup.pids_max is not None else "unlimited",
                           "memory_max": _size(f.cgroup.memory_max_bytes) if f.cgroup.memory_max_bytes else "unlimited",
                           "cpu_quota": f.cgroup.cpu_quota if f.cgroup.cpu_quota is not None else "none",
                           "rdma_devices": f.rdma_devices}
    return codes.finding(
        "LIM000", NAME, f"The limits of {len(ranks)} rank(s) on {len(nodes)} node(s) leave room for this job",
        ranks=ranks, nodes=run.nodes_of(ranks) or tuple(n.host for n in nodes),
        evidence={"by_node": summary})
