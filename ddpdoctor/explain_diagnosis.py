"""Judging a failed job from its events: the first cause, the ranks it dragged down.

The rule is the live check's (run_diagnosis.py): a rank that failed while waiting for a
peer (a timeout, a closed connection) is a victim whenever some rank failed on its own;
when every failure is a wait, the ranks that never complained are the suspects (stuck
elsewhere), and only when every rank waited in the same collective is it the transport.
torchrun's own "Root Cause (first observed failure)" names whichever rank exited first,
which after a hang is a victim; this diagnosis says so when it disagrees.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ddpdoctor.findings import Finding, Severity, rank_ranges
from ddpdoctor.flight_recorder import Agreement, Mismatch
from ddpdoctor.grouping import group_ranks, minority
from ddpdoctor.log_scan import Event
from ddpdoctor.log_signatures import CAUSE, WAIT
from ddpdoctor.explain_texts import CAUSES, EXIT_CRASH, SIGNAL_CRASH, CauseText

PROBE = "explain"
_WAIT_WORDS = re.compile(r"[Tt]imed out|timeout|[Aa]borted|closed by peer|reset by peer|Broken pipe|"
                         r"Socket Timeout|communicator was aborted|remote process exited")
_FP_FIELD = re.compile(r"(SequenceNumber|OpType|TensorShape|TensorDtypes)=(\[[^\]]*\]|[^,)]+)")
# Printed by C++ code right before std::terminate aborts the process, without a launcher prefix.
_ABORT_MESSAGES = ("gloo_size_mismatch", "cuda_fatal")
_SRUN_KILLS = ("Killed", "Out Of Memory", "Segmentation fault", "Aborted", "Bus error")
_SELF_INFLICTED = ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")


@dataclass
class RankStory:
    rank: int
    host: Optional[str]
    first: Optional[Event]
    more: int  # failures after the first (collapsed repeats counted)


@dataclass
class Explanation:
    findings: list[Finding]
    ranks: list[RankStory]
    timeline: list[Event]
    world_size: Optional[int]
    hosts: dict[int, str] = field(default_factory=dict)


def _key(e: Event) -> tuple[float, int]:
    return (e.t if e.t is not None else float("-inf"), e.order)


def _is_failure(e: Event) -> bool:
    if e.sig == "slurm_cancelled" and "TASK FAILURE" in str(e.fields.get("why", "")):
        return False  # srun cancels the step because a task failed: that task is the cause
    if e.sig == "srun_task":
        return str(e.fields.get("what")) in _SRUN_KILLS
    return e.role in (CAUSE, WAIT) or (e.sig == "elastic_block" and _self_inflicted(e))


def _is_wait(e: Event) -> bool:
    if e.role == WAIT:
        return True
    return e.sig == "python_exception" and bool(_WAIT_WORDS.search(str(e.fields.get("msg", ""))))


def _self_inflicted(e: Event) -> bool:
    """An agent block for a rank killed by a signal the agent did not send (SIGTERM is the agent's)."""
    return e.fields.get("signal") in _SELF_INFLICTED or str(e.fields.get("exitcode")) == "-9"


def attribute(events: list[Event], world_size: Optional[int] = None) -> tuple[dict[int, str], Optional[int]]:
    """Fill in ranks and hosts that other lines reveal; returns rank -> host and the world size."""
    by_pid: dict[int, int] = {}
    hosts: dict[int, str] = {}
    local_to_rank: dict[tuple[Optional[str], int], int] = {}
    sizes: list[int] = []
    for e in events:
        if e.sig == "elastic_block":
            if isinstance(e.fields.get("pid"), int):
                by_pid[e.fields["pid"]] = e.rank  # type: ignore[assignment]
            if e.host and e.host != "<N/A>":
                hosts.setdefault(e.rank, e.host)  # type: ignore[arg-type]
            if e.local_rank is not None and e.rank is not None:
                local_to_rank[(e.host, e.local_rank)] = e.rank
        elif e.sig == "srun_task":
            for r in _task_list(str(e.fields.get("tasks", ""))):
                hosts.setdefault(r, str(e.fields["host"]))
        elif e.sig == "nccl_comm_init":
            sizes.append(int(e.fields["nranks"]))
        elif e.sig == "elastic_world":
            sizes += [int(s) for s in str(e.fields["sizes"]).replace(" ", "").split(",") if s]
        elif e.sig == "clients_joined":
            sizes.append(int(e.fields["expected"]))
        if e.rank is not None and e.host and e.sig != "srun_task":
            hosts.setdefault(e.rank, e.host)
    # srun --label torchrun: NCCL lines tie a task to its host, torchrun's lines a rank to its task.
    task_host = {e.task: e.host for e in events if e.task is not None and e.host}
    for e in events:
        if e.rank is not None and e.task in task_host:
            hosts.setdefault(e.rank, task_host[e.task])  # type: ignore[arg-type]
    single_host = len(set(hosts.values())) <= 1
    aborted = {e.rank for e in events if e.sig == "elastic_block" and e.fields.get("signal") == "SIGABRT"}
    failed_alone = {e.rank for e in events if e.sig == "elastic_block"
                    and e.fields.get("signal") not in ("SIGTERM", None) or (e.sig == "elastic_block" and
                    e.fields.get("signal") is None and str(e.fields.get("exitcode")) not in ("0", "-15", "143"))}
    oom_tasks = [(r, str(e.fields["host"])) for e in events if e.sig == "srun_task"
                 and e.fields.get("what") == "Out Of Memory" for r in _task_list(str(e.fields.get("tasks", "")))]
    for e in events:
        if e.rank is None and e.sig == "slurm_oom" and oom_tasks:
            e.rank, e.host = oom_tasks[0]  # srun says which task the cgroup killed
        if e.rank is None and e.sig in _ABORT_MESSAGES and len(aborted) == 1:
            e.rank = next(iter(aborted))  # C++ terminate prints unprefixed, then aborts its own rank
        elif e.rank is None and e.role == CAUSE and len(failed_alone) == 1 and e.task is None:
            # No prefix (torchrun without --tee, a worker process's own stderr), and the agent says
            # only one rank failed by itself: the error is that rank's.
            e.rank = next(iter(failed_alone))
        if e.rank is None and "pid" in e.fields:
            pid = int(e.fields["pid"])
            if pid in by_pid:
                e.rank = by_pid[pid]
        if e.rank is None and e.local_rank is not None and single_host:
            e.rank = next((r for (h, lr), r in local_to_rank.items() if lr == e.local_rank), None)
        if e.rank is None and e.sig == "elastic_failed" and single_host:
            e.rank = next((r for (h, lr), r in local_to_rank.items() if lr == int(e.fields["local_rank"])), None)
        if e.rank is not None and e.host is None and e.rank in hosts:
            e.host = hosts[e.rank]
    seen = [e.rank for e in events if e.rank is not None]
    if single_host:
        # The agent stops every worker by pid; a pid that is no known rank's is a rank that printed nothing.
        workers = set(by_pid) | {int(e.fields["pid"]) for e in events if e.sig in ("elastic_sigterm", "elastic_failed")}
        sizes.append(len(workers))
    if world_size is None:
        candidates = sizes + ([max(seen) + 1] if seen else [])
        world_size = max(candidates) if candidates else None
    names = set(hosts.values())
    if single_host and len(names) == 1 and by_pid and world_size:
        # One agent's log: every one of its workers ran on its host, the silent ones too.
        for r in range(world_size):
            hosts.setdefault(r, next(iter(names)))
    return hosts, world_size


def _task_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if "-" in part:
            lo, _, hi = part.partition("-")
            if lo.isdigit() and hi.isdigit() and int(hi) - int(lo) < 100000:
                out += range(int(lo), int(hi) + 1)
        elif part.isdigit():
            out.append(int(part))
    return out


def rank_stories(events: list[Event], world_size: Optional[int], hosts: dict[int, str]) -> list[RankStory]:
    ranks = sorted({e.rank for e in events if e.rank is not None} | set(range(world_size or 0)))
    stories = []
    for r in ranks:
        failures = sorted((e for e in events if e.rank == r and _is_failure(e)), key=_key)
        first = failures[0] if failures else None
        more = sum(e.count for e in failures) - 1 if failures else 0
        stories.append(RankStory(r, hosts.get(r), first, more))
    return stories


def _where(ranks: Iterable[int], hosts: dict[int, str], unattributed: bool = False) -> str:
    ranks = sorted(set(ranks))
    if not ranks:
        return "a rank" if unattributed else "the job"
    nodes = sorted({hosts[r] for r in ranks if r in hosts})
    text = f"rank {rank_ranges(ranks)}"
    return text + (f" ({', '.join(nodes)})" if nodes else "")


def _nodes(ranks: Iterable[int], hosts: dict[int, str], events: Iterable[Event] = ()) -> tuple[str, ...]:
    found = {hosts[r] for r in ranks if r in hosts} | {e.host for e in events if e.host}
    return tuple(sorted(h for h in found if h and h != "<N/A>"))


def _cite(e: Event) -> str:
    more = f" (x{e.count}, last at {e.last_where})" if e.count > 1 else ""
    return f"{e.where}: {e.text[:240]}{more}"


def _fill(template: str, **values: Any) -> str:
    class _Missing(dict):
        def __missing__(self, key: str) -> str:
            return "?"

    return template.format_map(_Missing(values))


def _victims(waits: dict[int, Event], exclude: Iterable[int] = ()) -> dict[str, str]:
    skip = set(exclude)
    return {str(r): f"{e.label} ({e.where})" for r, e in sorted(waits.items()) if r not in skip}


def diagnose(events: list[Event], world_size: Optional[int] = None,
             mismatches: Iterable[Mismatch] = (), agreements: Iterable[Agreement] = (),
             dump_ranks: Iterable[int] = ()) -> Explanation:
    hosts, world = attribute(events, world_size)
    dumped = list(dump_ranks)
    if world_size is None and dumped and max(dumped) + 1 > (world or 0):
        world = max(dumped) + 1
    stories = rank_stories(events, world, hosts)
    timeline = sorted((e for e in events if e.role != "context" or _is_failure(e)), key=_key)
    findings: list[Finding] = []

    waits = {s.rank: s.first for s in stories if s.first is not None and _is_wait(s.first)}
    mismatch_detectors = {e.rank for e in events if e.sig == "gloo_size_mismatch"}
    causes_by_rank: dict[int, list[Event]] = {}
    unattributed: list[Event] = []
    for e in sorted(events, key=_key):
        if _is_failure(e) and not _is_wait(e) and e.sig not in ("detail_mismatch", "gloo_size_mismatch"):
            if e.sig == "python_exception" and e.rank in waits and _key(e) > _key(waits[e.rank]):
                continue  # the exception its own wait raised, further up the stack
            if e.sig == "elastic_block" and e.rank in mismatch_detectors:
                continue  # gloo aborted the rank that noticed the mismatch: RUN009 explains it
            if e.sig in ("elastic_block", "srun_task") and e.rank in waits:
                continue  # NCCL's watchdog aborts (SIGABRT) the rank that timed out: its end, not a cause
            if e.rank is None:
                unattributed.append(e)
            else:
                causes_by_rank.setdefault(e.rank, []).append(e)

    findings += _detail_desync(events, hosts)
    findings += _gloo_size_mismatch(events, hosts)
    findings += _watchdog(events, hosts, waits, causes_by_rank, world)
    findings += _flight_recorder(list(mismatches), list(agreements), hosts)
    findings += _causes(causes_by_rank, unattributed, waits, hosts, events)
    if not findings:
        findings += _silent_suspects(stories, waits, hosts, events)
    if not findings:
        findings.append(_nothing_known(events))
    return Explanation(findings, stories, timeline, world, hosts)


def _fingerprint(text: str) -> dict[str, str]:
    return {k: v.strip() for k, v in _FP_FIELD.findall(text)}


def _detail_desync(events: list[Event], hosts: dict[int, str]) -> list[Finding]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL compared every collective: name the ranks apart from the majority."""
    prints: dict[int, dict[str, str]] = {}
    cites = []
    for e in events:
        if e.sig != "detail_mismatch":
            continue
        cites.append(_cite(e))
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
    return [Finding(
        code="RUN009", severity=Severity.CRITICAL, probe=PROBE,
        title=f"Collective mismatch (desync): {desc}",
        ranks=tuple(culprits), nodes=_nodes(culprits, hosts),
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


def _gloo_size_mismatch(events: list[Event], hosts: dict[int, str]) -> list[Finding]:
    """gloo noticed a message of the wrong size: a mismatch, but the message cannot say whose."""
    seen = [e for e in events if e.sig == "gloo_size_mismatch"]
    if not seen:
        return []
    first = sorted(seen, key=_key)[0]
    detector = sorted({e.rank for e in seen if e.rank is not None})
    ranks = sorted({e.rank for e in events if e.rank is not None})
    by = f" on {_where(detector, hosts)}" if detector else ""
    return [Finding(
        code="RUN009", severity=Severity.CRITICAL, probe=PROBE,
        title=(f"Collective mismatch (desync) detected by gloo{by}: it received {first.fields.get('got')} bytes "
               f"where its collective expected {first.fields.get('expected')}"),
        ranks=tuple(ranks), nodes=_nodes(ranks, hosts),
        evidence={"log": [_cite(e) for e in seen[:4]], "detected_by": rank_ranges(detector) or "unknown"},
        why=("Ranks ran collectives of different sizes (or different collectives) at the same point, so a rank "
             "received a message of the wrong size and gloo aborted it. The rank that noticed is not necessarily "
             "the one that is different, and this message cannot say which one is."),
        fix=("Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (it names the rank and the shapes) or with "
             "TORCH_FR_BUFFER_SIZE=2000 and give the Flight Recorder dumps to `ddpdoctor explain`; look for "
             "rank-dependent tensor sizes (uneven last batch, rank-0-only metrics) before the collective."),
    )]


def _watchdog(events: list[Event], hosts: dict[int, str], waits: dict[int, Event],
              causes: dict[int, list[Event]], world: Optional[int]) -> list[Finding]:
    """NCCL's watchdog says which collective (op, sequence number) each rank timed out in."""
    calls: dict[int, tuple[str, int]] = {}
    cites: dict[int, Event] = {}
    progress: dict[int, dict[str, Any]] = {}
    for e in sorted(events, key=_key):
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
        return [Finding(
            code="RUN009", severity=Severity.CRITICAL, probe=PROBE,
            title=f"Collective mismatch (desync): {desc}",
            ranks=tuple(culprits), nodes=_nodes(culprits, hosts), evidence=evidence,
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
    silent = sorted(known - set(calls))
    suspects = silent or behind
    if suspects:
        return [Finding(
            code="RUN004", severity=Severity.CRITICAL, probe=PROBE,
            title=f"{_where(suspects, hosts)} never entered {op_seq}: rank {rank_ranges(ranks)} timed out waiting "
                  f"for {'it' if len(suspects) == 1 else 'them'}",
            ranks=tuple(suspects), nodes=_nodes(suspects, hosts),
            evidence={**evidence, "silent_ranks": rank_ranges(silent) or "none",
                      "ranks_behind": rank_ranges(behind) or "none"},
            why=("Every rank that reported timed out in the same collective, and these ranks did not: they were "
                 "still busy elsewhere (data loading, a rank-only branch, I/O, a slow or hung GPU) and never "
                 "issued it."),
            fix=("Find out where the named ranks were: `py-spy dump --pid PID` on a live hang, or the Flight "
                 "Recorder dump (TORCH_NCCL_DUMP_ON_TIMEOUT=1 with TORCH_NCCL_TRACE_BUFFER_SIZE) for their last "
                 "collective and its Python stack."),
        )]
    return [Finding(
        code="RUN008", severity=Severity.CRITICAL, probe=PROBE,
        title=f"All ranks timed out inside {op_seq}: the collective itself did not complete",
        ranks=tuple(sorted(ranks)), nodes=_nodes(ranks, hosts), evidence=evidence,
        why=("Every rank entered the same collective and none finished it: the transport between ranks is broken "
             "or blocked (network interface, firewall, InfiniBand, peer-to-peer between GPUs), or a GPU hung."),
        fix=("Rerun with NCCL_DEBUG=INFO and check the interface in `NET/Socket : Using` on every node "
             "(NCCL_SOCKET_IFNAME), firewalls between nodes, and `nvidia-smi` / `dmesg | grep -i xid` on each node; "
             "`ddpdoctor allreduce-bench` localises a slow or broken link."),
    )]


def _flight_recorder(mismatches: list[Mismatch], agreements: list[Agreement],
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
            findings.append(Finding(
                code="RUN004", severity=Severity.CRITICAL, probe=PROBE,
                title=(f"{_where(m.missing, hosts)} never issued collective #{m.seq} ({op}){group}: "
                       f"rank {rank_ranges(waiting)} did"),
                ranks=tuple(m.missing), nodes=_nodes(m.missing, hosts), evidence=evidence,
                why=("The Flight Recorder dumps show the other ranks entered this collective and these ranks never "
                     "recorded it: they stopped issuing collectives (stuck in their own code, or exited) while "
                     "their peers waited."),
                fix=("Look at what the named ranks did after their last recorded collective: their Python stack "
                     "(`py-spy dump`), a rank-dependent branch, data loading, or an early exit from the loop "
                     "(uneven batches per rank: use DistributedSampler(drop_last=True) or the Join context)."),
            ))
            continue
        calls = {r: c.signature() for r, c in present.items()}
        groups = group_ranks(calls)
        odd = minority(groups) or sorted(calls)
        desc = "; ".join(f"rank {rank_ranges(rs)} {'is' if len(rs) == 1 else 'are'} in {c}" for c, rs in groups)
        findings.append(Finding(
            code="RUN009", severity=Severity.CRITICAL, probe=PROBE,
            title=f"Collective mismatch at #{m.seq}{group} (Flight Recorder): {desc}",
            ranks=tuple(odd), nodes=_nodes(odd, hosts), evidence=evidence,
            why=("The ranks' Flight Recorder dumps disagree on the collective with this sequence number (op, "
                 "shapes or dtypes): the rank(s) apart from the majority took another code path."),
            fix=("Make every rank issue the same collectives with the same shapes and dtypes in the same order; the "
                 "dump's `frames` of the named ranks show the Python line that issued theirs."),
        ))
    for a in agreements:
        findings.append(Finding(
            code="LOG011", severity=Severity.INFO, probe=PROBE,
            title=(f"Flight Recorder: rank {rank_ranges(a.ranks)} agree on every collective #{a.first_seq}-#{a.last_seq}"
                   + ("" if a.group in ("0", "") else f" of process group {a.group}")),
            ranks=a.ranks, evidence={"first_seq": a.first_seq, "last_seq": a.last_seq},
            why="Every dumped rank recorded the same collectives with the same shapes and dtypes: no desync.",
        ))
    return findings


def _cause_text(e: Event) -> CauseText:
    if e.sig == "elastic_block":
        return SIGNAL_CRASH
    if e.sig == "srun_task":
        what = str(e.fields.get("what", ""))
        return EXIT_CRASH if what.startswith("Exited") else SIGNAL_CRASH
    return CAUSES[e.sig]


def _causes(causes: dict[int, list[Event]], unattributed: list[Event], waits: dict[int, Event],
            hosts: dict[int, str], events: list[Event]) -> list[Finding]:
    """One finding per kind of first cause, the ranks that share it together, earliest first."""
    firsts: list[Event] = []
    for rank, evs in causes.items():
        # The rank's own error beats the launcher's summary of it; a known error beats the generic
        # exception line that carries it (`DistBackendError: NCCL error ... invalid usage` then
        # `Duplicate GPU detected`).
        own = [e for e in evs if e.sig not in ("srun_task", "elastic_block")]
        known = [e for e in own if e.sig != "python_exception"]
        firsts.append(known[0] if known else own[0] if own else evs[0])
    seen = {e.sig for e in firsts}
    firsts += [e for e in unattributed if e.sig not in seen and e.sig not in ("srun_task", "elastic_block")]
    if not firsts:
        return []
    groups: dict[tuple[str, str], list[Event]] = {}
    for e in sorted(firsts, key=_key):
        text = _cause_text(e)
        detail = str(e.fields.get("type", "")) if e.sig == "python_exception" else ""
        groups.setdefault((text.code + e.sig, detail), []).append(e)
    root = _agent_root_cause(events)
    findings = []
    cause_ranks = {e.rank for e in firsts if e.rank is not None}
    for index, group in enumerate(groups.values()):
        first = group[0]
        text = _cause_text(first)
        ranks = sorted({e.rank for e in group if e.rank is not None}
                       | {int(e.fields[k]) for e in group for k in ("rank_a", "rank_b") if k in e.fields
                          and e.sig == "duplicate_gpu"})
        where = _where(ranks, hosts, unattributed=not ranks)
        fields = {k: v for k, v in first.fields.items() if isinstance(v, (str, int))}
        fields.setdefault("signal", _signal_of(first))
        evidence: dict[str, Any] = {"first_error": {str(e.rank if e.rank is not None else "?"): _cite(e) for e in group}}
        if first.sig == "clients_joined":
            ranks, title_extra = _never_joined(first, events)
            evidence["ranks_seen_in_log"] = rank_ranges({e.rank for e in events if e.rank is not None}) or "none"
        else:
            title_extra = ""
        if first.sig == "nccl_ib_error":
            pairs = _failing_pairs(group, events)
            if pairs:
                evidence["failing_pairs"] = sorted(f"{a} <-> {b}" for a, b in pairs)
            culprit = _common_end(pairs)
            if culprit:
                node, said = culprit
                ranks = sorted(r for r, h in hosts.items() if h == node)
                group = [e for e in group if e.host == node] or group[:0]
                where = _where(ranks, hosts) if ranks else node
                title_extra = f": every failing pair has {said} at one end"
        on = f" on {where}" if ranks else ""
        title = _fill(text.title, where=where, on=on, text=first.text[:160], **fields)
        title = title[0].upper() + title[1:] + title_extra
        exits = _exit_info(ranks, events)
        if exits:
            evidence["exit"] = exits
        if text.code == "LOG003":
            unused = {str(e.rank): str(e.fields.get("names", ""))[:200] for e in events if e.sig == "ddp_unused_names"}
            if unused:
                evidence["parameters_without_grad"] = unused
        if text.code == "LOG006":
            attempts = sorted({f"{e.fields.get('err')} (errno {e.fields.get('errno')})" for e in events
                               if e.sig == "connect_failed"})
            if attempts:
                evidence["connect_attempts"] = attempts
        share = _share(len(ranks), events) if ranks else ""
        if share:
            evidence["ranks_with_this_error"] = share
        if index == 0:
            evidence["affected_ranks"] = _victims(waits, exclude=cause_ranks)
            if root is not None and root not in cause_ranks and root in waits:
                evidence["torchrun_root_cause"] = (f"torchrun's 'Root Cause (first observed failure)' names rank {root}, "
                                                   "which only waited for a peer: it exited first, it did not fail first")
        findings.append(Finding(
            code=text.code, severity=text.severity, probe=PROBE, title=title, ranks=tuple(ranks),
            nodes=_nodes(ranks, hosts, () if first.sig == "clients_joined" else group), evidence=evidence,
            why=text.why, fix=text.fix))
    return findings


_IP = re.compile(r"(?P<ip>\d{1,3}(?:\.\d{1,3}){3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+)")


def _failing_pairs(group: list[Event], events: list[Event]) -> set[tuple[str, str]]:
    """(reporting host, peer) for each transport error; a peer's address becomes its host where
    NCCL's INFO lines (`NET/Socket : Using [0]ib0:10.0.0.12<0>`) said whose it is."""
    owner: dict[str, str] = {}
    for e in events:
        if e.sig == "nccl_interface" and e.host:
            for m in _IP.finditer(str(e.fields.get("ifaces", ""))):
                owner.setdefault(m.group("ip"), e.host)
    pairs = set()
    for e in group:
        peer = str(e.fields.get("peer") or "").split("<", 1)[0]
        if e.host and peer:
            pairs.add((e.host, owner.get(peer, peer)))
    return pairs


def _common_end(pairs: set[tuple[str, str]]) -> Optional[tuple[str, str]]:
    """The one host at an end of every failing pair (its address standing in where its name is unknown)."""
    hosts = {a for a, _ in pairs}
    found = []
    for h in hosts:
        others = {b for a, b in pairs if a != h and b != h}
        if len(others) == 1 and not any(a == b for a, b in pairs):
            found.append((h, next(iter(others))))
        elif not others and len(pairs) > 1:
            found.append((h, h))
    if len(found) == 1:
        h, address = found[0]
        return h, (h if address == h else f"{h} (presumably {address})")
    return None


def _never_joined(e: Event, events: list[Event]) -> tuple[list[int], str]:
    """Which ranks are missing: those of the expected ones that printed nothing, when the counts agree."""
    expected, joined = int(e.fields["expected"]), int(e.fields["joined"])
    tried = [x for x in events if x.sig in ("connect_failed", "connect_timeout") and x.rank is not None]
    unreachable = sorted({x.rank for x in tried})  # type: ignore[type-var]
    if unreachable and len(unreachable) == expected - joined:
        how = tried[0].fields
        reason = f" ({how['err']})" if how.get("err") else ""
        return unreachable, (f": rank {rank_ranges(unreachable)} could not connect to "
                             f"{how.get('addr')}:{how.get('port')}{reason}")
    seen = {x.rank for x in events if x.rank is not None}
    absent = sorted(set(range(expected)) - seen)
    if absent and len(absent) == expected - joined:
        return absent, f": rank {rank_ranges(absent)} never arrived (no line of theirs in the log)"
    return [], ""


def _share(count: int, events: list[Event]) -> str:
    ranks = {e.rank for e in events if e.rank is not None}
    return f"{count} of {len(ranks)} ranks seen in the log" if len(ranks) > count else ""


def _signal_of(e: Event) -> str:
    if e.fields.get("signal"):
        return str(e.fields["signal"])
    if e.sig == "srun_task":
        return str(e.fields.get("what", "?"))
    return "?"


def _exit_info(ranks: list[int], events: list[Event]) -> dict[str, str]:
    out = {}
    for e in events:
        if e.rank in ranks and e.sig == "elastic_block":
            sig = f" ({e.fields['signal']})" if e.fields.get("signal") else ""
            out[str(e.rank)] = f"exit code {e.fields.get('exitcode')}{sig} on {e.host or '?'} ({e.where})"
        elif e.sig == "srun_task" and set(_task_list(str(e.fields.get("tasks", "")))) & set(ranks):
            out.setdefault(f"tasks {e.fields.get('tasks')}", f"{e.fields.get('what')} on {e.fields.get('host')} ({e.where})")
    return out


def _agent_root_cause(events: list[Event]) -> Optional[int]:
    for e in events:
        if e.sig == "elastic_block" and e.fields.get("root_cause"):
            return e.rank
    return None


def _silent_suspects(stories: list[RankStory], waits: dict[int, Event], hosts: dict[int, str],
                     events: list[Event]) -> list[Finding]:
    """Only waits: the ranks that did not complain are where the job was stuck."""
    if not waits:
        return []
    silent = sorted(s.rank for s in stories if s.rank not in waits)
    stopped = {str(e.rank): f"stopped by {e.fields.get('signal', 'the launcher')} ({e.where})"
               for e in events if e.sig == "elastic_block" and e.rank in silent}
    evidence: dict[str, Any] = {"waiting": _victims(waits)}
    if stopped:
        evidence["then"] = stopped
    if silent:
        root = _agent_root_cause(events)
        if root is not None and root in waits:
            evidence["torchrun_root_cause"] = (f"torchrun's 'Root Cause (first observed failure)' names rank {root}, "
                                               "which only timed out waiting: it exited first, it did not fail first")
        return [Finding(
            code="RUN004", severity=Severity.CRITICAL, probe=PROBE,
            title=(f"{_where(silent, hosts)} hung outside any collective: rank {rank_ranges(waits)} timed out "
                   f"waiting for {'it' if len(silent) == 1 else 'them'}"),
            ranks=tuple(silent), nodes=_nodes(silent, hosts), evidence=evidence,
            why=("The other ranks failed waiting for a peer, and these ranks printed no error of their own before "
                 "they were stopped: they were stuck in their own code (data loading, a rank-only branch, I/O, "
                 "a lock) and never joined the collective."),
            fix=("Find where the named ranks were: `py-spy dump --pid PID` while it hangs, or run `ddpdoctor check` "
                 "(stage deadlines with Python stacks); look for rank-dependent work before the collective."),
        )]
    return [Finding(
        code="RUN008", severity=Severity.CRITICAL, probe=PROBE,
        title=f"Every rank ({rank_ranges(waits)}) failed waiting for a peer, and none failed on its own",
        ranks=tuple(sorted(waits)), nodes=_nodes(waits, hosts), evidence=evidence,
        why=("Each rank timed out or lost its connection while waiting: the transport between them is broken "
             "(network interface, firewall), or a rank not in this log (another node's file) is the cause."),
        fix=("Give `ddpdoctor explain` every node's log; check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and "
             "firewalls between nodes."),
    )]


def _nothing_known(events: list[Event]) -> Finding:
    return Finding(
        code="LOG000", severity=Severity.INFO, probe=PROBE,
        title="No known failure signature in these logs",
        evidence={"context_lines_recognised": len(events)},
        why=("None of the error messages of torch.distributed, NCCL, gloo, the elastic agent, Slurm, CUDA or the "
             "DataLoader that ddpdoctor knows appears here: the job may have hung silently, or its errors went to "
             "another file."),
        fix=("Run `ddpdoctor check` with the same launcher and ranks to test the setup; rerun the job with "
             "NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL and TORCH_NCCL_TRACE_BUFFER_SIZE=2000 "
             "(with TORCH_NCCL_DUMP_ON_TIMEOUT=1) so the next failure leaves what `ddpdoctor explain` reads; "
             "give it every rank's output (torchrun --log-dir, srun --output=%t.log)."),
    )
