"""The checks of one node: its ranks against its GPUs (pure, on recorded facts).

Each check compares what the ranks of one host say between them: torch's device count, NVML's,
CUDA_VISIBLE_DEVICES as CUDA reads it, the scheduler's grant, LOCAL_RANK. `host_findings` reads
those once into a `Node` and runs the checks in the order the report has always listed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from ddpdoctor.core import codes, cuda_version
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.measure.cuda_visible import VisibleDevices
from ddpdoctor.measure.cuda_visible import parse as parse_visible

from ddpdoctor.probes.gpu_count.facts import GpuCountFacts

NAME = "gpu-count"


@dataclass(frozen=True)
class Node:
    """One host's ranks and what they say between them, read once for every check."""

    host: str
    ranks: list[int]
    facts: Mapping[int, GpuCountFacts]
    nvml_count: Optional[int]  # the most GPUs NVML reported on any of its ranks
    torch_counts: dict[int, int]  # GPUs torch lists on each rank
    visible: dict[int, VisibleDevices]  # CUDA_VISIBLE_DEVICES of each rank, as CUDA reads it
    local: int  # ranks on this node, as the launcher says or as counted
    available: Optional[int]  # distinct GPUs the ranks can use between them (see gpus_available)

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.host,)

    @property
    def oversubscribed(self) -> bool:
        return self.available is not None and 0 < self.available < self.local


def read_node(host: str, ranks: list[int], facts: Mapping[int, GpuCountFacts]) -> Node:
    counts = [c for c in (facts[r].nvml.count for r in ranks) if c is not None]
    return Node(
        host=host, ranks=ranks, facts=facts,
        nvml_count=max(counts, default=None),
        torch_counts={r: int(facts[r].torch.device_count) for r in ranks},
        visible={r: parse_visible(facts[r].env.get("CUDA_VISIBLE_DEVICES")) for r in ranks},
        local=max(len(ranks), int(facts[ranks[0]].local_world_size or len(ranks))),
        available=gpus_available(ranks, facts),
    )


def host_findings(host: str, ranks: list[int], facts: Mapping[int, GpuCountFacts]) -> list[Finding]:
    """Every finding about one node: CUDA itself, each rank's visible devices, then the node's counts."""
    node = read_node(host, ranks, facts)
    out = cuda_unusable(node)
    for r in ranks:
        out += visible_devices_findings(node, r)
    return out + slurm_mismatch(node) + oversubscribed(node) + rank_count_vs_gpus(node)


def gpus_available(ranks: list[int], facts: Mapping[int, GpuCountFacts]) -> Optional[int]:
    """Distinct GPUs the ranks of one node can use between them; None if CUDA works on none."""
    working = [r for r in ranks if facts[r].torch.cuda_available]
    if not working:
        return None
    uuids = {d.uuid for r in working for d in facts[r].torch.devices if d.uuid}
    if uuids:
        return len(uuids)
    counts = {int(facts[r].torch.device_count) for r in working}
    # Without UUIDs, one GPU each could be one GPU per task (Slurm binding): undecidable.
    return counts.pop() if len(counts) == 1 and counts != {1} else None


def names_missing_devices(entries: tuple[str, ...], f: GpuCountFacts) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries (indices, GPU- UUID prefixes) NVML says this node lacks."""
    count = f.nvml.count
    if count is None:
        return []  # cannot tell without NVML
    uuids = {d.uuid for d in f.nvml.devices}
    missing = []
    for entry in entries:
        if entry.isdigit() and int(entry) >= count:
            missing.append(entry)
        elif entry.startswith("GPU-") and not any(isinstance(u, str) and u.startswith(entry) for u in uuids):
            missing.append(entry)
    return missing


def cuda_unusable(node: Node) -> list[Finding]:
    """GPU008: torch cannot use CUDA on a node that has GPUs (a CPU wheel, or a driver too old).

    Ranks whose CUDA_VISIBLE_DEVICES names only GPUs the node lacks are left to GPU005, which
    names the real cause."""
    if not node.nvml_count:
        return []
    broken = [r for r in node.ranks if not node.facts[r].torch.cuda_available and node.visible[r].count != 0
              and not names_missing_devices(node.visible[r].entries[:1], node.facts[r])]
    if not broken:
        return []
    t, nv = node.facts[broken[0]].torch, node.facts[broken[0]].nvml
    built = t.cuda_built
    if not built:
        said = "it was built without CUDA"
    elif cuda_version.driver_too_old(nv.cuda_driver_version, built):
        said = (f"its driver {nv.driver_version} ({cuda_version.words(cuda_version.driver_cuda(nv.cuda_driver_version))}) "
                f"is older than torch's {cuda_version.words(cuda_version.built_cuda(built))}")
    else:
        said = "CUDA is unavailable"
    return [codes.finding(
        "GPU008", NAME,
        f"torch on rank {rank_ranges(broken)} cannot use the {node.nvml_count} GPUs of {node.host}: {said}",
        ranks=tuple(broken), nodes=node.nodes,
        evidence={"nvml_gpus": node.nvml_count, "torch_version": t.version, "torch_cuda": built,
                  "driver_version": nv.driver_version, "driver_cuda": nv.cuda_driver_version,
                  "reason": t.unavailable_reason},
        why=("A CPU-only torch wheel never sees GPUs." if not built else
             "torch's CUDA runtime could not start: most often the driver is older than the CUDA version "
             "torch was built for (\"The NVIDIA driver on your system is too old\")."),
        fix=("Install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu124 or newer)."
             if not built else "Upgrade the driver to one that supports torch's CUDA version, or install a "
             "torch build for an older CUDA; check `nvidia-smi` works on that node."))]


def visible_devices_findings(node: Node, r: int) -> list[Finding]:
    """GPU005, for one rank: its CUDA_VISIBLE_DEVICES misread, naming absent GPUs, or too short for LOCAL_RANK."""
    return [f for f in (misread_visible(node, r), names_absent_gpus(node, r), local_rank_past_visible(node, r))
            if f is not None]


def misread_visible(node: Node, r: int) -> Optional[Finding]:
    """CUDA_VISIBLE_DEVICES that CUDA reads differently than the user meant: partly unreadable
    (CUDA silently stops at the first bad entry), or hiding every GPU of a node that has some."""
    v = node.visible[r]
    if v.problems and v.ignored:
        return codes.finding(
            "GPU005", NAME,
            f"CUDA_VISIBLE_DEVICES={v.raw!r} on rank {r} is partly unreadable: CUDA uses only {list(v.entries)}",
            severity=Severity.WARN, ranks=(r,), nodes=node.nodes,
            evidence={"CUDA_VISIBLE_DEVICES": v.raw, "used": list(v.entries), "ignored": list(v.ignored),
                      "problem": v.problems[0]},
            why="CUDA stops reading the variable at the first entry it does not understand, without an error.",
            fix="Use only GPU indices (0,1), GPU- UUIDs or MIG- ids, comma-separated, each once.")
    if v.restricts and v.count == 0 and node.nvml_count:
        return codes.finding(
            "GPU005", NAME,
            f"CUDA_VISIBLE_DEVICES={v.raw!r} hides every GPU from rank {r} on a node with {node.nvml_count}",
            severity=Severity.CRITICAL, ranks=(r,), nodes=node.nodes,
            evidence={"CUDA_VISIBLE_DEVICES": v.raw, "nvml_gpus": node.nvml_count},
            why="An empty value or -1 hides all GPUs; the rank runs on CPU or fails.",
            fix="Unset CUDA_VISIBLE_DEVICES or list the GPUs this job was given.")
    return None


def names_absent_gpus(node: Node, r: int) -> Optional[Finding]:
    """CUDA_VISIBLE_DEVICES naming an index past the last GPU, or another machine's UUID."""
    v = node.visible[r]
    missing = names_missing_devices(v.entries, node.facts[r])
    if not missing:
        return None
    return codes.finding(
        "GPU005", NAME,
        f"CUDA_VISIBLE_DEVICES on rank {r} names GPUs that {node.host} does not have: {', '.join(missing)}",
        severity=Severity.CRITICAL, ranks=(r,), nodes=node.nodes,
        evidence={"CUDA_VISIBLE_DEVICES": v.raw, "nvml_gpus": node.nvml_count,
                  "nvml_uuids": [d.uuid for d in node.facts[r].nvml.devices]},
        why="An index past the last GPU or a UUID of another machine makes CUDA see fewer GPUs than meant.",
        fix="Take the indices or UUIDs from `nvidia-smi -L` on this node, or from the scheduler's allocation.")


def local_rank_past_visible(node: Node, r: int) -> Optional[Finding]:
    """LOCAL_RANK at or past the GPUs the rank sees: set_device(LOCAL_RANK) fails with "invalid
    device ordinal". Left to GPU001 when the node has fewer GPUs than ranks anyway."""
    v, f = node.visible[r], node.facts[r]
    seen = node.torch_counts[r] if f.torch.cuda_available else v.count
    local_rank = int(f.local_rank)
    if seen is None or seen <= 1 or local_rank < seen or node.oversubscribed:
        return None
    return codes.finding(
        "GPU005", NAME,
        f"Rank {r} has LOCAL_RANK={local_rank} but sees only {seen} GPUs: set_device(LOCAL_RANK) fails",
        severity=Severity.CRITICAL, ranks=(r,), nodes=node.nodes,
        evidence={"LOCAL_RANK": local_rank, "visible_gpus": seen, "CUDA_VISIBLE_DEVICES": v.raw},
        why=("torch.cuda.set_device(LOCAL_RANK) raises \"CUDA error: invalid device ordinal\" when a rank sees "
             "fewer GPUs than its local rank, e.g. CUDA_VISIBLE_DEVICES differs across the ranks of a node."),
        fix=("Give every rank of a node the same CUDA_VISIBLE_DEVICES, or one GPU per task "
             "(srun --gpus-per-task=1) and set_device(0)."))


SLURM_EVIDENCE = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK",
                  "CUDA_VISIBLE_DEVICES")


def slurm_mismatch(node: Node) -> list[Finding]:
    """GPU006: the scheduler granted another number of GPUs than CUDA sees; one finding for the
    ranks of a node that agree on both numbers."""
    mismatched: dict[tuple[Optional[int], int], list[int]] = {}
    for r, granted_n, cuda_n in _slurm_grants(node):
        if granted_n is not None and granted_n != cuda_n and not (granted_n > cuda_n == 1 and node.visible[r].count == 1):
            mismatched.setdefault((granted_n, cuda_n), []).append(r)
    out = []
    for (granted_n, cuda_n), same in mismatched.items():
        env = node.facts[same[0]].env
        who = f"rank {same[0]}" if len(same) == 1 else f"ranks {rank_ranges(same)}"
        out.append(codes.finding(
            "GPU006", NAME, f"Slurm granted {granted_n} GPUs on {node.host}, but torch on {who} sees {cuda_n}",
            ranks=tuple(same), nodes=node.nodes,
            evidence={k: env.get(k) for k in SLURM_EVIDENCE if env.get(k)}
            | {"torch_gpus": cuda_n, "torch_cuda": node.facts[same[0]].torch.cuda_built}))
    return out


def _slurm_grants(node: Node) -> Iterator[tuple[int, Optional[int], int]]:
    """Per rank: the GPUs Slurm granted it (None outside Slurm) and those torch can use."""
    for r in node.ranks:
        env = node.facts[r].env
        granted = _gpu_list(env.get("SLURM_STEP_GPUS")) or _gpu_list(env.get("SLURM_JOB_GPUS"))
        granted_n = len(granted) if granted is not None else None
        on_node = env.get("SLURM_GPUS_ON_NODE") or ""
        if granted_n is None and on_node.isdigit():
            granted_n = int(on_node)
        yield r, granted_n, node.facts[r].cuda_count


def _gpu_list(text: Optional[str]) -> Optional[list[str]]:
    """SLURM_*_GPUS ("0,1", "0-1(IDX:0-1)") as the indices it lists; None when unset or empty."""
    if not text:
        return None
    return [t for t in text.replace("(", ",").replace(")", ",").split(",") if t.strip().isdigit()]


def oversubscribed(node: Node) -> list[Finding]:
    """GPU001: more ranks on the node than distinct GPUs among them, so ranks share a GPU.

    Judged from what the ranks can see, whether or not ddpdoctor ran them on a GPU: with too
    few GPUs it falls back to CPU."""
    available, nvml_count, visible = node.available, node.nvml_count, node.visible
    if available is None or not node.oversubscribed:
        return []
    return [codes.finding(
        "GPU001", NAME,
        f"{node.local} ranks on {node.host} but only {available} GPU{'s' if available != 1 else ''} "
        "among them: ranks will share a GPU",
        ranks=tuple(node.ranks), nodes=node.nodes,
        evidence={"local_ranks": node.local, "distinct_gpus": available, "node_gpus": nvml_count,
                  "gpus_seen_by_rank": node.torch_counts,
                  "CUDA_VISIBLE_DEVICES_by_rank": {r: visible[r].raw for r in node.ranks if visible[r].restricts}},
        fix=(f"Launch at most {available} processes on this node (--nproc_per_node={available}), or give each "
             "rank its own GPU (srun --gpus-per-task=1)"
             + (f"; the node has {nvml_count} GPUs, so check that CUDA_VISIBLE_DEVICES or the GPU request does not "
                "hand the same ones to every rank." if nvml_count and nvml_count > available else ".")))]


def rank_count_vs_gpus(node: Node) -> list[Finding]:
    """GPU009 (one rank while several GPUs are visible: started without torchrun) or else GPU002
    (fewer ranks than the GPUs they could use: the rest sit idle)."""
    visible_gpus = max(node.torch_counts.values(), default=0)
    most = max(visible_gpus, node.nvml_count or 0)
    if node.facts[node.ranks[0]].world_size == 1 and most > 1:
        return [codes.finding(
            "GPU009", NAME, f"Only one rank, while {most} GPUs are visible on {node.host}", ranks=tuple(node.ranks),
            nodes=node.nodes, evidence={"world_size": 1, "visible_gpus": visible_gpus, "nvml_gpus": node.nvml_count},
            fix=f"Start it with `torchrun --nproc_per_node={most} train.py`.")]
    uses_gpu = all(node.facts[r].on_cuda for r in node.ranks)
    if uses_gpu and len(node.ranks) == node.local and node.available is not None and node.available > node.local:
        return [codes.finding(
            "GPU002", NAME,
            f"{node.local} ranks on {node.host} use {node.local} of its {node.available} visible GPUs; the rest are idle",
            ranks=tuple(node.ranks), nodes=node.nodes,
            evidence={"local_ranks": node.local, "visible_gpus": node.available},
            fix=f"Use --nproc_per_node={node.available}, or set CUDA_VISIBLE_DEVICES to the GPUs you mean to use.")]
    return []
