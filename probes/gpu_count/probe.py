"""Probe `gpu-count`: every rank sees, owns and uses exactly the GPU it should.

"Only one GPU is used", "Duplicate GPU detected", "invalid device ordinal" and "OOM on
GPU 0 only" come from the launcher, the scheduler, CUDA and the driver each believing
something else. Collect records what each believes on every rank (after the DDP steps,
so NVML sees the contexts they made); diagnose compares them, by UUID, never by index:
per node in host_checks, across nodes (shared GPUs, stray contexts, other processes) here.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Mapping

from ddpdoctor.core import codes
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.measure.device import contexts_of, read_env, read_nvml, read_torch
from ddpdoctor.runtime.workload import run_workload

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.gpu_count.facts import GpuCountFacts, NvmlFacts, TorchFacts
from ddpdoctor.probes.gpu_count.host_checks import NAME, host_findings

if TYPE_CHECKING:
    from ddpdoctor.runtime.context import RankContext

NCCL_DUPLICATE_ERRORS = ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device",
                         "Multiple Ranks are using the same GPU/Partition")


class GpuCount:
    name = NAME
    trains = True
    summary = "Compare what torch, NVML, CUDA_VISIBLE_DEVICES, the launcher and Slurm say each rank's GPU is."
    facts_type = GpuCountFacts

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, Any]:
        current = ctx.device.index if ctx.device is not None and ctx.device.type == "cuda" else None
        facts = GpuCountFacts(
            host=ctx.env.hostname, rank=ctx.rank, local_rank=ctx.env.local_rank,
            local_world_size=ctx.env.local_world_size, world_size=ctx.world_size, pid=os.getpid(),
            device=str(ctx.device), env=read_env(), torch=TorchFacts.from_json(read_torch(current)),
            nvml=NvmlFacts.from_json(read_nvml()),
            contexts={"unknown": "the DDP workload did not finish on this rank"},
        )
        # A bad device mapping is exactly what makes the DDP steps fail or hang (NCCL refuses
        # two ranks on one GPU): publish what was read before running them.
        ctx.publish_partial(NAME, facts)
        run_workload(ctx)
        nvml = read_nvml()  # the contexts NVML reports now are the ones DDP really used
        facts.nvml, facts.contexts = NvmlFacts.from_json(nvml), contexts_of(os.getpid(), nvml)
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, GpuCountFacts], run: RunView) -> list[Finding]:
        facts = facts_by_rank(GpuCountFacts, facts)
        findings: list[Finding] = []
        by_host: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(facts):
            by_host[str(facts[rank].host)].append(rank)
        for host, ranks in by_host.items():
            findings += host_findings(host, ranks, facts)
        crowded = {r for f in findings if f.code == "GPU001" for r in f.ranks}
        findings += _duplicate_gpus({r: f for r, f in facts.items() if r not in crowded})
        findings += _stray_contexts(facts) + _foreign_processes(facts)
        if not findings and facts:
            findings.append(_all_clear(facts))
        return findings


def _duplicate_gpus(facts: Mapping[int, GpuCountFacts]) -> list[Finding]:
    """GPU003: two ranks computing on one GPU (by UUID: the same index on two nodes is no duplicate)."""
    holders: dict[str, list[int]] = defaultdict(list)
    for r, f in facts.items():
        uuid = f.torch.current_uuid
        if uuid and f.on_cuda:
            holders[uuid].append(r)
    out = []
    for uuid, ranks in sorted(holders.items()):
        if len(ranks) > 1:
            hosts = tuple(sorted({str(facts[r].host) for r in ranks}))
            out.append(codes.finding(
                "GPU003", NAME, f"Ranks {rank_ranges(ranks)} are on the same GPU {uuid}", ranks=tuple(sorted(ranks)),
                nodes=hosts,
                evidence={"gpu_uuid": uuid, "ranks": sorted(ranks),
                          "device_index_by_rank": {r: _current_index(facts[r]) for r in ranks},
                          "CUDA_VISIBLE_DEVICES_by_rank": {r: facts[r].env.get("CUDA_VISIBLE_DEVICES") for r in ranks}},
                why=("NCCL refuses it: \"" + NCCL_DUPLICATE_ERRORS[0] + " ...\" (NCCL before 2.30) or \""
                     + NCCL_DUPLICATE_ERRORS[1] + "\" (NCCL 2.30 and later). torch.cuda.set_device is missing or "
                     "uses the global rank instead of LOCAL_RANK."),
                fix="Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group and moving the model."))
    return out


def _current_index(f: GpuCountFacts) -> int | None:
    return f.torch.current.index if f.torch.current is not None else None


def _owners(facts: Mapping[int, GpuCountFacts]) -> dict[str, list[int]]:
    """GPU UUID -> the ranks computing on it."""
    owner: dict[str, list[int]] = defaultdict(list)
    for r, f in sorted(facts.items()):
        uuid = f.torch.current_uuid
        if uuid:
            owner[uuid].append(r)
    return owner


def _stray_contexts(facts: Mapping[int, GpuCountFacts]) -> list[Finding]:
    """GPU004: contexts a rank holds on another rank's GPU (each costs memory there)."""
    owner = _owners(facts)
    out = []
    for r, f in sorted(facts.items()):
        if not isinstance(f.contexts, list):
            continue  # NVML could not say, or the workload did not finish
        own = f.torch.current_uuid
        stray = [u for u in f.contexts if u and u != own and u in owner]
        if stray:
            out.append(codes.finding(
                "GPU004", NAME,
                f"Rank {r} also holds a CUDA context on rank {rank_ranges(o for u in stray for o in owner[u])}'s GPU",
                ranks=(r,), nodes=(str(f.host),), evidence={"own_gpu": own, "stray_contexts": stray}))
    return out


def _foreign_processes(facts: Mapping[int, GpuCountFacts]) -> list[Finding]:
    """GPU007: processes that are not ours on the GPUs our ranks use, per host, from NVML's lists."""
    owner = _owners(facts)
    our_pids: dict[str, set[int]] = defaultdict(set)
    for f in facts.values():
        our_pids[str(f.host)].add(int(f.pid))
    out = []
    for host, pids in our_pids.items():
        nv = next(f for f in facts.values() if str(f.host) == host).nvml
        devices = [d for d in nv.devices if d.uuid in owner and isinstance(d.processes, list)]
        listed = {p.pid for d in devices for p in d.processes or ()}
        if not listed & pids:
            continue  # our own ranks are not listed: another PID namespace (container), pids mean nothing here
        foreign = [{"gpu": d.uuid, "pid": p.pid, "used_bytes": p.used_bytes}
                   for d in devices for p in d.processes or () if p.pid not in pids]
        if foreign:
            out.append(codes.finding(
                "GPU007", NAME, f"{len(foreign)} process(es) that are not ours use the GPUs of {host}",
                ranks=tuple(sorted({o for x in foreign for o in owner[str(x["gpu"])]})), nodes=(host,),
                evidence={"foreign_processes": foreign}))
    return out


def _all_clear(facts: Mapping[int, GpuCountFacts]) -> Finding:
    """GPU000: OK when every rank has a GPU of its own, INFO (with the reasons) when they ran on CPU."""
    ranks = tuple(sorted(facts))
    hosts = tuple(sorted({str(f.host) for f in facts.values()}))
    on_gpu = {r: f.torch.current_uuid for r, f in facts.items() if f.torch.current is not None}
    if on_gpu and len(on_gpu) == len(facts):
        return codes.finding("GPU000", NAME, f"Each of {len(ranks)} ranks has its own GPU", severity=Severity.OK,
                             ranks=ranks, nodes=hosts, evidence={"gpu_by_rank": on_gpu})
    reasons = sorted({str(f.torch.unavailable_reason or "no GPU visible") for f in facts.values()})
    return codes.finding("GPU000", NAME, "No GPU in use: the ranks ran on CPU", severity=Severity.INFO, ranks=ranks,
                         nodes=hosts,
                         evidence={"reason": reasons, "nvml": sorted({str(f.nvml.reason) for f in facts.values()})})
