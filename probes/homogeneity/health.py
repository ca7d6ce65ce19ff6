"""GPU health and host sizing: the per-device and per-node part of `homogeneity`.

Each finding names the GPU by host and PCI bus id (what `nvidia-smi` and a datacenter
ticket use), once per GPU even when several ranks share it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping, Optional

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.measure.host_layout import parse_cpulist

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.homogeneity.facts import GpuFacts, HomogeneityFacts, HostHwFacts

NAME = "homogeneity"
RAM_PER_GPU_BYTES = 16 * 2**30  # common practice: at least 16 GB of host RAM per GPU (data loading, pinned memory)
SLOWDOWNS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown", "board_limit",
             "reliability")

ByRank = Mapping[int, HomogeneityFacts]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _int(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: object) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def cpu_set(text: object) -> set[int]:
    """`0-3,8` (as rank_ranges writes an affinity) → {0, 1, 2, 3, 8}; an unreadable part is skipped."""
    cpus: set[int] = set()
    for part in str(text or "").split(","):
        try:
            cpus |= parse_cpulist(part)
        except ValueError:
            continue
    return cpus


def cpus_for(host_hw: list[HostHwFacts]) -> int:
    """CPUs the ranks of one host may run on between them: the union of their affinities.

    Ranks pinned apart (srun --cpus-per-task) do not compete even though each sees few CPUs.
    """
    union: set[int] = set()
    for hw in host_hw:
        union |= cpu_set(hw.cpu_affinity)
    if union:
        return len(union)
    return max((_int(hw.cpus_usable) or _int(hw.cpu_logical_cores) or 0 for hw in host_hw), default=0)


def _uuid(f: HomogeneityFacts) -> Optional[str]:
    return f.gpu.uuid if f.gpu is not None else None


def _gpus(facts: ByRank) -> list[tuple[str, list[int], GpuFacts]]:
    """(label, ranks, gpu facts) per distinct GPU."""
    seen: dict[str, tuple[str, list[int], GpuFacts]] = {}
    for r, f in sorted(facts.items()):
        gpu = f.gpu
        if gpu is None or not f.has_gpu:
            continue
        host = str(f.host)
        key = str(gpu.uuid or f"{host}/{gpu.pci_bus_id}/{r}")
        label = f"{host} GPU {gpu.pci_bus_id or gpu.nvml_index}" + (f" ({gpu.name})" if gpu.name else "")
        seen.setdefault(key, (label, [], gpu))[1].append(r)
    return list(seen.values())


def _per_gpu(facts: ByRank, run: RunView, judge: Callable[[GpuFacts], Optional[tuple[Severity, str]]],
             code: str, title: str) -> list[Finding]:
    evidence: dict[str, str] = {}
    severities: dict[str, Severity] = {}
    ranks: list[int] = []
    for label, gpu_ranks, gpu in _gpus(facts):
        verdict = judge(gpu)
        if verdict is None:
            continue
        severity, said = verdict
        evidence[label] = said
        severities[label] = severity
        ranks += gpu_ranks
    if not evidence:
        return []
    first = max(evidence, key=lambda label: severities[label])  # the worst GPU names the finding
    more = f" and {len(evidence) - 1} more" if len(evidence) > 1 else ""
    ranks_t = tuple(sorted(set(ranks)))
    return [codes.finding(code, NAME, f"{title} on {first}{more}: {evidence[first]}", severity=severities[first],
                          ranks=ranks_t, nodes=run.nodes_of(ranks_t), evidence=evidence)]


def _memory_errors(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    rows, ecc, pages = gpu.remapped_rows, gpu.ecc_uncorrected, gpu.retired_pages
    volatile, aggregate, uncorrectable = _int(ecc.volatile) or 0, _int(ecc.aggregate) or 0, _int(rows.uncorrectable) or 0
    said: list[str] = []
    severity = Severity.INFO
    if rows.failed is True:
        said.append("row remapping FAILED")
        severity = Severity.CRITICAL
    if volatile > 0:
        said.append(f"{_count(volatile, 'uncorrectable ECC error')} since the last reset")
        severity = max(severity, Severity.WARN)
    if rows.pending is True or pages.pending is True:
        said.append("a row remap / page retirement is pending until the GPU is reset")
        severity = max(severity, Severity.WARN)
    if not said and aggregate > 0:
        said.append(f"{_count(aggregate, 'uncorrectable ECC error')} in its lifetime (none since the last reset)")
    if uncorrectable > 0:
        said.append(f"{_count(uncorrectable, 'row')} remapped for uncorrectable errors")
    return (severity, "; ".join(said)) if said else None


def _power_capped(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    """WARN: a capped GPU computes slower under load, and DDP waits for it (see _uniform_caps)."""
    power = gpu.power
    limit, default = _num(power.limit_w), _num(power.default_w)
    enforced = _num(power.enforced_w)
    capped = min(v for v in (limit, enforced) if v is not None) if (limit or enforced) else None
    if capped is None or default is None or capped >= default * 0.98:
        return None
    return Severity.WARN, f"power limit {capped:g} W, default {default:g} W ({100 * capped / default:.0f}%)"


def _clocks_low(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    clocks = gpu.clocks
    said = []
    for kind, app_mhz, default_mhz in (("SM", clocks.app_sm_mhz, clocks.default_app_sm_mhz),
                                       ("MEM", clocks.app_mem_mhz, clocks.default_app_mem_mhz)):
        app, default = _int(app_mhz), _int(default_mhz)
        if app is not None and default and app < default * 0.95:
            said.append(f"application {kind} clock {app} MHz, default {default} MHz")
    return (Severity.WARN, "; ".join(said)) if said else None


def _throttling(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    active = [r for r in gpu.clock_event_reasons.active if isinstance(r, str)]
    bad = [r for r in active if r in SLOWDOWNS]
    if bad:
        temp = gpu.temperature_c
        return Severity.WARN, ", ".join(bad) + (f" at {temp} C" if _int(temp) is not None else "")
    if "sw_power_cap" in active:
        return Severity.INFO, "sw_power_cap (clocks lowered to stay within the power limit)"
    return None


def _persistence_off(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    return (Severity.INFO, "persistence mode off") if gpu.persistence_mode is False else None


def _uniform_caps(facts: ByRank) -> Callable[[GpuFacts], Optional[tuple[Severity, str]]]:
    """HOM008 is INFO when every GPU given is capped: a cap set on all of them alike is the
    admins' choice (power or noise), and no GPU holds the others back; WARN when some are not."""
    gpus = [gpu for _, _, gpu in _gpus(facts)]
    if not gpus or not all(_power_capped(gpu) for gpu in gpus):
        return _power_capped

    def judge(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
        verdict = _power_capped(gpu)
        return (Severity.INFO, f"{verdict[1]}; every GPU given is capped") if verdict else None
    return judge


# P-states a GPU computes in: P0 (full speed), P2 (compute on GeForce boards). P5 and up are idle or
# video states, where the driver lowers the PCIe generation to save power (not a fault).
WORKING_PSTATES = ("P0", "P1", "P2")


def _working(gpu: GpuFacts) -> Optional[bool]:
    """True in a working P-state, False idle, None where the P-state was not read (older files)."""
    state = gpu.performance_state
    if not isinstance(state, str):
        return None
    return state in WORKING_PSTATES and "gpu_idle" not in gpu.clock_event_reasons.active


def _pcie_low(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    """A link narrower than the GPU's maximum (the width does not drop at idle: a slot of fewer
    lanes or a link that trained down), or a lower generation while the GPU works. A lower
    generation at idle is power saving and not judged; nor is it where the P-state is unknown."""
    pcie, working = gpu.pcie, _working(gpu)
    gen, max_gen, width, max_width = _int(pcie.gen), _int(pcie.max_gen), _int(pcie.width), _int(pcie.max_width)
    narrow = width is not None and max_width is not None and width < max_width
    slow = gen is not None and max_gen is not None and gen < max_gen and working is True
    if not narrow and not slow:
        return None
    said = (f"link width x{width} of x{max_width}, " if narrow else "") + f"Gen{gen} of Gen{max_gen}"
    said += f" in {gpu.performance_state}" if working is not None else ""
    if working is False:  # narrow while idle: most likely a fault, but read it again under load
        return Severity.INFO, said + " (idle: read it again under load)"
    return Severity.WARN, said


def _mig(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    """A GPU in MIG mode gives each process a slice (a fraction of its SMs and memory), and NCCL
    cannot run collectives between MIG instances: WARN when on, INFO when on only at the next reset."""
    mig = gpu.mig_mode
    if mig is None:
        return None
    if mig.current is True:
        return Severity.WARN, "MIG mode enabled" + (" (disabled at the next reset)" if mig.pending is False else "")
    if mig.pending is True:
        return Severity.INFO, "MIG mode enabled at the next GPU reset"
    return None


def _diagnostic_failed(gpu: GpuFacts) -> Optional[tuple[Severity, str]]:
    """A `dcgmi diag` test that failed (CRITICAL) or warned (WARN) on this GPU, in DCGM's own words:
    DCGM stressed the GPU and saw it misbehave, which no reading of a healthy-looking idle GPU shows."""
    if gpu.diagnostic is None:
        return None
    failed = [t for t in gpu.diagnostic.tests if t.result.lower() == "fail"]
    bad = failed or [t for t in gpu.diagnostic.tests if t.result.lower() == "warn"]
    if not bad:
        return None
    said = "; ".join(f"{t.name}: {t.result}" + (f" ({' '.join(t.warnings)})" if t.warnings else "") for t in bad)
    return (Severity.CRITICAL if failed else Severity.WARN), said


def gpu_health_findings(facts: ByRank, run: RunView) -> list[Finding]:
    out: list[Finding] = []
    out += _per_gpu(facts, run, _memory_errors, "HOM007", "GPU memory errors")
    out += _per_gpu(facts, run, _uniform_caps(facts), "HOM008", "Power limit below default")
    out += _per_gpu(facts, run, _clocks_low, "HOM009", "Clocks held below default")
    out += _per_gpu(facts, run, _throttling, "HOM010", "GPU clocks throttled")
    out += _per_gpu(facts, run, _persistence_off, "HOM014", "Persistence mode off")
    out += _per_gpu(facts, run, _mig, "HOM016", "MIG (multi-instance GPU) mode")
    out += _per_gpu(facts, run, _pcie_low, "HOM017", "PCIe link below its maximum")
    out += _per_gpu(facts, run, _diagnostic_failed, "HOM020", "DCGM diagnostic failed")
    return out


def host_findings(facts: ByRank, run: RunView) -> list[Finding]:
    out: list[Finding] = []
    by_host: dict[str, list[int]] = defaultdict(list)
    for r, f in sorted(facts.items()):
        by_host[str(f.host)].append(r)
    low_ram: dict[str, str] = {}
    low_ram_ranks: list[int] = []
    threads: dict[str, str] = {}
    thread_ranks: list[int] = []
    for host, ranks in by_host.items():
        hw = facts[ranks[0]].host_hw
        gpu_ranks = [r for r in ranks if facts[r].has_gpu]
        gpus = _int(hw.node_gpus) or len({str(_uuid(facts[r]) or r) for r in gpu_ranks})
        ram = _int(hw.ram_bytes)
        if gpu_ranks and ram and gpus and ram / gpus < RAM_PER_GPU_BYTES:
            low_ram[host] = f"{ram / 2**30:.0f} GiB RAM for {gpus} GPUs ({ram / gpus / 2**30:.1f} GiB each)"
            low_ram_ranks += ranks
        # Only live ranks: a snapshot's threads are its own process's, not a training rank's.
        live = [r for r in ranks if facts[r].source != "snapshot"]
        local = max([len(live)] + [int(facts[r].local_world_size or 1) for r in live])
        unset = [r for r in live if "OMP_NUM_THREADS" not in facts[r].env]
        wanted = sum(int(facts[r].host_hw.torch_threads or 1) for r in live)
        cores = cpus_for([facts[r].host_hw for r in live])
        if local > 1 and unset and cores and wanted > cores:
            threads[host] = (f"{len(live)} ranks with {wanted} compute threads between them on {cores} CPUs, "
                             "OMP_NUM_THREADS unset")
            thread_ranks += unset
    out += _busy_hosts(facts, by_host)
    if low_ram:
        first = next(iter(low_ram))
        out.append(codes.finding(
            "HOM011", NAME, f"Little host RAM per GPU on {first}: {low_ram[first]}", ranks=tuple(low_ram_ranks),
            nodes=tuple(low_ram), evidence=low_ram | {"rule_of_thumb": "at least 16 GiB of host RAM per GPU"}))
    if threads:
        first = next(iter(threads))
        out.append(codes.finding(
            "HOM012", NAME, f"CPU threads oversubscribed on {first}: {threads[first]}", ranks=tuple(thread_ranks),
            nodes=tuple(threads), evidence=threads))
    return out


# Saturated: the host's CPUs were nearly all busy, and other processes took a real share of them
# (a quarter, at least half a CPU). A big node where another job uses idle cores is not saturated.
SATURATED_SHARE = 0.9
FOREIGN_SHARE = 0.25


def _busy_hosts(facts: ByRank, by_host: Mapping[str, list[int]]) -> list[Finding]:
    """HOM015: the host's CPUs were saturated while the check ran, with other processes taking a real
    share (local rank 0 measured it from the ranks' start, imports included)."""
    busy: dict[str, str] = {}
    measured: dict[str, object] = {}
    for host, ranks in by_host.items():
        load = next((facts[r].host_load for r in ranks if facts[r].host_load is not None), None)
        if load is None:
            continue
        cpus, used = _int(load.cpus) or 0, _num(load.foreign_cpus_busy) or 0.0
        all_busy = _num(load.cpus_busy)
        if cpus and (all_busy is None or all_busy >= SATURATED_SHARE * cpus) and used >= max(0.5, FOREIGN_SHARE * cpus):
            top = ", ".join(f"pid {p.pid} {p.name} {p.cpu_pct}%" for p in load.top)
            busy[host] = (f"{all_busy if all_busy is not None else used:.1f} of {cpus} CPUs busy, {used:.1f} of them "
                          f"with other processes" + (f" ({top})" if top else ""))
            measured[host] = load.to_json()  # evidence is JSON: what was read, as it was read
    if not busy:
        return []
    first = next(iter(busy))
    return [codes.finding(
        "HOM015", NAME, f"Host {first} is saturated, partly by other processes: {busy[first]}",
        ranks=tuple(r for host in busy for r in by_host[host]), nodes=tuple(busy),
        evidence={"by_host": busy, "measured": measured})]
