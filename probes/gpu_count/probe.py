"""Probe `gpu-count`: every rank sees, owns and uses exactly the GPU it should.

"Only one GPU is used", "Duplicate GPU detected", "invalid device ordinal" and "OOM on
GPU 0 only" come from the launcher, the scheduler, CUDA and the driver each believing
something else. Collect records what each believes on every rank (after the DDP steps,
so NVML sees the contexts they made); diagnose compares them, by UUID, never by index.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Mapping, Optional

from ddpdoctor.measure.cuda_visible import parse as parse_visible
from ddpdoctor.measure.device import contexts_of, read_env, read_nvml, read_torch
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.runtime.workload import run_workload

from ddpdoctor.probes.base import RunView

NAME = "gpu-count"
NCCL_DUPLICATE_ERRORS = ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device",
                         "Multiple Ranks are using the same GPU/Partition")


class GpuCount:
    name = NAME
    trains = True
    summary = "Compare what torch, NVML, CUDA_VISIBLE_DEVICES, the launcher and Slurm say each rank's GPU is."

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: Any) -> dict[str, Any]:
        current = ctx.device.index if ctx.device is not None and ctx.device.type == "cuda" else None
        facts = {
            "host": ctx.env.hostname, "rank": ctx.rank, "local_rank": ctx.env.local_rank,
            "local_world_size": ctx.env.local_world_size, "world_size": ctx.world_size, "pid": os.getpid(),
            "device": str(ctx.device), "env": read_env(), "torch": read_torch(current), "nvml": read_nvml(),
            "contexts": {"unknown": "the DDP workload did not finish on this rank"},
        }
        # A bad device mapping is exactly what makes the DDP steps fail or hang (NCCL refuses
        # two ranks on one GPU): publish what was read before running them.
        ctx.channel.set(f"result/{NAME}/{ctx.rank}", facts)
        run_workload(ctx)
        facts["nvml"] = read_nvml()  # the contexts NVML reports now are the ones DDP really used
        facts["contexts"] = contexts_of(os.getpid(), facts["nvml"])
        return facts

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
        findings: list[Finding] = []
        by_host: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(facts):
            by_host[str(facts[rank].get("host"))].append(rank)
        for host, ranks in by_host.items():
            findings += _host_findings(host, ranks, facts)
        crowded = {r for f in findings if f.code == "GPU001" for r in f.ranks}
        findings += _duplicate_gpus({r: f for r, f in facts.items() if r not in crowded})
        findings += _foreign_contexts(facts)
        if not findings and facts:
            findings.append(_all_clear(facts))
        return findings


def _nvml_count(f: Mapping[str, Any]) -> Optional[int]:
    count = (f.get("nvml") or {}).get("device_count")
    return count if isinstance(count, int) else None


def _torch(f: Mapping[str, Any]) -> Mapping[str, Any]:
    return f.get("torch") or {}


def _uuid(device: Optional[Mapping[str, Any]]) -> Optional[str]:
    return (device or {}).get("uuid")


def _gpu_list(text: Optional[str]) -> Optional[list[str]]:
    if not text:
        return None
    return [t for t in text.replace("(", ",").replace(")", ",").split(",") if t.strip().isdigit()]


def _host_findings(host: str, ranks: list[int], facts: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    out: list[Finding] = []
    nodes = (host,)
    sample = facts[ranks[0]]
    nvml_count = max((c for c in (_nvml_count(facts[r]) for r in ranks) if c is not None), default=None)
    torch_counts = {r: int(_torch(facts[r]).get("device_count") or 0) for r in ranks}
    visible = {r: parse_visible((facts[r].get("env") or {}).get("CUDA_VISIBLE_DEVICES")) for r in ranks}

    # CUDA cannot be used on a node that has GPUs.
    if nvml_count:
        broken = [r for r in ranks if not _torch(facts[r]).get("cuda_available") and visible[r].count != 0
                  and not _names_missing_devices(visible[r].entries[:1], facts[r])]  # GPU005 explains those
        if broken:
            t = _torch(facts[broken[0]])
            nv = facts[broken[0]].get("nvml") or {}
            built = t.get("cuda_built")
            out.append(Finding(
                code="GPU008", severity=Severity.CRITICAL, probe=NAME,
                title=(f"torch on rank {rank_ranges(broken)} cannot use the {nvml_count} GPUs of {host}: "
                       + ("it was built without CUDA" if not built else "CUDA is unavailable")),
                ranks=tuple(broken), nodes=nodes,
                evidence={"nvml_gpus": nvml_count, "torch_version": t.get("version"), "torch_cuda": built,
                          "driver_version": nv.get("driver_version"), "driver_cuda": nv.get("cuda_driver_version"),
                          "reason": t.get("unavailable_reason")},
                why=("A CPU-only torch wheel never sees GPUs." if not built else
                     "torch's CUDA runtime could not start: most often the driver is older than the CUDA version "
                     "torch was built for (\"The NVIDIA driver on your system is too old\")."),
                fix=("Install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu124 or newer)."
                     if not built else "Upgrade the driver to one that supports torch's CUDA version, or install a "
                     "torch build for an older CUDA; check `nvidia-smi` works on that node."),
            ))

    local = max(len(ranks), int(sample.get("local_world_size") or len(ranks)))
    available = _gpus_available(ranks, facts)
    oversubscribed = available is not None and 0 < available < local

    # CUDA_VISIBLE_DEVICES that CUDA reads differently than the user meant.
    for r in ranks:
        v = visible[r]
        if v.problems and v.ignored:
            out.append(Finding(
                code="GPU005", severity=Severity.WARN, probe=NAME,
                title=f"CUDA_VISIBLE_DEVICES={v.raw!r} on rank {r} is partly unreadable: CUDA uses only {list(v.entries)}",
                ranks=(r,), nodes=nodes,
                evidence={"CUDA_VISIBLE_DEVICES": v.raw, "used": list(v.entries), "ignored": list(v.ignored),
                          "problem": v.problems[0]},
                why="CUDA stops reading the variable at the first entry it does not understand, without an error.",
                fix="Use only GPU indices (0,1), GPU- UUIDs or MIG- ids, comma-separated, each once.",
            ))
        elif v.restricts and v.count == 0 and nvml_count:
            out.append(Finding(
                code="GPU005", severity=Severity.CRITICAL, probe=NAME,
                title=f"CUDA_VISIBLE_DEVICES={v.raw!r} hides every GPU from rank {r} on a node with {nvml_count}",
                ranks=(r,), nodes=nodes, evidence={"CUDA_VISIBLE_DEVICES": v.raw, "nvml_gpus": nvml_count},
                why="An empty value or -1 hides all GPUs; the rank runs on CPU or fails.",
                fix="Unset CUDA_VISIBLE_DEVICES or list the GPUs this job was given.",
            ))
        missing = _names_missing_devices(v.entries, facts[r])
        if missing:
            out.append(Finding(
                code="GPU005", severity=Severity.CRITICAL, probe=NAME,
                title=f"CUDA_VISIBLE_DEVICES on rank {r} names GPUs that {host} does not have: {', '.join(missing)}",
                ranks=(r,), nodes=nodes,
                evidence={"CUDA_VISIBLE_DEVICES": v.raw, "nvml_gpus": nvml_count,
                          "nvml_uuids": [d.get("uuid") for d in (facts[r].get("nvml") or {}).get("devices", [])]},
                why="An index past the last GPU or a UUID of another machine makes CUDA see fewer GPUs than meant.",
                fix="Take the indices or UUIDs from `nvidia-smi -L` on this node, or from the scheduler's allocation.",
            ))
        seen = torch_counts[r] if _torch(facts[r]).get("cuda_available") else v.count
        local_rank = int(facts[r].get("local_rank") or 0)
        if seen is not None and seen > 1 and local_rank >= seen and not oversubscribed:
            out.append(Finding(
                code="GPU005", severity=Severity.CRITICAL, probe=NAME,
                title=f"Rank {r} has LOCAL_RANK={local_rank} but sees only {seen} GPUs: set_device(LOCAL_RANK) fails",
                ranks=(r,), nodes=nodes,
                evidence={"LOCAL_RANK": local_rank, "visible_gpus": seen, "CUDA_VISIBLE_DEVICES": v.raw},
                why=("torch.cuda.set_device(LOCAL_RANK) raises \"CUDA error: invalid device ordinal\" when a rank sees "
                     "fewer GPUs than its local rank, e.g. CUDA_VISIBLE_DEVICES differs across the ranks of a node."),
                fix=("Give every rank of a node the same CUDA_VISIBLE_DEVICES, or one GPU per task "
                     "(srun --gpus-per-task=1) and set_device(0)."),
            ))

    # The scheduler granted something else than CUDA sees: one finding for the ranks of a node that agree.
    mismatched: dict[tuple[Optional[int], int], list[int]] = {}
    for r in ranks:
        env = facts[r].get("env") or {}
        granted = _gpu_list(env.get("SLURM_STEP_GPUS")) or _gpu_list(env.get("SLURM_JOB_GPUS"))
        granted_n = len(granted) if granted is not None else None
        if granted_n is None and (env.get("SLURM_GPUS_ON_NODE") or "").isdigit():
            granted_n = int(env["SLURM_GPUS_ON_NODE"])
        cuda_n = torch_counts[r] if _torch(facts[r]).get("cuda_available") else 0
        if granted_n is not None and granted_n != cuda_n and not (granted_n > cuda_n == 1 and visible[r].count == 1):
            mismatched.setdefault((granted_n, cuda_n), []).append(r)
    for (granted_n, cuda_n), same in mismatched.items():
        env = facts[same[0]].get("env") or {}
        who = f"rank {same[0]}" if len(same) == 1 else f"ranks {rank_ranges(same)}"
        out.append(Finding(
            code="GPU006", severity=Severity.WARN, probe=NAME,
            title=f"Slurm granted {granted_n} GPUs on {host}, but torch on {who} sees {cuda_n}",
            ranks=tuple(same), nodes=nodes,
            evidence={k: env.get(k) for k in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE",
                                              "SLURM_GPUS_PER_TASK", "CUDA_VISIBLE_DEVICES") if env.get(k)}
            | {"torch_gpus": cuda_n, "torch_cuda": _torch(facts[same[0]]).get("cuda_built")},
            why="What the scheduler allocated and what CUDA exposes disagree: GPUs are idle, or shared with another job.",
            fix=("Request GPUs with --gres=gpu:N or --gpus-per-node and do not override CUDA_VISIBLE_DEVICES in "
                 "the job script; if torch sees none, check it is a CUDA build."),
        ))

    # Ranks versus GPUs on the node, from what the ranks can see (whether or not
    # ddpdoctor ran them on a GPU: with too few GPUs it falls back to CPU).
    uses_gpu = all(str(facts[r].get("device", "")).startswith("cuda") for r in ranks)
    visible_gpus = max(torch_counts.values(), default=0)
    if oversubscribed:
        out.append(Finding(
            code="GPU001", severity=Severity.CRITICAL, probe=NAME,
            title=f"{local} ranks on {host} but only {available} GPU{'s' if available != 1 else ''} "
                  "among them: ranks will share a GPU",
            ranks=tuple(ranks), nodes=nodes,
            evidence={"local_ranks": local, "distinct_gpus": available, "node_gpus": nvml_count,
                      "gpus_seen_by_rank": torch_counts,
                      "CUDA_VISIBLE_DEVICES_by_rank": {r: visible[r].raw for r in ranks if visible[r].restricts}},
            why=("NCCL refuses two ranks on one GPU (\"Duplicate GPU detected\" / \"Multiple Ranks are using the "
                 "same GPU/Partition\"); with gloo they compete for its memory and compute."),
            fix=(f"Launch at most {available} processes on this node (--nproc_per_node={available}), or give each "
                 "rank its own GPU (srun --gpus-per-task=1)"
                 + (f"; the node has {nvml_count} GPUs, so check that CUDA_VISIBLE_DEVICES or the GPU request does not "
                    "hand the same ones to every rank." if nvml_count and nvml_count > available else ".")),
        ))
    if sample.get("world_size") == 1 and max(visible_gpus, nvml_count or 0) > 1:
        out.append(Finding(
            code="GPU009", severity=Severity.WARN, probe=NAME,
            title=f"Only one rank, while {max(visible_gpus, nvml_count or 0)} GPUs are visible on {host}",
            ranks=tuple(ranks), nodes=nodes,
            evidence={"world_size": 1, "visible_gpus": visible_gpus, "nvml_gpus": nvml_count},
            why="The classic \"only one GPU is used\": the script was started with `python train.py`, not torchrun.",
            fix=f"Start it with `torchrun --nproc_per_node={max(visible_gpus, nvml_count or 0)} train.py`.",
        ))
    elif uses_gpu and len(ranks) == local and available is not None and available > local:
        out.append(Finding(
            code="GPU002", severity=Severity.WARN, probe=NAME,
            title=f"{local} ranks on {host} use {local} of its {available} visible GPUs; the rest are idle",
            ranks=tuple(ranks), nodes=nodes, evidence={"local_ranks": local, "visible_gpus": available},
            why="Launched with fewer processes per node than GPUs (e.g. --nproc_per_node=2 on a 4-GPU node).",
            fix=f"Use --nproc_per_node={available}, or set CUDA_VISIBLE_DEVICES to the GPUs you mean to use.",
        ))
    return out


def _gpus_available(ranks: list[int], facts: Mapping[int, Mapping[str, Any]]) -> Optional[int]:
    """Distinct GPUs the ranks of one node can use between them; None if CUDA works on none."""
    working = [r for r in ranks if _torch(facts[r]).get("cuda_available")]
    if not working:
        return None
    uuids = {d.get("uuid") for r in working for d in _torch(facts[r]).get("devices", []) if d.get("uuid")}
    if uuids:
        return len(uuids)
    counts = {int(_torch(facts[r]).get("device_count") or 0) for r in working}
    # Without UUIDs, one GPU each could be one GPU per task (Slurm binding): undecidable.
    return counts.pop() if len(counts) == 1 and counts != {1} else None


def _names_missing_devices(entries: tuple[str, ...], f: Mapping[str, Any]) -> list[str]:
    nv = f.get("nvml") or {}
    count = nv.get("device_count")
    if not isinstance(count, int):
        return []  # cannot tell without NVML
    uuids = {d.get("uuid") for d in nv.get("devices", [])}
    missing = []
    for entry in entries:
        if entry.isdigit() and int(entry) >= count:
            missing.append(entry)
        elif entry.startswith("GPU-") and not any(isinstance(u, str) and u.startswith(entry) for u in uuids):
            missing.append(entry)
    return missing


def _duplicate_gpus(facts: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    holders: dict[str, list[int]] = defaultdict(list)
    for r, f in facts.items():
        uuid = _uuid(_torch(f).get("current"))
        if uuid and str(f.get("device", "")).startswith("cuda"):
            holders[uuid].append(r)
    out = []
    for uuid, ranks in sorted(holders.items()):
        if len(ranks) > 1:
            hosts = tuple(sorted({str(facts[r].get("host")) for r in ranks}))
            out.append(Finding(
                code="GPU003", severity=Severity.CRITICAL, probe=NAME,
                title=f"Ranks {rank_ranges(ranks)} are on the same GPU {uuid}",
                ranks=tuple(sorted(ranks)), nodes=hosts,
                evidence={"gpu_uuid": uuid, "ranks": sorted(ranks),
                          "device_index_by_rank": {r: (_torch(facts[r]).get("current") or {}).get("index") for r in ranks},
                          "CUDA_VISIBLE_DEVICES_by_rank": {r: (facts[r].get("env") or {}).get("CUDA_VISIBLE_DEVICES")
                                                           for r in ranks}},
                why=("NCCL refuses it: \"" + NCCL_DUPLICATE_ERRORS[0] + " ...\" (NCCL before 2.30) or \""
                     + NCCL_DUPLICATE_ERRORS[1] + "\" (NCCL 2.30 and later). torch.cuda.set_device is missing or "
                     "uses the global rank instead of LOCAL_RANK."),
                fix="Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group and moving the model.",
            ))
    return out


def _foreign_contexts(facts: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    """Contexts a rank holds on another rank's GPU, and processes that are not ours at all."""
    out = []
    owner: dict[str, list[int]] = defaultdict(list)
    for r, f in sorted(facts.items()):
        uuid = _uuid(_torch(f).get("current"))
        if uuid:
            owner[uuid].append(r)
    for r, f in sorted(facts.items()):
        contexts = f.get("contexts")
        if not isinstance(contexts, list):
            continue
        own = _uuid(_torch(f).get("current"))
        stray = [u for u in contexts if u and u != own and u in owner]
        if stray:
            out.append(Finding(
                code="GPU004", severity=Severity.CRITICAL, probe=NAME,
                title=f"Rank {r} also holds a CUDA context on rank {rank_ranges(o for u in stray for o in owner[u])}'s GPU",
                ranks=(r,), nodes=(str(f.get("host")),),
                evidence={"own_gpu": own, "stray_contexts": stray},
                why=("Each context costs several hundred MB on that GPU: the classic \"OOM on GPU 0 only\" when ranks "
                     "touch cuda:0 (torch.cuda.set_device missing, tensors created with device='cuda' before it)."),
                fix="Call torch.cuda.set_device(LOCAL_RANK) first thing, and use torch.device('cuda', LOCAL_RANK) explicitly.",
            ))
    our_pids: dict[str, set[int]] = defaultdict(set)
    for f in facts.values():
        our_pids[str(f.get("host"))].add(int(f.get("pid") or -1))
    for host, pids in our_pids.items():
        host_facts = [f for f in facts.values() if str(f.get("host")) == host]
        nv = (host_facts[0].get("nvml") or {}) if host_facts else {}
        devices = [d for d in nv.get("devices", []) if d.get("uuid") in owner and isinstance(d.get("processes"), list)]
        listed = {p.get("pid") for d in devices for p in d["processes"]}
        if not listed & pids:
            continue  # our own ranks are not listed: another PID namespace (container), pids mean nothing here
        foreign = [{"gpu": d["uuid"], "pid": p.get("pid"), "used_bytes": p.get("used_bytes")}
                   for d in devices for p in d["processes"] if p.get("pid") not in pids]
        if foreign:
            out.append(Finding(
                code="GPU007", severity=Severity.WARN, probe=NAME,
                title=f"{len(foreign)} process(es) that are not ours use the GPUs of {host}",
                ranks=tuple(sorted({o for x in foreign for o in owner[x["gpu"]]})), nodes=(host,),
                evidence={"foreign_processes": foreign},
                why="Another job or a leftover process shares these GPUs: less memory, slower steps, possible OOM.",
                fix="Find them with `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`; end leftovers, "
                    "or ask the scheduler for exclusive GPUs (--exclusive, or GPU exclusive-process compute mode).",
            ))
    return out


def _all_clear(facts: Mapping[int, Mapping[str, Any]]) -> Finding:
    ranks = tuple(sorted(facts))
    hosts = tuple(sorted({str(f.get("host")) for f in facts.values()}))
    on_gpu = {r: _uuid(_torch(f).get("current")) for r, f in facts.items() if _torch(f).get("current")}
    if on_gpu and len(on_gpu) == len(facts):
        return Finding(code="GPU000", severity=Severity.OK, probe=NAME,
                       title=f"Each of {len(ranks)} ranks has its own GPU",
                       ranks=ranks, nodes=hosts, evidence={"gpu_by_rank": on_gpu})
    reasons = sorted({str(_torch(f).get("unavailable_reason") or "no GPU visible") for f in facts.values()})
    return Finding(code="GPU000", severity=Severity.INFO, probe=NAME,
                   title="No GPU in use: the ranks ran on CPU",
                   ranks=ranks, nodes=hosts,
                   evidence={"reason": reasons, "nvml": sorted({str((f.get("nvml") or {}).get("reason")) for f in facts.values()})})
