"""One verdict first: a specific cause above the generic failures it explains.

Why: a user reads the first line and acts on it. Where two ranks share one GPU, NCCL fails the
first collective on every rank: the run's own diagnosis says "All ranks failed inside
ddp_construct_broadcast" (RUN008, whose fix is about networks) and the gpu-count probe says "2
ranks but only 1 GPU" (GPU001, the cause). Both are critical; ordered by severity and then by
probe, the consequence came first (the H100 record, issue 37). The rule here links them: a
generic failure of ranks (a crash, an error, a hang, a collective that failed) is explained by
a specific cause on the same ranks (their GPUs, their interface, their container's limits),
found by the same run. The cause leads; what it explains is listed under it (`explained_by`),
never as a rival. check, diagnose, explain and the callback all read findings through here.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from ddpdoctor.core.findings import Finding, Severity, rank_ranges

# Failures of ranks that say what happened, not why: a rank crashed (RUN002), raised (RUN003),
# hung (RUN004), stopped answering (RUN005), or every rank failed inside one collective (RUN008).
GENERIC = frozenset({"RUN002", "RUN003", "RUN004", "RUN005", "RUN008"})
# Causes that make ranks fail that way: ranks without a GPU of their own (GPU001, GPU003), GPUs
# hidden or misnamed (GPU005), torch unable to use CUDA (GPU008), an interface that is not there
# (INIT001), nodes that cannot open TCP connections to each other (INIT005: a firewall) or an interface
# *_SOCKET_IFNAME makes the backend bind to that the other nodes cannot reach (INIT006), a container's
# /dev/shm, open files, processes or memory too small (LIM001, LIM002, LIM004, LIM005).
SPECIFIC = frozenset({"GPU001", "GPU003", "GPU005", "GPU008", "INIT001", "INIT005", "INIT006", "LIM001", "LIM002",
                      "LIM004", "LIM005"})
# Replicas that went apart (callback): a loss that went non-finite (DOC018) makes the weights non-finite
# (DOC017) and different (DOC013) on ranks other than its own, through the averaged gradient, so these
# are linked across ranks, by step: the loss went non-finite no later than the weights were seen apart.
REPLICAS = {"DOC018": frozenset({"DOC017", "DOC013"}), "DOC017": frozenset({"DOC013"})}


def _step(f: Finding, *keys: str) -> float:
    value = next((f.evidence.get(k) for k in keys if isinstance(f.evidence.get(k), int)), None)
    return float(value) if value is not None else float("inf")


def _replicas_explain(cause: Finding, effect: Finding) -> bool:
    """A non-finite loss or weights explain a divergence only where it was not told by another cause (its own
    `explained_by`: DOC012, DOC014, DOC015 come first), is more than last bits, and began after the replicas
    were last seen equal and no later than they were seen apart."""
    if effect.code == "DOC013":
        said = effect.evidence.get("explained_by")
        if said not in (None, "DOC017") or (cause.code == "DOC017" and said != "DOC017"):
            return False
        if effect.severity < Severity.CRITICAL:
            return False
    began = _step(cause, "first_step", "step")
    equal = effect.evidence.get("last_equal_step")
    return began <= _step(effect, "first_seen_step", "step") and not (isinstance(equal, int) and began <= equal)


def _explains(cause: Finding, effect: Finding) -> bool:
    if effect.code in REPLICAS.get(cause.code, ()):
        return _replicas_explain(cause, effect)
    if cause.code not in SPECIFIC or effect.code not in GENERIC or cause.severity < Severity.WARN:
        return False
    if cause.evidence.get("backend_of_this_run"):
        return False  # a setting only another backend reads (INIT001, INIT006): none of this run's failures
    if not cause.ranks or not effect.ranks:
        return bool(set(cause.nodes) & set(effect.nodes)) or not (cause.nodes or effect.nodes)
    return bool(set(cause.ranks) & set(effect.ranks))


def link(findings: Iterable[Finding]) -> list[Finding]:
    """The same findings in the same order, each generic failure that a specific cause explains
    marked `explained_by` that cause's code (the worst such cause, the first of equals)."""
    found = list(findings)
    causes = sorted((f for f in found if f.code in SPECIFIC or f.code in REPLICAS), key=lambda f: -int(f.severity))
    out = []
    for f in found:
        # Linked before (the callback links each check's new findings): kept, but climbed like a new link.
        by = (next((c for c in causes if c.code == f.explained_by), None) if f.explained_by
              else next((c for c in causes if _explains(c, f)), None))
        # A chain (DOC018 -> DOC017 -> DOC013) hangs under its first cause, so one verdict leads.
        while by is not None and (up := next((c for c in causes if _explains(c, by)), None)) is not None:
            by = up
        out.append(dataclasses.replace(f, explained_by=by.code) if by is not None else f)
    return out


def ordered(findings: Sequence[Finding], keep_order: bool = False) -> list[Finding]:
    """Display order: the causes (every finding no other explains), worst first (within a severity,
    the run's own findings first unless `keep_order`), each followed by the findings it explains."""
    linked = link(findings)
    roots = [f for f in linked if not f.explained_by]
    key = (lambda f: -int(f.severity)) if keep_order else (lambda f: (-int(f.severity), f.probe != "run", f.code))
    out: list[Finding] = []
    for root in sorted(roots, key=key):
        out.append(root)
        under = [f for f in linked if f.explained_by == root.code and f not in out and _chained(root, f, linked)]
        # Within a chain, each finding after the one that explains it (DOC017 before the DOC013 it explains).
        out += sorted(under, key=lambda f: (sum(_explains(m, f) for m in under if m is not f), key(f)))
    out += [f for f in linked if f not in out]  # explained by a cause that is not a root: never dropped
    return out


def _chained(root: Finding, f: Finding, found: Sequence[Finding]) -> bool:
    """`root` explains `f`, itself or through a finding it explains (DOC018 -> DOC017 -> DOC013)."""
    return _explains(root, f) or any(_explains(root, mid) and _explains(mid, f) for mid in found)


def verdict_line(findings: Sequence[Finding]) -> str:
    """The report's first line: what is wrong, where, and the first thing to do, from the root
    cause; "healthy" when nothing is worse than information."""
    first = next((f for f in ordered(findings) if f.severity >= Severity.WARN), None)
    if first is None:
        return "healthy: no warning or critical finding"
    where = f" (ranks {rank_ranges(first.ranks)})" if len(first.ranks) > 1 else (
        f" (rank {first.ranks[0]})" if first.ranks else "")
    step = first.fix.split(". ")[0].rstrip(".") if first.fix else ""
    return f"{first.code}{where}: {first.title}" + (f". First: {step}." if step else "")

