"""Judging a failed job from its events: the first cause, the ranks it dragged down.

The rule is the live check's (run_diagnosis.py): a rank that failed while waiting for a
peer (a timeout, a closed connection) is a victim whenever some rank failed on its own;
when every failure is a wait, the ranks that never complained are the suspects (stuck
elsewhere), and only when every rank waited in the same collective is it the transport.
torchrun's own "Root Cause (first observed failure)" names whichever rank exited first,
which after a hang is a victim; this diagnosis says so when it disagrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from ddpdoctor.judge.causal_order import link
from ddpdoctor.explain.causes import cause_findings
from ddpdoctor.explain.collectives import (
    detail_desync, flight_recorder_findings, gloo_size_mismatch, silent_suspects, watchdog_timeouts)
from ddpdoctor.explain.launchers import EXIT_RECORDS, JOB_LEVEL, exit_signal
from ddpdoctor.explain.events import RankStory, attribute, is_failure, is_wait, order_key
from ddpdoctor.core.codes import finding
from ddpdoctor.core.findings import Finding
from ddpdoctor.judge.flight_recorder import Agreement, Mismatch
from ddpdoctor.explain.scan import Event

PROBE = "explain"


@dataclass
class NodeStory:
    node: str
    ranks: list[int]
    first: Optional[Event]  # the node's earliest failure, its ranks' or one no rank signed


@dataclass
class Explanation:
    findings: list[Finding]
    ranks: list[RankStory]
    timeline: list[Event]
    world_size: Optional[int]
    hosts: dict[int, str] = field(default_factory=dict)
    nodes: list[NodeStory] = field(default_factory=list)


def rank_stories(events: list[Event], world_size: Optional[int], hosts: dict[int, str]) -> list[RankStory]:
    ranks = sorted({e.rank for e in events if e.rank is not None} | set(range(world_size or 0)))
    stories = []
    for r in ranks:
        failures = sorted((e for e in events if e.rank == r and is_failure(e)), key=order_key)
        first = failures[0] if failures else None
        more = sum(e.count for e in failures) - 1 if failures else 0
        stories.append(RankStory(r, hosts.get(r), first, more))
    return stories


def node_stories(events: list[Event], hosts: dict[int, str]) -> list[NodeStory]:
    """Per node, the first failure: on a cluster the node is what gets drained or fixed."""
    names = sorted(set(hosts.values()) | {e.host for e in events if e.host and is_failure(e)})
    out = []
    for node in names:
        ranks = sorted(r for r, h in hosts.items() if h == node)
        failures = [e for e in events if is_failure(e) and (e.host == node or (e.rank is not None and hosts.get(e.rank) == node))]
        out.append(NodeStory(node, ranks, min(failures, key=order_key) if failures else None))
    return out


def diagnose(events: list[Event], world_size: Optional[int] = None,
             mismatches: Iterable[Mismatch] = (), agreements: Iterable[Agreement] = (),
             dump_ranks: Iterable[int] = ()) -> Explanation:
    hosts, world = attribute(events, world_size)
    dumped = list(dump_ranks)
    if world_size is None and dumped and max(dumped) + 1 > (world or 0):
        world = max(dumped) + 1
    stories = rank_stories(events, world, hosts)
    timeline = sorted((e for e in events if e.role != "context" or is_failure(e)), key=order_key)
    findings: list[Finding] = []

    waits = {s.rank: s.first for s in stories if s.first is not None and is_wait(s.first)}
    waits.update(watchdog_aborts(events, waits))
    # Ranks that raised a mismatch error (gloo's size check, DETAIL's fingerprint check): their exit is RUN009's.
    mismatch_detectors = {e.rank for e in events if e.sig in ("gloo_size_mismatch", "detail_mismatch")}
    causes_by_rank: dict[int, list[Event]] = {}
    unattributed: list[Event] = []
    for e in sorted(events, key=order_key):
        if is_failure(e) and not is_wait(e) and e.sig not in ("detail_mismatch", "gloo_size_mismatch"):
            if e.sig == "python_exception" and e.rank in waits and order_key(e) > order_key(waits[e.rank]):
                continue  # the exception its own wait raised, further up the stack
            if e.sig in EXIT_RECORDS and e.rank in mismatch_detectors:
                continue  # the rank that noticed the mismatch raised and ended: RUN009 explains it
            if e.sig in EXIT_RECORDS and e.rank in waits:
                continue  # NCCL's watchdog aborts (SIGABRT) the rank that timed out: its end, not a cause
            if e.rank is None:
                unattributed.append(e)
            else:
                causes_by_rank.setdefault(e.rank, []).append(e)
    claim_unsigned(causes_by_rank, unattributed)

    findings += detail_desync(events, hosts)
    findings += gloo_size_mismatch(events, hosts)
    findings += watchdog_timeouts(events, hosts, waits, causes_by_rank, world, world_given=world_size is not None)
    findings += flight_recorder_findings(list(mismatches), list(agreements), hosts)
    findings += cause_findings(causes_by_rank, unattributed, waits, hosts, events, world)
    if not findings:
        findings += silent_suspects(stories, waits, hosts, events, world, world_given=world_size is not None)
    if not findings:
        findings.append(_nothing_known(events))
    # A generic failure the log's specific cause explains is listed under it (judge/causal_order.py).
    return Explanation(link(findings), stories, timeline, world, hosts, node_stories(events, hosts))


def claim_unsigned(causes_by_rank: dict[int, list[Event]], unattributed: list[Event]) -> None:
    """Exits with no error of their own (a plain exit code, no signal) where the log has errors
    nobody signed (older torch under srun prints no [rankN]:, a worker's stderr has no prefix):
    those errors are those ranks', not a second cause. Each unsigned error takes the plain exits
    on its host (on any host when it names none) as its `exit_ranks`; the exits leave the causes."""
    errors = [e for e in unattributed if e.sig not in EXIT_RECORDS and e.sig not in JOB_LEVEL]

    def plain(e: Event) -> bool:
        return e.sig in EXIT_RECORDS and exit_signal(e.fields, e.sig) is None

    exits = {r: evs for r, evs in causes_by_rank.items() if all(plain(e) for e in evs)}
    ranged = [e for e in unattributed if e.sig == "srun_task" and plain(e) and e.fields.get("task_ranks")]
    claimed: set[int] = set()
    for err in errors:
        mine = {r for r, evs in exits.items() if err.host is None or any(e.host == err.host for e in evs)}
        mine |= {int(t) for e in ranged if err.host is None or e.host == err.host for t in e.fields["task_ranks"]}
        if mine:
            err.fields["exit_ranks"] = sorted(mine)
            claimed |= mine
    for rank in claimed:
        causes_by_rank.pop(rank, None)


def watchdog_aborts(events: list[Event], waits: dict[int, Event]) -> dict[int, Event]:
    """Ranks aborted (SIGABRT) with no error of their own in a log where NCCL's watchdog timed a
    collective out: the watchdog ends a rank that timed out with std::abort, so their exit is
    that timeout's end (its lines not pasted), a wait, not a cause."""
    if not any(e.sig == "nccl_watchdog_timeout" for e in events):
        return {}
    own = {e.rank for e in events if is_failure(e) and not is_wait(e) and e.sig not in EXIT_RECORDS}
    aborted: dict[int, Event] = {}
    for e in sorted(events, key=order_key):
        if e.sig in EXIT_RECORDS and e.rank is not None and e.rank not in waits and e.rank not in own \
                and exit_signal(e.fields, e.sig) == "SIGABRT":
            aborted.setdefault(e.rank, e)
    return aborted


def _nothing_known(events: list[Event]) -> Finding:
    return finding("LOG000", PROBE, "No known failure signature in these logs",
                   evidence={"context_lines_recognised": len(events)})
