"""A rank's own failure from its log lines: one finding per kind of first cause, the ranks
that share it together, and the ranks it dragged down listed under the earliest one.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ddpdoctor.explain.events import (
    agent_root_cause, cite, fill, nodes_of, order_key, task_list, victims_evidence, where_text)
from ddpdoctor.explain.launchers import EXIT_RECORDS, exit_signal
from ddpdoctor.explain.texts import CAUSES, EXIT_CRASH, SIGNAL_CAUSES, SIGNAL_CRASH, CauseText
from ddpdoctor.core import cuda_version
from ddpdoctor.core.findings import Finding, rank_ranges
from ddpdoctor.explain.scan import Event

PROBE = "explain"
# Generic errors that carry a specific one printed with them (NCCL's `Last error:` under ncclSystemError,
# the WARN under torch's `unhandled cuda error`).
CARRIERS = ("python_exception", "nccl_system_error", "nccl_unhandled_cuda")
# The specific NCCL and CUDA causes a generic NCCL error is explained by.
_SPECIFIC = ("cuda_oom", "cuda_fatal", "cuda_runtime_error", "invalid_device_ordinal", "driver_too_old",
             "driver_mismatch", "ptx_toolchain", "no_gpu", "duplicate_gpu", "same_gpu_partition")
# Causes that are only a symptom when anything else failed: NCCL's socket to a peer that died first.
WEAK = ("nccl_socket_failed",)
# Timeouts whose message names the rank that never came: the finding names that rank, not the one that waited.
KEY_OWNERS = ("ncclid_timeout", "store_key_rank_timeout")
# The rank counts of a store that waited for every rank: the ranks missing are named when the log tells.
JOIN_COUNTS = ("clients_joined", "store_barrier_timeout")
_NCCL_WRAPPER = re.compile(r"NCCL error|NCCL Error|^nccl\w+Error$|DistBackendError")
# Causes that are the node's environment, not a rank's: every rank there fails alike; the node is named.
NODE_LEVEL = ("nccl_shm_error",)


def _cause_text(e: Event) -> CauseText:
    if e.sig in EXIT_RECORDS:
        signal = _signal_of(e)
        if signal in SIGNAL_CAUSES:
            return SIGNAL_CAUSES[signal]
        return SIGNAL_CRASH if signal != "?" else EXIT_CRASH
    return CAUSES[e.sig]


def _first_own(evs: list[Event]) -> Event:
    """A rank's first cause: its own error beats the launcher's summary of it, and a known error
    the generic exception line that carries it (`DistBackendError: NCCL error ... invalid usage`
    then `Duplicate GPU detected`); among summaries, the one that says the most (torchrun's block)."""
    own = [e for e in evs if e.sig not in EXIT_RECORDS]
    known = [e for e in own if e.sig not in CARRIERS and e.sig not in WEAK] \
        or [e for e in own if e.sig not in CARRIERS] or [e for e in own if e.sig != "python_exception"]
    if known or own:
        return known[0] if known else own[0]
    return _best_exit(evs)


def _best_exit(evs: list[Event]) -> Event:
    with_signal = [e for e in evs if _signal_of(e) != "?"]
    blocks = [e for e in with_signal or evs if e.sig == "elastic_block"]
    return (blocks or with_signal or evs)[0]


def cause_findings(causes: dict[int, list[Event]], unattributed: list[Event], waits: dict[int, Event],
            hosts: dict[int, str], events: list[Event], world: Optional[int] = None) -> list[Finding]:
    """One finding per kind of first cause, the ranks that share it together, earliest first."""
    firsts = [_first_own(evs) for evs in causes.values()]
    seen = {e.sig for e in firsts}
    firsts += [e for e in unattributed if e.sig not in seen and e.sig not in EXIT_RECORDS]
    firsts = _drop_explained(firsts, causes)
    if not firsts and unattributed:
        # Only launchers' summaries that name no rank (the DeepSpeed launcher, pdsh, subprocess):
        # the worker's end is still the cause, on whichever rank or node it was.
        firsts = [_best_exit(unattributed)]
    if not firsts:
        return []
    groups: dict[tuple[str, str], list[Event]] = {}
    for e in sorted(firsts, key=order_key):
        text = _cause_text(e)
        detail = str(e.fields.get("type", "")) if e.sig == "python_exception" else ""
        groups.setdefault((text.code + e.sig, detail), []).append(e)
    root = agent_root_cause(events)
    findings = []
    cause_ranks = {e.rank for e in firsts if e.rank is not None}
    for index, group in enumerate(groups.values()):
        first = group[0]
        text = _cause_text(first)
        ranks = sorted({e.rank for e in group if e.rank is not None}
                       | {int(r) for e in group for k in ("task_ranks", "exit_ranks") for r in e.fields.get(k, ())}
                       | {int(e.fields[k]) for e in group for k in ("rank_a", "rank_b") if k in e.fields
                          and e.sig == "duplicate_gpu"})
        where = where_text(ranks, hosts, unattributed=not ranks, events=group)
        fields = {k: v for k, v in first.fields.items() if isinstance(v, (str, int))}
        fields.setdefault("signal", _signal_of(first))
        if first.sig == "srun_task" and "code" in fields:
            fields.setdefault("exitcode", fields["code"])  # srun says `Exited with exit code N`
        evidence: dict[str, Any] = {"first_error": {str(e.rank if e.rank is not None else "?"): cite(e) for e in group}}
        if first.sig in JOIN_COUNTS:
            ranks, title_extra = _never_joined(first, events)
            evidence["ranks_seen_in_log"] = rank_ranges({e.rank for e in events if e.rank is not None}) or "none"
        elif first.sig in KEY_OWNERS:
            evidence["waiting_ranks"] = where
            ranks, title_extra = sorted({int(e.fields["missing"]) for e in group}), ""
        else:
            title_extra = ""
        if first.sig == "nccl_ib_error":
            pairs = _failing_pairs(group, events)
            if pairs:
                # Each end reports the same link: one line per pair of nodes, not per direction.
                evidence["failing_pairs"] = sorted({" <-> ".join(sorted((a, b))) for a, b in pairs})
            culprit = _common_end(pairs)
            if not culprit:
                # One end of a link reported it: the other end (a peer that died, its port) may be the fault.
                evidence["reported_by"] = sorted({e.host for e in group if e.host})
                title_extra = f", reported by {', '.join(evidence['reported_by'])}" if evidence["reported_by"] else ""
                group = group[:0]
            if culprit:
                node, said = culprit
                ranks = sorted(r for r, h in hosts.items() if h == node)
                group = [e for e in group if e.host == node] or group[:0]
                where = where_text(ranks, hosts) if ranks else node
                title_extra = f": every failing pair has {said} at one end"
        nodes = nodes_of(ranks, hosts, _where_it_hit(first, group, events))
        if len(ranks) > 1 and world and set(ranks) == set(range(world)) and group \
                and all(e.sig in EXIT_RECORDS for e in group):
            # Every rank of the job ended the same way with no error of its own: a common end (a library's
            # abort, the watchdog, a kill of the whole job), not one rank's fault.
            evidence["every_rank_ended_alike"] = where
            ranks, group, nodes, where = [], group[:0], (), f"every rank ({rank_ranges(ranks)})"
        if first.sig in NODE_LEVEL:
            evidence["reported_by"] = where
            ranks, group, where = [], group[:0], ", ".join(nodes) or "the node"
        if text.code == "LOG006":
            # The store's endpoint is at fault, not the rank that could not reach it: it is only the reporter.
            evidence["reported_by"] = where
            ranks, group = [], group[:0]
        on = f" on {where}" if ranks or any(e.host for e in group) or (first.sig in NODE_LEVEL and nodes) else ""
        if first.sig == "launcher_signal":
            fields["signal"] = _signal_words(first)  # "SIGHUP (1)": the log may give only the number
        if first.sig == "driver_too_old":
            # torch's "found version 12080" is the driver's newest CUDA; other wordings do not say it.
            found = cuda_version.driver_cuda(next((e.fields["found"] for e in [first, *group] if e.fields.get("found")),
                                                  None))
            if found:
                fields["driver"] = f"its driver supports up to {cuda_version.words(found)}"
        title = fill(text.title, where=where, on=on, text=first.text[:160], **fields)
        if first.sig == "store_barrier_timeout" and int(fields["joined"]) >= int(fields["expected"]):
            title = (f"init_process_group's store-based barrier counted {fields['joined']} workers for "
                     f"{fields['expected']} ranks: the store holds another run's keys")
        if not (title.startswith(where) and any(e.host == where for e in events)):  # a host keeps its case
            title = title[0].upper() + title[1:]
        title += title_extra
        exits = _exit_info(ranks, events)
        if exits:
            evidence["exit"] = exits
        if text.code == "LOG003":
            unused = {str(e.rank): str(e.fields.get("names", ""))[:200] for e in events if e.sig == "ddp_unused_names"}
            if unused:
                evidence["parameters_without_grad"] = unused
        if text.code == "LOG007":
            evidence.update(_network_hints(events))
        if text.code == "LOG006":
            attempts = sorted({f"{e.fields.get('err')} (errno {e.fields.get('errno')})" for e in events
                               if e.sig == "connect_failed"})
            if attempts:
                evidence["connect_attempts"] = attempts
        share = _share(len(ranks), events) if ranks else ""
        if share:
            evidence["ranks_with_this_error"] = share
        if index == 0:
            evidence["affected_ranks"] = victims_evidence(waits, exclude=cause_ranks)
            if root is not None and root not in cause_ranks and root in waits:
                evidence["torchrun_root_cause"] = (f"torchrun's 'Root Cause (first observed failure)' names rank {root}, "
                                                   "which only waited for a peer: it exited first, it did not fail first")
        findings.append(Finding(
            code=text.code, severity=text.severity, probe=PROBE, title=title, ranks=tuple(ranks),
            nodes=() if text.code == "LOG006" else nodes, evidence=evidence,
            why=text.why, fix=text.fix))
    return findings


def _drop_explained(firsts: list[Event], causes: dict[int, list[Event]]) -> list[Event]:
    """The most specific line wins over a generic one: a generic NCCL error (ncclSystemError, torch's
    `unhandled cuda error`, a `DistBackendError: NCCL error ...` or an exception whose message is on the
    lines below it) is dropped where a specific NCCL or CUDA cause was printed on its rank or by no rank;
    NCCL's lost socket where anything else failed; a wait for a rank's key where that rank has its own error."""
    specific = [e for e in firsts if _is_specific(e)]
    out = [e for e in firsts if not (_is_generic(e) and any(_same_scope(e, x) for x in specific))]
    if any(e.sig not in WEAK for e in out):
        out = [e for e in out if e.sig not in WEAK]
    if any(e.sig in JOIN_COUNTS for e in out):
        # A rank that never joined stalls everyone's keys (rank 0, the store's host, waits for it there).
        return [e for e in out if e.sig not in KEY_OWNERS]
    own = {r for r, evs in causes.items() if any(e.sig not in KEY_OWNERS and e.sig not in EXIT_RECORDS for e in evs)}
    kept = [e for e in out if not (e.sig in KEY_OWNERS and int(e.fields["missing"]) in own)]
    return kept or out


def _is_specific(e: Event) -> bool:
    return e.sig in _SPECIFIC or (e.sig.startswith("nccl_") and e.sig not in CARRIERS and e.sig not in WEAK)


def _is_generic(e: Event) -> bool:
    if e.sig in ("nccl_system_error", "nccl_unhandled_cuda"):
        return True
    if e.sig != "python_exception":
        return False
    kind, msg = str(e.fields.get("type", "")).rsplit(".", 1)[-1], str(e.fields.get("msg") or "").strip()
    return not msg or bool(_NCCL_WRAPPER.search(kind) or _NCCL_WRAPPER.search(msg))


def _same_scope(generic: Event, specific: Event) -> bool:
    """The specific error explains the generic one: printed by the same rank, or one of them by no rank."""
    return generic.rank is None or specific.rank is None or generic.rank == specific.rank


def _where_it_hit(first: Event, group: list[Event], events: list[Event]) -> list[Event]:
    """The lines whose hosts the finding names: a cancelled job is every node srun reports
    (slurmstepd prints the cancel on one of them), a missing rank none of those that came."""
    if first.sig in JOIN_COUNTS or first.sig in KEY_OWNERS:
        return []
    if first.sig == "slurm_cancelled":
        return group + [e for e in events if e.sig == "srun_task"]
    return group


# `OOB eth0:10.20.0.1<0>`, `[0]ens9:192.168.100.11<0>`: the interface's IPv4 address after its name.
_IP = re.compile(r"(?<=:)(?P<ip>\d{1,3}(?:\.\d{1,3}){3})(?=<)")


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
    """The one host at an end of every failing pair, and how to say it.

    With every peer's address resolved to its host, that host is in every pair. Where a
    peer is only an address, the host whose partners' complaints all name one address is
    taken to be that address (each of the others complains about it; it complains about them).
    """
    if len(pairs) < 2:
        return None
    hosts = {a for a, _ in pairs} | {b for _, b in pairs}
    in_every = [h for h in hosts if all(h in pair for pair in pairs)]
    if len(in_every) == 1:
        return in_every[0], in_every[0]
    found = []
    for h in {a for a, _ in pairs}:
        others = {b for a, b in pairs if a != h and b != h}
        if len(others) == 1 and next(iter(others)) not in {a for a, _ in pairs}:
            found.append((h, next(iter(others))))
    if len(found) == 1:
        h, address = found[0]
        return h, f"{h} (presumably {address})"
    return None


def _network_hints(events: list[Event]) -> dict[str, Any]:
    """What NCCL said about its network: the interface each host used, failed connects, the settings."""
    out: dict[str, Any] = {}
    used = {e.host or "?": str(e.fields.get("ifaces", "")) for e in events if e.sig == "nccl_interface"}
    if used:
        out["interfaces_used"] = used
    failed = sorted({f"{e.host or '?'} -> {e.fields.get('addr')}: {e.fields.get('err')}"
                     for e in events if e.sig == "nccl_socket_connect"})
    if failed:
        out["connects_failed"] = failed[:8]
    settings = {f"{e.fields.get('var')} on {e.host or '?'}": str(e.fields.get("value")) for e in events
                if e.sig == "nccl_env_setting"}
    if settings:
        out["settings"] = settings
    return out


def _never_joined(e: Event, events: list[Event]) -> tuple[list[int], str]:
    """Which ranks are missing: those of the expected ones that printed nothing, when the counts agree."""
    expected, joined = int(e.fields["expected"]), int(e.fields["joined"])
    tried = [x for x in events if x.sig in ("connect_failed", "connect_timeout") and x.rank is not None]
    unreachable = sorted({x.rank for x in tried if x.rank is not None})
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
    if e.sig == "launcher_signal":
        return exit_signal({"signal": e.fields.get("signal") or e.fields.get("signame") or e.fields.get("signum")},
                           e.sig) or "?"
    return exit_signal(e.fields, e.sig) or "?"


def _signal_words(e: Event) -> str:
    """A signal by the name users search for, with its number in brackets: torch elastic logs
    "Received 1 death signal" where it means SIGHUP."""
    import signal

    name = _signal_of(e)
    try:
        return f"{name} ({signal.Signals[name].value})"
    except KeyError:
        return name


def _exit_info(ranks: list[int], events: list[Event]) -> dict[str, str]:
    out = {}
    nested = any(e.task is not None for e in events)
    for e in events:
        if e.rank in ranks and e.sig == "elastic_block":
            sig = f" ({e.fields['signal']})" if e.fields.get("signal") else ""
            out[str(e.rank)] = f"exit code {e.fields.get('exitcode')}{sig} on {e.host or '?'} ({e.where})"
        elif e.sig == "srun_task" and e.task is None and not nested and \
                set(task_list(str(e.fields.get("tasks", "")))) & set(ranks):
            out.setdefault(f"tasks {e.fields.get('tasks')}", f"{e.fields.get('what')} on {e.fields.get('host')} ({e.where})")
    return out
