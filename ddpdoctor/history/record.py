"""A run -> the rows the history store keeps: from the report JSON, a snapshot, or the callback.

Read from the wire JSON (docs/report-schema.md, the snapshot's file), not from the probes'
typed facts: the probes sit above this room, and a report of any age is recorded the same way.
What is recorded, per node and per device, is what a fleet's verdicts compare over time:

| metric | from | unit |
|---|---|---|
| compute_speed | homogeneity: the rank's best matmul round (what the probe compares peers by) | flop/s |
| step_ms | homogeneity: the median DDP step; the callback: the median step of its last windows | ms |
| wait_ms | the callback: the median gradient all-reduce wait of its last windows | ms |
| busbw_gbs, algbw_gbs | allreduce: the largest size, slowest rank per iteration, median (as the probe) | GB/s |
| busbw_gbs@<bytes> | allreduce-bench: every size of the sweep | GB/s |
| ecc_uncorrected_volatile, ecc_uncorrected_aggregate | NVML's uncorrected ECC counts | count |
| remapped_rows_pending, remapped_rows_failure | NVML's remap flags, as 1 or 0 | flag |
| remapped_rows_correctable, remapped_rows_uncorrectable | NVML's remapped rows | count |
| retired_pages | NVML's single- plus double-bit retired pages | count |
| shm_size_bytes, shm_free_bytes, memlock_soft_bytes, memory_max_bytes | limits: the node's first rank's readings | bytes |
| nofile_soft, nproc_soft, pids_max; cpu_quota | limits, as above (an unlimited limit is not recorded) | count; CPUs |

A reading NVML could not make (`{"unknown": reason}`) is not recorded: absent is not zero.
A bandwidth is the world's figure, one row per node of the run (rank NULL): a collective is as
fast as its slowest rank, so the per-node trend says which node's runs got slower.
"""

from __future__ import annotations

import datetime
import statistics
import uuid
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence

from ddpdoctor import __version__
from ddpdoctor.core.findings import Finding, exit_code_for, rank_ranges
from ddpdoctor.history.store import FindingRow, Measurement, NodeRow, RunRow, RunRows
from ddpdoctor.judge.busbw import algbw_gbps, busbw_gbps, slowest_per_iteration

VERDICTS = {0: "ok", 1: "warning", 2: "critical", 3: "unknown"}  # as core/report.py's, by exit code
COMMANDS = ("check", "allreduce-bench")

# (metric, path into the GPU facts, unit); a bool is stored as 1.0 / 0.0.
_GPU_COUNTERS: tuple[tuple[str, tuple[str, str], str], ...] = (
    ("ecc_uncorrected_volatile", ("ecc_uncorrected", "volatile"), "count"),
    ("ecc_uncorrected_aggregate", ("ecc_uncorrected", "aggregate"), "count"),
    ("remapped_rows_pending", ("remapped_rows", "pending"), "flag"),
    ("remapped_rows_failure", ("remapped_rows", "failed"), "flag"),
    ("remapped_rows_correctable", ("remapped_rows", "correctable"), "count"),
    ("remapped_rows_uncorrectable", ("remapped_rows", "uncorrectable"), "count"),
)


class RankTimes(Protocol):
    """One rank's window of the callback (callback.online_checks.RankWindow has these)."""

    rank: int
    host: str
    step_ms: list[float]
    wait_ms: list[float]
    wait_measured: bool


def new_run_id() -> str:
    return uuid.uuid4().hex


def from_report(report: Mapping[str, Any], *, label: Optional[str] = None) -> RunRows:
    """A `check` or `allreduce-bench` report (Report.to_json) as rows."""
    run_id = new_run_id()
    command = list(report.get("command") or [])
    name = command[1] if len(command) > 1 and command[1] in COMMANDS else "check"
    hosts = {int(r["rank"]): str(r.get("host") or "?") for r in report.get("ranks") or []}
    run = RunRow(run_id=run_id, started_at=float(report.get("started_at") or 0.0), command=name,
                 verdict=str(report.get("verdict") or "unknown"), exit_code=int(report.get("exit_code", 3)),
                 world_size=int(report.get("world_size") or len(hosts)),
                 ddpdoctor_version=str(report.get("ddpdoctor_version") or __version__), label=label)
    nodes = [NodeRow(run_id, str(n["host"]), str(n.get("ranks") or ""))
             for n in report.get("by_node") or [] if n.get("host") not in (None, "?")]
    facts = {str(p.get("name")): p.get("facts") or {} for p in report.get("probes") or []}
    measurements: list[Measurement] = []
    for key, device in sorted((facts.get("homogeneity") or {}).items(), key=lambda kv: int(kv[0])):
        rank = int(key)
        measurements += _device_rows(run_id, hosts.get(rank) or str(device.get("host") or "?"), rank, device)
    measurements += _bandwidth_rows(run_id, [n.node for n in nodes], facts.get("allreduce") or {},
                                    per_size=name == "allreduce-bench")
    measurements += _limits_rows(run_id, facts.get("limits") or {}, hosts)
    findings = [row for f in report.get("findings") or [] for row in _finding_rows(run_id, f, hosts)]
    return RunRows(run, nodes, measurements, findings)


def from_snapshot(snapshot: Mapping[str, Any], *, label: Optional[str] = None) -> RunRows:
    """`ddpdoctor snapshot`'s file as rows: one node, its devices as ranks, no findings."""
    run_id = new_run_id()
    host = str(snapshot.get("host") or "?")
    devices = list((snapshot.get("probes") or {}).get("homogeneity") or [])
    run = RunRow(run_id=run_id, started_at=_epoch(snapshot.get("created")), command="snapshot", verdict="ok",
                 exit_code=0, world_size=len(devices), ddpdoctor_version=str(snapshot.get("ddpdoctor_version")),
                 label=label)
    ranks = [int(d.get("rank", i)) for i, d in enumerate(devices)]
    measurements = [row for rank, d in zip(ranks, devices) for row in _device_rows(run_id, host, rank, d)]
    limits = list((snapshot.get("probes") or {}).get("limits") or [])
    measurements += _limits_rows(run_id, {str(i): f for i, f in enumerate(limits[:1])}, {0: host})
    return RunRows(run, [NodeRow(run_id, host, rank_ranges(ranks))], measurements, [])


def from_callback(windows: Sequence[Mapping[int, RankTimes]], findings: Sequence[Finding], *, world_size: int,
                  started_at: float, label: Optional[str] = None) -> RunRows:
    """The callback's run (rank 0's view at close): its last gathered windows and every finding."""
    run_id = new_run_id()
    code = exit_code_for(f.severity for f in findings)
    run = RunRow(run_id=run_id, started_at=started_at, command="callback", verdict=VERDICTS[code], exit_code=code,
                 world_size=world_size, ddpdoctor_version=__version__, label=label)
    hosts: dict[int, str] = {}
    step: dict[int, list[float]] = {}
    wait: dict[int, list[float]] = {}
    for gathered in windows:
        for rank, window in gathered.items():
            hosts[rank] = window.host
            step.setdefault(rank, []).extend(window.step_ms)
            if window.wait_measured:
                wait.setdefault(rank, []).extend(window.wait_ms)
    by_node: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        by_node.setdefault(host, []).append(rank)
    measurements = [Measurement(run_id, hosts[r], r, None, None, metric, statistics.median(values), "ms")
                    for metric, series in (("step_ms", step), ("wait_ms", wait))
                    for r, values in sorted(series.items()) if values]
    rows = [row for f in findings for row in _finding_rows(run_id, f.to_json(), hosts)]
    return RunRows(run, [NodeRow(run_id, h, rank_ranges(r)) for h, r in by_node.items()], measurements, rows)


def _epoch(created: Any) -> float:
    try:
        return datetime.datetime.fromisoformat(str(created)).timestamp()
    except ValueError:
        return datetime.datetime.now(datetime.timezone.utc).timestamp()


def _number(value: Any) -> Optional[float]:
    """A reading as a float; None for an unknown ({"unknown": ...}), absent or non-numeric one."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _device_rows(run_id: str, node: str, rank: int, device: Mapping[str, Any]) -> list[Measurement]:
    """One rank's (or one snapshotted device's) homogeneity facts: speed, step, GPU counters."""
    gpu = device.get("gpu") or {}
    if gpu:
        index = gpu.get("nvml_index")  # an int, or {"unknown": ...}
        gpu_id: Optional[str] = (gpu.get("uuid") or (str(index) if isinstance(index, int) else None)
                                 or str(device.get("device") or "").partition(":")[2] or None)
        model: Optional[str] = gpu.get("name")
    else:
        gpu_id, model = None, (device.get("host_hw") or {}).get("cpu_model") or "cpu"
    rows: list[tuple[str, Optional[float], str]] = []
    measured = device.get("measured") or {}
    matmul = measured.get("matmul") or {}
    rounds = [float(x) for x in matmul.get("round_flops_per_s") or [] if _number(x)]
    rows.append(("compute_speed", max(rounds) if rounds else _number(matmul.get("flops_per_s")), "flop/s"))
    rows.append(("step_ms", _number(measured.get("step_ms")), "ms"))
    for metric, (part, leaf), unit in _GPU_COUNTERS:
        rows.append((metric, _number((gpu.get(part) or {}).get(leaf)), unit))
    pages = [_number((gpu.get("retired_pages") or {}).get(k)) for k in ("single_bit", "double_bit")]
    if gpu and all(p is not None for p in pages):
        rows.append(("retired_pages", sum(p for p in pages if p is not None), "count"))
    return [Measurement(run_id, node, rank, gpu_id, model, metric, value, unit)
            for metric, value, unit in rows if value is not None]


# (metric, path into the limits facts, unit): the node's limits, so a fleet's history shows which
# node's container or job settings changed (a /dev/shm that shrank, a lower ulimit).
_LIMITS: tuple[tuple[str, tuple[str, str], str], ...] = (
    ("shm_size_bytes", ("shm", "size_bytes"), "bytes"),
    ("shm_free_bytes", ("shm", "free_bytes"), "bytes"),
    ("nofile_soft", ("nofile", "soft"), "count"),
    ("nproc_soft", ("nproc", "soft"), "count"),
    ("memlock_soft_bytes", ("memlock", "soft"), "bytes"),
    ("pids_max", ("cgroup", "pids_max"), "count"),
    ("memory_max_bytes", ("cgroup", "memory_max_bytes"), "bytes"),
    ("cpu_quota", ("cgroup", "cpu_quota"), "CPUs"),
)


def _limits_rows(run_id: str, facts: Mapping[str, Any], hosts: Mapping[int, str]) -> list[Measurement]:
    """The limits of each node, read by its first rank (its ranks share the container), rank NULL."""
    seen: set[str] = set()
    rows = []
    for key, f in sorted(facts.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not isinstance(f, Mapping) or not str(key).isdigit():
            continue
        node = hosts.get(int(key)) or str(f.get("host") or "?")
        if node in seen:
            continue
        seen.add(node)
        for metric, (part, leaf), unit in _LIMITS:
            value = _number((f.get(part) or {}).get(leaf) if isinstance(f.get(part), Mapping) else None)
            if value is not None:
                rows.append(Measurement(run_id, node, None, None, None, metric, value, unit))
    return rows


def _bandwidth_rows(run_id: str, nodes: Iterable[str], facts: Mapping[str, Any], *,
                    per_size: bool) -> list[Measurement]:
    """The sweep's busbw and algbw (largest size; every size for the bench), once per node."""
    figures = _sweep(facts)
    if not figures:
        return []
    largest = max(figures)
    values = [("busbw_gbs", figures[largest][0]), ("algbw_gbs", figures[largest][1])]
    if per_size:
        values += [(f"busbw_gbs@{size}", busbw) for size, (busbw, _) in sorted(figures.items())]
    return [Measurement(run_id, node, None, None, None, metric, value, "GB/s")
            for node in nodes for metric, value in values]


def _sweep(facts: Mapping[str, Any]) -> dict[int, tuple[float, float]]:
    """size -> (busbw, algbw) in GB/s: per iteration the slowest rank, then the median (in-place
    calls where the sweep has them). A size the ranks timed unevenly is left out, as the probe does."""
    ranks = [f for _, f in sorted(facts.items(), key=lambda kv: int(kv[0])) if isinstance(f, Mapping)]
    if not ranks:
        return {}
    first = ranks[0]
    op, n = str(first.get("op") or "all_reduce"), int(first.get("world_size") or len(ranks))
    entries = [e for e in first.get("results") or [] if e.get("in_place", True)] or list(first.get("results") or [])
    out: dict[int, tuple[float, float]] = {}
    for entry in entries:
        key = (int(entry["size_bytes"]), bool(entry.get("in_place")))
        times = {i: e["times_s"] for i, f in enumerate(ranks) for e in f.get("results") or []
                 if (int(e["size_bytes"]), bool(e.get("in_place"))) == key and e.get("times_s")}
        try:
            median = statistics.median(slowest_per_iteration(times))
            out[key[0]] = (busbw_gbps(op, n, key[0], median), algbw_gbps(key[0], median))
        except ValueError:
            continue
    return out


def _finding_rows(run_id: str, finding: Mapping[str, Any], hosts: Mapping[int, str]) -> list[FindingRow]:
    """One row per rank the finding names (its node from the run), else per node it names, else one."""
    code, severity, title = str(finding.get("code")), str(finding.get("severity")), str(finding.get("title"))
    ranks = [int(r) for r in finding.get("ranks") or []]
    named = [str(n) for n in finding.get("nodes") or []]
    if ranks:
        only = named[0] if len(named) == 1 else None
        return [FindingRow(run_id, code, severity, hosts.get(r) if hosts.get(r, "?") != "?" else only, r, title)
                for r in ranks]
    where: list[Optional[str]] = list(named) or [None]
    return [FindingRow(run_id, code, severity, node, None, title) for node in where]
