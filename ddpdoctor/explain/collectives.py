"""Collective hangs in a log: desyncs (DETAIL, gloo sizes, NCCL's watchdog, the Flight
Recorder), the rank that never came, and when every rank only waited, the transport.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ddpdoctor.explain.events import (
    RankStory, agent_root_cause, cite, nodes_of, order_key, victims_evidence, where_text)
from ddpdoctor.core.codes import finding
from ddpdoctor.core.findings import Finding, rank_ranges
from ddpdoctor.judge.flight_recorder import Agreement, Mismatch
from ddpdoctor.core.grouping import group_ranks, minority
from ddpdoctor.explain.scan import Event

PROBE = "explain"

# Waits that mean the peer's process is gone (a hung peer makes its partners time out instead).
_CLOSED = ("gloo_peer_closed", "store_broken", "nccl_remote_error")
_FP_FIELD = re.compile(r"(SequenceNumber|OpType|TensorShape|TensorDtypes)=(\[[^\]]*\]|[^,)]+)")


def _fingerprint(text: str) -> dict[str, str]:
    return {k: v.strip() for k, v in _FP_FIELD.findall(text)}


def detail_desync(events: list[Event], hosts: dict[int, str]) -> list[Finding]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL compared every collective: name the ranks apart from the majority."""
    prints: dict[int, dict[str, str]] = {}
    cites = []
    for e in events:
        if e.sig != "detail_mismatch":
            continue
        cites.append(cite(e))
        for side in ("a", "b"):
            rank = int(e.fields[f"rank_{side}"])
            prints.setdefault(rank, _fingerprint(str(e.fields.get(f"fp_{side}", ""))))
    if len(prints) < 2:
        return []

    def call(fp: dict[str, str]) -> str:
        shape = fp.get("TensorShape", "?")
        return f"{fp.get('OpType', '?')} #{fp.get('SequenceNumber', '?')} (shape {shape}, {fp.get('TensorDtypes', '?')})"

    calls = {r: call(fp) for r, fp in prints.items()}
    groups = group_ranks(calls)
    odd = minority(groups) or sorted(calls)
    culprits = odd if len(odd) < len(calls) else sorted(calls)
    differs = sorted({k for k in ("OpType", "SequenceNumber", "TensorShape", "TensorDtypes")
                      if len({fp.get(k) for fp in prints.values()}) > 1})
    desc = "; ".join(f"rank {rank_ranges(rs)} {'is' if len(rs) == 1 else 'are'} in {c}" for c, rs in groups)
    return [finding(
        "RUN009", PROBE,
        title=f"Collective mismatch (desync): {desc}",
        ranks=tuple(culprits), nodes=nodes_of(culprits, hosts),
        evidence={"collective_by_rank": {str(r): calls[r] for r in sorted(calls)},
                  "differs_in": ", ".join({"OpType": "op", "SequenceNumber": "sequence number",
                                           "TensorShape": "shape", "TensorDtypes": "dtype"}[k] for k in differs),
                  "log": cites[:4]},
        why=("TORCH_DISTRIBUTED_DEBUG=DETAIL compared the collective every rank was about to run and they differ: "
             "the rank(s) apart from the majority took another code path or built other tensors."),
        fix=("Make every rank issue the same collectives with the same shapes and dtypes in the same order: look "
             "for rank-dependent code (`if rank == 0:` around a collective, an early exit, a rank-dependent "
             "batch or model shape) on the named ranks."),
    )]


def gloo_size_mismatch(events: list[Event], hosts: dict[int, str]) -> list[Finding]:
    """gloo noticed a message of the wrong size: a mismatch, but the message cannot say whose."""
    seen = [e for e in events if e.sig == "gloo_size_mismatch"]
    if not seen:
        return []
    first = sorted(seen, key=order_key)[0]
    detector = sorted({e.rank for e in seen if e.rank is not None})
    ranks = sorted({e.rank for e in events if e.rank is not None})
    by = f" on {where_text(detector, hosts)}" if detector else ""
    return [finding(
        "RUN009", PROBE,
        title=(f"Collective mismatch (desync) detected by gloo{by}: it received {first.fields.get('got')} bytes "
               f"where its collective expected {first.fields.get('expected')}"),
        ranks=tuple(ranks), nodes=nodes_of(ranks, hosts),
        evidence={"log": [cite(e) for e in seen[:4]], "detected_by": rank_ranges(detector) or "unknown"},
        why=("Ranks ran collectives of different sizes (or different collectives) at the same point, so a rank "
             "received a message of the wrong size and gloo aborted it. The rank that noticed is not necessarily "
             "the one that is different, and this message cannot say which one is."),
        fix=("Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (it names the rank and the shapes) or with "
             "TORCH_FR_BUFFER_SIZE=2000 and give the Flight Recorder dumps to `ddpdoctor explain`; look for "
             "rank-dependent tensor sizes (uneven last batch, rank-0-only metrics) before the collective."),
    )]


def watchdog_timeouts(events: list[Event], hosts: dict[int, str], waits: dict[int, Event],
              causes: dict[int, list[Event]], world: Optional[int], world_given: bool = False) -> list[Finding]:
    """NCCL's watchdog says which collective (op, sequence number) each rank timed out in."""
    calls: dict[int, tuple[str, int]] = {}
    cites: dict[int, Event] = {}
    progress: dict[int, dict[str, Any]] = {}
    for e in sorted(events, key=order_key):
        if e.rank is None:
            continue
        if e.sig == "nccl_watchdog_timeout" and e.rank not in calls:
            calls[e.rank] = (str(e.fields["op"]), int(e.fields["seq"]))
            cites[e.rank] = e
        elif e.sig == "nccl_work_progress" and e.rank not in progress:
            progress[e.rank] = {k: int(e.fields[k]) for k in ("seq", "enqueued", "completed")}
        elif e.sig == "nccl_dump_signal" and e.rank not in progress:
            progress[e.rank] = {"seq": None, "enqueued": int(e.fields["enqueued"]),
                                "completed": int(e.fields["completed"])}
    if not calls:
        return []
    shown = {r: f"{op} #{seq}" for r, (op, seq) in calls.items()}
    evidence: dict[str, Any] = {"timed_out_in": {str(r): f"{shown[r]} ({cites[r].where})" for r in sorted(shown)}}
    if progress:
        evidence["nccl_progress"] = {
            str(r): (f"timed out at #{p['seq']}, " if p["seq"] is not None else "did not time out, ")
            + f"last enqueued #{p['enqueued']}, last completed #{p['completed']}" for r, p in sorted(progress.items())}
    groups = group_ranks(shown)
    if len(groups) > 1:
        odd = minority(groups)
        culprits = odd if odd and len(odd) < len(shown) else sorted(shown)
        desc = "; ".join(f"rank {rank_ranges(rs)} timed out in {c}" for c, rs in groups)
        return [finding(
            "RUN009", PROBE,
            title=f"Collective mismatch (desync): {desc}",
            ranks=tuple(culprits), nodes=nodes_of(culprits, hosts), evidence=evidence,
            why=("Ranks waited in different collectives (another op, or the same op at another sequence number), "
                 "so each waited for partners that never came: the rank(s) apart from the majority took another "
                 "code path, or skipped or added a collective."),
            fix=("Make every rank issue the same collectives in the same order: look for rank-dependent code "
                 "around collectives (`if rank == 0:` validation, checkpointing or logging that calls "
                 "all_reduce/barrier), uneven numbers of batches per rank, or a skipped backward. "
                 "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective; the Flight Recorder "
                 "(TORCH_NCCL_TRACE_BUFFER_SIZE=2000) records them for `ddpdoctor explain`."),
        )]
    if causes:
        return []  # a rank failed on its own: the timeouts are its consequence (see _causes)
    (op_seq, ranks), = groups
    _, seq = next(iter(calls.values()))
    behind = sorted(r for r, p in progress.items() if p["enqueued"] < seq)
    known = set(range(world or 0)) | {e.rank for e in events if e.rank is not None}
    silent = sorted(known - set(calls) - set(waits))
    suspects = (silent if whole_world(silent, events, world, world_given) else []) or behind
    if not suspects and (silent or set(waits) - set(calls)):
        # Who never came printed nothing here, or a rank ended waiting in a collective the log does not name.
        return [undetermined(op_seq, sorted(calls), silent, evidence, waits)]
    if suspects:
        return [finding(
            "RUN004", PROBE,
            title=f"{where_text(suspects, hosts)} never entered {op_seq}: rank {rank_ranges(ranks)} timed out waiting "
                  f"for {'it' if len(suspects) == 1 else 'them'}",
            ranks=tuple(suspects), nodes=nodes_of(suspects, hosts),
            evidence={**evidence, "silent_ranks": rank_ranges(silent) or "none",
                      "ranks_behind": rank_ranges(behind) or "none"},
        )]
    return [finding(
        "RUN008", PROBE,
        title=f"All ranks timed out inside {op_seq}: the collective itself did not complete",
        ranks=tuple(sorted(ranks)), nodes=nodes_of(ranks, hosts), evidence=evidence,
        why=("Every rank entered the same collective and none finished it: the transport between ranks is broken "
             "or blocked (network interface, firewall, InfiniBand, peer-to-peer between GPUs), or a GPU hung."),
        fix=("Rerun with NCCL_DEBUG=INFO and check the interface in `NET/Socket : Using` on every node "
             "(NCCL_SOCKET_IFNAME), firewalls between nodes, and `nvidia-smi` / `dmesg | grep -i xid` on each node; "
             "`ddpdoctor allreduce-bench` localises a slow or broken link."),
    )]


def whole_world(silent: list[int], events: list[Event], world: Optional[int], world_given: bool) -> bool:
    """Whether a rank's silence is evidence: the user gave the world size, every silent rank printed
    lines of its own in this log, or torchrun's agent accounted for every worker of the world (by
    pid: those that failed and those it stopped). A rank absent from a partial paste was not seen stuck."""
    seen = {e.rank for e in events if e.rank is not None}
    workers = {e.fields["pid"] for e in events if e.sig in ("elastic_block", "elastic_failed", "elastic_sigterm")
               and e.fields.get("pid") is not None}
    return world_given or set(silent) <= seen or (world is not None and len(workers) >= world)


def undetermined(call: str, timed_out: list[int], silent: list[int], evidence: dict[str, Any],
                 waits: dict[int, Event]) -> Finding:
    """Ranks waited and the log does not show who they waited for: no rank is blamed."""
    others = sorted(set(waits) - set(timed_out))
    also = f", rank {rank_ranges(others)} ended waiting ({waits[others[0]].label})" if others else ""
    absent = f" (rank {rank_ranges(silent)} printed nothing here)" if silent else ""
    return finding(
        "RUN008", PROBE,
        title=(f"rank {rank_ranges(timed_out)} timed out waiting in {call}{also}: who never came is not in "
               f"this log{absent}"),
        ranks=(), nodes=(),
        evidence={**evidence, "waiting": victims_evidence(waits), "not_in_log": rank_ranges(silent) or "none"},
        why=("These ranks timed out (or were aborted by NCCL's watchdog) waiting for peers, and the ranks they "
             "waited for printed nothing in this log: it does not hold every rank's output, so it cannot say which "
             "rank stopped issuing collectives or why."),
        fix=("Give `ddpdoctor explain` every rank's output (every node's file, the whole log), or pass "
             "--world-size when the log is complete; the Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE=2000) "
             "dumps name the rank that never issued the collective."),
    )


def flight_recorder_findings(mismatches: list[Mismatch], agreements: list[Agreement],
                     hosts: dict[int, str]) -> list[Finding]:
    findings = []
    for m in mismatches:
        present = {r: c for r, c in m.calls.items() if c is not None}
        group = "" if m.group in ("0", "") else f" in process group {m.group}"
        evidence: dict[str, Any] = {
            "collective_by_rank": {str(r): (f"{c.signature()} [{c.state or 'state unknown'}]" if c
                                            else f"none (its last recorded collective is #{m.last_seq[r]})")
                                   for r, c in sorted(m.calls.items())},
            "sequence_number": m.seq}
        if m.missing:
            waiting = sorted(present)
            op = next(iter(present.values())).op if present else "?"
            findings.append(finding(
                "RUN004", PROBE,
                title=(f"{where_text(m.missing, hosts)} never issued collective #{m.seq} ({op}){group}: "
                       f"rank {rank_ranges(waiting)} did"),
                ranks=tuple(m.missing), nodes=nodes_of(m.missing, hosts), evidence=evidence,
            ))
            continue
        calls = {r: c.signature() for r, c in present.items()}
        groups = group_ranks(calls)
        odd = minority(groups) or sorted(calls)
        desc = "; ".join(f"rank {rank_ranges(rs)} {'is' if len(rs) == 1 else 'are'} in {c}" for c, rs in groups)
        findings.append(finding(
            "RUN009", PROBE,
            title=f"Collective mismatch at #{m.seq}{group} (Flight Recorder): {desc}",
            ranks=tuple(odd), nodes=nodes_of(odd, hosts), evidence=evidence,
            why=("The ranks' Flight Recorder dumps disagree on the collective with this sequence number (op, "
                 "shapes or dtypes): the rank(s) apart from the majority took another code path."),
            fix=("Make every rank issue the same collectives with the same shapes and dtypes in the same order; the "
                 "dump's `frames` of the named ranks show the Python line that issued theirs."),
        ))
    for a in agreements:
        findings.append(finding(
            "LOG011", PROBE,
            title=(f"Flight Recorder: rank {rank_ranges(a.ranks)} agree on every collective #{a.first_seq}-#{a.last_seq}"
                   + ("" if a.group in ("0", "") else f" of process group {a.group}")),
            ranks=a.ranks, evidence={"first_seq": a.first_seq, "last_seq": a.last_seq},
        ))
    return findings


def silent_suspects(stories: list[RankStory], waits: dict[int, Event], hosts: dict[int, str],
                    events: list[Event], world: Optional[int], world_given: bool = False) -> list[Finding]:
    """Only waits: the ranks that did not complain are where the job was stuck, when the log
    shows them (see whole_world); otherwise who was waited for is not in this log."""
    if not waits:
        return []
    silent = sorted(s.rank for s in stories if s.rank not in waits)
    closed = all(e.sig in _CLOSED for e in waits.values())
    if silent and not closed and not whole_world(silent, events, world, world_given):
        # A timeout only says a peer did not come; a closed connection (below) says its process ended.
        return [undetermined("a collective", sorted(waits), silent, {}, waits)]
    stopped = {str(e.rank): f"stopped by {e.fields.get('signal', 'the launcher')} ({e.where})"
               for e in events if e.sig == "elastic_block" and e.rank in silent}
    evidence: dict[str, Any] = {"waiting": victims_evidence(waits)}
    if stopped:
        evidence["then"] = stopped
    if silent:
        root = agent_root_cause(events)
        if root is not None and root in waits:
            evidence["torchrun_root_cause"] = (f"torchrun's 'Root Cause (first observed failure)' names rank {root}, "
                                               "which only timed out waiting: it exited first, it did not fail first")
        if closed and not stopped:
            # A hung peer makes its partners time out; a closed connection means its process ended.
            return [finding(
                "RUN002", PROBE,
                title=(f"{where_text(silent, hosts)} ended without an error in the log: rank {rank_ranges(waits)} "
                       f"lost {'its' if len(waits) == 1 else 'their'} connection to it"),
                ranks=tuple(silent), nodes=nodes_of(silent, hosts), evidence=evidence,
                why=("The other ranks' connections to these ranks were closed, not timed out, so their processes "
                     "ended; they printed no error (an exit() in the code, a kill, or their output is in another "
                     "file). A rank that hosts the store (rank 0 without torchrun) takes the rendezvous with it."),
                fix=("Find the exit code and last output of the named ranks (their own log file, `dmesg` for the OOM "
                     "killer on their host); give every rank's output to `ddpdoctor explain`."),
            )]
        return [finding(
            "RUN004", PROBE,
            title=(f"{where_text(silent, hosts)} hung outside any collective: rank {rank_ranges(waits)} timed out "
                   f"waiting for {'it' if len(silent) == 1 else 'them'}"),
            ranks=tuple(silent), nodes=nodes_of(silent, hosts), evidence=evidence,
        )]
    return [finding(
        "RUN008", PROBE,
        title=f"Every rank ({rank_ranges(waits)}) failed waiting for a peer, and none failed on its own",
        ranks=tuple(sorted(waits)), nodes=nodes_of(waits, hosts), evidence=evidence,
        why=("Each rank timed out or lost its connection while waiting: the transport between them is broken "
             "(network interface, firewall), or a rank not in this log (another node's file) is the cause."),
        fix=("Give `ddpdoctor explain` every node's log; check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and "
             "firewalls between nodes."),
    )]
