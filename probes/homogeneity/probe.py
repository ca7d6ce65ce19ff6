"""Probe `homogeneity`: find the rank or node that is different.

DDP runs at the speed of its slowest rank, and a job that mixes torch or NCCL versions
fails in ways no error message explains. Collect reads every rank's hardware, software,
GPU health and environment, and measures its compute speed; diagnose groups the ranks
by each value and names the odd ones. The reading is shared with `ddpdoctor snapshot`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from ddpdoctor.core.hello import peer_pids
from ddpdoctor.measure import host_load
from ddpdoctor.core import codes
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.core.grouping import describe_groups, group_ranks, minority, shown
from ddpdoctor.measure.host import boot_id
from ddpdoctor.measure.node import read_device_facts, read_gpu_state
from ddpdoctor.measure.throughput import Got, MatmulThroughput, measure_matmul_got
from ddpdoctor.runtime.workload import run_workload

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.homogeneity.facts import (GpuFacts, HomogeneityFacts, HostLoadFacts, MatmulFacts,
                                                MeasuredFacts)
from ddpdoctor.probes.homogeneity.health import gpu_health_findings, host_findings
from ddpdoctor.probes.homogeneity.speed import slow_rank_findings, speed_spread

if TYPE_CHECKING:
    from ddpdoctor.runtime.context import RankContext

NAME = "homogeneity"

ByRank = Mapping[int, HomogeneityFacts]
# How one compared value is read from a rank's facts: a plain JSON value (str, number, bool,
# an {"unknown": reason} mapping) or None where the rank has none.
Read = Callable[[HomogeneityFacts], object]


def _gib(value: object) -> object:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, (int, float)) else value


def _torch_build(f: HomogeneityFacts) -> Optional[str]:
    sw = f.software
    git = sw.torch_git
    return f"{sw.torch} ({git[:8]})" if isinstance(git, str) and git else sw.torch


# (label, how to read it): what must agree, grouped by how bad a disagreement is.
HARDWARE: list[tuple[str, Read]] = [
    ("GPU model", lambda f: f.gpu and f.gpu.name),
    ("GPU memory", lambda f: _gib(f.gpu and f.gpu.memory_total_bytes)),
    ("compute capability", lambda f: f.gpu and f.gpu.compute_capability),
    ("SM count", lambda f: f.gpu and f.gpu.sm_count),
    ("ECC mode", lambda f: f.gpu and f.gpu.ecc_mode.current),
]
LIBRARIES: list[tuple[str, Read]] = [("torch", _torch_build), ("NCCL", lambda f: f.software.nccl)]
DRIVERS: list[tuple[str, Read]] = [
    ("NVIDIA driver", lambda f: f.software.driver),
    ("CUDA driver API", lambda f: f.software.cuda_driver),
    ("torch's CUDA runtime", lambda f: f.software.cuda_runtime),
]
HARMLESS: list[tuple[str, Read]] = [
    ("Python", lambda f: f.software.python),
    ("OS", lambda f: f.software.os),
    ("kernel", lambda f: f.software.kernel),
    ("CPU model", lambda f: f.host_hw.cpu_model),
    ("host RAM", lambda f: _gib(f.host_hw.ram_bytes)),
]
# Settings that may differ between nodes on purpose (NIC names) or only change logging.
PER_NODE_ENV = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_TOPO_FILE", "NCCL_DEBUG",
                "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE"}
COMPARED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_")


class Homogeneity:
    name = NAME
    trains = True
    facts_type = HomogeneityFacts
    summary = "Compare GPUs, drivers, torch/NCCL, GPU health, environment and measured speed across ranks and nodes."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, object]:
        facts = dataclasses.replace(
            HomogeneityFacts.from_json(read_device_facts(ctx.device)),
            host=ctx.env.hostname, machine=boot_id(), rank=ctx.rank, local_rank=ctx.env.local_rank,
            local_world_size=ctx.env.local_world_size, world_size=ctx.world_size, source="rank")
        # What was read stays diagnosable even if the measurement below fails or hangs.
        ctx.publish_partial(NAME, facts)
        matmul, got = _measure_matmul(ctx)
        measured = facts.measured = MeasuredFacts(matmul=MatmulFacts.from_json(matmul.to_json()))
        if got is not None:
            measured.got_flops_per_s, measured.contention = got.flops_per_s, got.contention
        if facts.gpu is not None and facts.has_gpu:
            # Clocks and throttle reasons mean most right after load: idle GPUs report idle.
            facts.gpu = GpuFacts.from_json(facts.gpu.to_json() | read_gpu_state(facts.gpu.uuid))
        workload = run_workload(ctx)
        measured.step_ms = _median([s.step_ms for s in workload.steps])
        measured.forward_ms = _median([s.forward_ms for s in workload.steps])
        sampled = ctx.shared.host_load_start is not None
        if sampled:
            facts.host_load = _foreign_load(ctx)
        out = facts.to_json()
        if sampled:
            out.setdefault("host_load", None)  # sampled at the start, unreadable at the end: null, as always
        return out

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: ByRank, run: RunView) -> list[Finding]:
        facts = facts_by_rank(HomogeneityFacts, facts)
        if not facts:
            return []
        threshold = run.settings.get("slow_threshold_pct")
        findings: list[Finding] = []
        findings += _disagreements(facts, run, HARDWARE, "HOM001", "GPU hardware differs")
        findings += _disagreements(facts, run, LIBRARIES, "HOM002", "Library versions differ")
        findings += _disagreements(facts, run, DRIVERS, "HOM003", "NVIDIA driver or CUDA differs")
        findings += _disagreements(facts, run, HARMLESS, "HOM004", "Harmless differences")
        findings += _env_differences(facts, run)
        findings += slow_rank_findings(facts, run, threshold)
        findings += gpu_health_findings(facts, run)
        findings += host_findings(facts, run)
        if not any(f.severity >= Severity.WARN for f in findings):
            findings.insert(0, _all_agree(facts, run))
        return findings


def _foreign_load(ctx: RankContext) -> Optional[HostLoadFacts]:
    """Other processes' CPU on this host from the rank's start to now (local rank 0 only)."""
    start, end = ctx.shared.host_load_start, host_load.sample()
    if start is None or end is None:
        return None
    from ddpdoctor.measure.host import machine_identity

    # Every rank of this job whose pid means something here (same kernel, same pid namespace),
    # whatever host name it goes by: two "nodes" in containers on one machine share it.
    here = machine_identity()
    pids = [h.pid for h in ctx.hellos.values() if h.machine == here and h.pid]
    return HostLoadFacts.from_json(
        host_load.foreign_load(start, end, host_load.our_processes(pids)))


def _measure_matmul(ctx: RankContext) -> tuple[MatmulThroughput, Optional[Got]]:
    import torch.distributed as dist

    rounds = {"n": 0}

    def barrier() -> None:
        # Every rank's round k runs at the same time, so the rounds compare like with like.
        rounds["n"] += 1
        with ctx.collective("matmul_round_barrier", round=rounds["n"]):
            dist.barrier()

    return measure_matmul_got(ctx.device, barrier=barrier, slow_factor=ctx.injector.slow_factor(),
                              peers=peer_pids(ctx.hellos, ctx.rank))


def _median(values: list[float]) -> Optional[float]:
    import statistics

    return round(statistics.median(values), 3) if values else None


def _values(facts: ByRank, read: Read) -> dict[int, object]:
    return {r: read(f) for r, f in facts.items()}


def _by_node(facts: ByRank, groups: list[tuple[object, list[int]]], word: str = "on") -> Optional[str]:
    """`nodes a,b on X; node c on Y` when every node is uniform and there are several."""
    per_node: dict[str, set[int]] = defaultdict(set)
    for index, (_, ranks) in enumerate(groups):
        for r in ranks:
            per_node[str(facts[r].host)].add(index)
    if len(per_node) < 2 or any(len(v) != 1 for v in per_node.values()):
        return None
    parts = []
    for index, (value, _) in enumerate(groups):
        hosts = sorted(h for h, v in per_node.items() if v == {index})
        parts.append(f"{'node' if len(hosts) == 1 else 'nodes'} {','.join(hosts)} {word} {shown(value)}")
    return "; ".join(parts)


def _disagreements(facts: ByRank, run: RunView, attributes: list[tuple[str, Read]],
                   code: str, headline: str) -> list[Finding]:
    evidence: dict[str, str] = {}
    odd: set[int] = set()
    first = ""
    for label, read in attributes:
        values = _values(facts, read)
        if all(v is None for v in values.values()):
            continue  # not applicable here (e.g. no GPU on any rank)
        groups = group_ranks(values)
        if len(groups) < 2:
            continue
        said = _by_node(facts, groups) or describe_groups(groups)
        evidence[label] = said
        odd.update(minority(groups))
        first = first or f"{label}: {said}"
    if not evidence:
        return []
    ranks = tuple(sorted(odd))
    return [codes.finding(code, NAME, f"{headline}: {first}", ranks=ranks, nodes=run.nodes_of(ranks), evidence=evidence)]


def _env_differences(facts: ByRank, run: RunView) -> list[Finding]:
    names = sorted({k for f in facts.values() for k in f.env if k.startswith(COMPARED_ENV_PREFIXES)})
    out: list[Finding] = []
    for per_node, severity in ((False, Severity.WARN), (True, Severity.INFO)):
        evidence: dict[str, str] = {}
        odd: set[int] = set()
        for name in names:
            if (name in PER_NODE_ENV) != per_node:
                continue
            groups = group_ranks({r: f.env.get(name, "unset") for r, f in facts.items()})
            if len(groups) > 1:
                evidence[name] = (_by_node(facts, groups, word="with") or
                                  describe_groups(groups, word="has", plural_word="have"))
                odd.update(minority(groups))
        if not evidence:
            continue
        ranks = tuple(sorted(odd))
        shown_names = ", ".join(list(evidence)[:3]) + (" ..." if len(evidence) > 3 else "")
        out.append(codes.finding(
            "HOM005", NAME, f"Distributed settings differ across ranks: {shown_names}", severity=severity,
            ranks=ranks, nodes=run.nodes_of(ranks), evidence=evidence,
            why=("These variables differ between nodes by design (network interface names, debug output)."
                 if per_node else
                 "NCCL and torch.distributed settings that differ between ranks (algorithm, protocol, timeouts, "
                 "debug wrappers) can make ranks disagree on how a collective runs: hangs or errors at the first "
                 "all-reduce."),
            fix=("" if per_node else
                 "Export the same NCCL_*/TORCH_NCCL_*/TORCH_DISTRIBUTED_* settings on every node: set them in the "
                 "job script before srun/torchrun, not in a per-node profile.")))
    return out


def _all_agree(facts: ByRank, run: RunView) -> Finding:
    ranks = tuple(sorted(facts))
    sample = facts[ranks[0]]
    parts = []
    gpu = sample.gpu and sample.gpu.name
    # A GPU whose model the input does not show (an nvidia-smi -q excerpt) is not a CPU.
    parts.append(str(gpu) if gpu else "GPU (model not shown)" if sample.has_gpu
                 else f"CPU {shown(sample.host_hw.cpu_model)}")
    for label, read in (LIBRARIES + DRIVERS[:1]):
        value = read(sample)
        if value is not None and shown(value) != "unknown":
            parts.append(f"{label} {shown(value)}")
    spread = speed_spread(facts)
    if spread is not None:
        pct, slowest, fastest, unit = spread
        parts.append(f"measured speed of peers within {pct:.0f}% ({slowest:.3g}-{fastest:.3g} {unit})")
    nodes = run.nodes_of(ranks) or tuple(sorted({str(f.host) for f in facts.values()}))
    return codes.finding("HOM000", NAME,
                         f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''} on {len(nodes)} "
                         f"node{'s' if len(nodes) != 1 else ''} agree: "
                         + ", ".join(parts),
                         ranks=ranks, nodes=nodes, evidence={"ranks": rank_ranges(ranks)})
