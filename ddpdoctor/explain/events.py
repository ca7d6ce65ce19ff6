"""What each event means for the first-cause rule, and who printed it.

A failure is either a rank's own (a `cause`) or a rank giving up on a peer (a `wait`);
the launcher's summaries (torchrun's failure block, srun's task lines) count only when
they report a kill the rank did not get from its own launcher. Lines that do not say
their rank get one from the lines that do: pids, tasks, hosts, the only failed rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ddpdoctor.core.findings import rank_ranges
from ddpdoctor.explain.launchers import EXIT_RECORDS, JOB_LEVEL, ended_badly
from ddpdoctor.explain.scan import Event
from ddpdoctor.explain.signatures import CAUSE, WAIT

_WAIT_WORDS = re.compile(r"[Tt]imed out|timeout|[Aa]borted|closed by peer|reset by peer|Broken pipe|"
                         r"Socket Timeout|communicator was aborted|remote process exited")
# Printed by C++ code right before std::terminate aborts the process, without a launcher prefix.
_ABORT_MESSAGES = ("gloo_size_mismatch", "cuda_fatal", "nccl_unhandled_cuda")
_SRUN_KILLS = ("Killed", "Out Of Memory", "Segmentation fault", "Aborted", "Bus error")

_SELF_INFLICTED = ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")


@dataclass
class RankStory:
    rank: int
    host: Optional[str]
    first: Optional[Event]
    more: int  # failures after the first (collapsed repeats counted)


def order_key(e: Event) -> tuple[float, int]:
    return (e.t if e.t is not None else float("-inf"), e.order)


def is_failure(e: Event) -> bool:
    if e.sig == "slurm_cancelled" and "TASK FAILURE" in str(e.fields.get("why", "")):
        return False  # srun cancels the step because a task failed: that task is the cause
    if e.sig == "srun_task":  # a kill, or the task's own non-zero exit (like torchrun's exit code)
        what = str(e.fields.get("what"))
        return what in _SRUN_KILLS or (what.startswith("Exited") and str(e.fields.get("code")) != "0")
    if e.sig in EXIT_RECORDS and e.sig != "elastic_block":
        return ended_badly(e.fields, e.sig)
    return e.role in (CAUSE, WAIT) or (e.sig == "elastic_block" and _self_inflicted(e))


def is_wait(e: Event) -> bool:
    if e.role == WAIT:
        return True
    return e.sig == "python_exception" and bool(_WAIT_WORDS.search(str(e.fields.get("msg", ""))))


def _self_inflicted(e: Event) -> bool:
    """An agent block for a rank that ended on its own: killed by a signal the agent did not send
    (SIGTERM is the agent's), or exited non-zero (a `sys.exit(3)` leaves no traceback)."""
    if e.fields.get("signal"):
        return e.fields["signal"] in _SELF_INFLICTED
    return str(e.fields.get("exitcode")) not in ("0", "-15", "143", "None")


def attribute(events: list[Event], world_size: Optional[int] = None) -> tuple[dict[int, str], Optional[int]]:
    """Fill in ranks and hosts that other lines reveal; returns rank -> host and the world size."""
    nested = any(e.task is not None for e in events)  # srun started launchers: its tasks are nodes
    # Plain `srun torchrun ...` (no --label) shows only torchrun's own lines: its tasks are nodes too.
    launchers = nested or any(e.sig.startswith("elastic_") for e in events)
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
        elif e.sig == "srun_task" and not nested:
            tasks = task_list(str(e.fields.get("tasks", "")))
            for r in tasks if e.fields.get("host") else ():
                hosts.setdefault(r, str(e.fields["host"]))
            if e.rank is None and len(tasks) == 1 and not launchers:
                e.rank = tasks[0]  # srun started the ranks themselves: task N is SLURM_PROCID N, rank N
            elif e.rank is None and not launchers:
                e.fields["task_ranks"] = tasks  # `tasks 2-7`: every one of them, ranks 2 to 7
        elif e.sig == "nccl_comm_init":
            sizes.append(int(e.fields["nranks"]))
        elif e.sig == "elastic_world":
            sizes += [int(s) for s in str(e.fields["sizes"]).replace(" ", "").split(",") if s]
        elif e.sig == "clients_joined":
            sizes.append(int(e.fields["expected"]))
        if e.rank is not None and e.host and e.sig != "srun_task":
            hosts.setdefault(e.rank, e.host)
    # NCCL_DEBUG=INFO's `comm 0x.. rank R nranks N` line ties its host:pid to a rank of the job's
    # communicator (the largest one: a subgroup's ranks are not the job's).
    inits = [e for e in events if e.sig == "nccl_comm_init" and e.host and e.pid is not None]
    widest = max((int(e.fields["nranks"]) for e in inits), default=0)
    nccl_rank = {(e.host, e.pid): int(e.fields["rank"]) for e in inits if int(e.fields["nranks"]) == widest}
    for e in events:
        if e.rank is None and e.host and (e.host, e.pid) in nccl_rank:  # every key has a host
            e.rank = nccl_rank[(e.host, e.pid)]
            hosts.setdefault(e.rank, e.host)
    # srun --label torchrun: NCCL lines tie a task to its host, torchrun's lines a rank to its task.
    task_host = {e.task: e.host for e in events if e.task is not None and e.host and e.sig != "srun_task"}
    for e in events:
        if e.rank is not None and e.task in task_host:
            hosts.setdefault(e.rank, task_host[e.task])
        if e.host is None and e.task in task_host:
            e.host = task_host[e.task]
    single_host = len(set(hosts.values())) <= 1
    _agent_one_liners(events, by_pid, local_to_rank, single_host)
    aborted = {e.rank for e in events if e.sig == "elastic_block" and e.fields.get("signal") == "SIGABRT"}
    failed_alone = {e.rank for e in events if e.sig == "elastic_block"
                    and e.fields.get("signal") not in ("SIGTERM", None) or (e.sig == "elastic_block" and
                    e.fields.get("signal") is None and str(e.fields.get("exitcode")) not in ("0", "-15", "143"))
                    or (e.sig == "elastic_failed" and e.rank is not None and ended_badly(e.fields, e.sig))}
    oom_tasks = [(r, e.fields.get("host")) for e in events if e.sig == "srun_task"
                 and e.fields.get("what") == "Out Of Memory" for r in task_list(str(e.fields.get("tasks", "")))]
    for e in events:
        if e.rank is None and e.sig == "slurm_oom" and oom_tasks:
            e.rank, e.host = oom_tasks[0]  # srun says which task the cgroup killed
        if e.rank is None and e.sig in _ABORT_MESSAGES and len(aborted) == 1:
            e.rank = next(iter(aborted))  # C++ terminate prints unprefixed, then aborts its own rank
        elif e.rank is None and e.role == CAUSE and len(failed_alone) == 1 and e.task is None \
                and e.sig not in JOB_LEVEL:
            # No prefix (torchrun without --tee, a worker process's own stderr), and the agent says
            # only one rank failed by itself: the error is that rank's.
            e.rank = next(iter(failed_alone))
        if e.rank is None and "pid" in e.fields:
            pid = int(e.fields["pid"])
            if pid in by_pid:
                e.rank = by_pid[pid]
        if e.rank is None and e.local_rank is not None and single_host:
            e.rank = next((r for (h, lr), r in local_to_rank.items() if lr == e.local_rank), None)
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


def _agent_one_liners(events: list[Event], by_pid: dict[int, int],
                      local_to_rank: dict[tuple[Optional[str], int], int], single_host: bool) -> None:
    """torchrun's `failed (exitcode: -9) local_rank: 2 (pid: ...)` names a local rank: the rank
    of the failure block with that pid or local rank, or, on a one-node job, the local rank itself."""
    one_node = single_host and not any(e.rank is not None and e.local_rank is not None and e.rank != e.local_rank
                                       for e in events)
    for e in events:
        if e.rank is None and e.sig == "elastic_failed" and int(e.fields["pid"]) in by_pid:
            e.rank = by_pid[int(e.fields["pid"])]
        if e.rank is None and e.sig == "elastic_failed" and single_host:
            local = int(e.fields["local_rank"])
            e.rank = next((r for (h, lr), r in local_to_rank.items() if lr == local), local if one_node else None)


def task_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if "-" in part:
            lo, _, hi = part.partition("-")
            if lo.isdigit() and hi.isdigit() and int(hi) - int(lo) < 100000:
                out += range(int(lo), int(hi) + 1)
        elif part.isdigit():
            out.append(int(part))
    return out


def where_text(ranks: Iterable[int], hosts: dict[int, str], unattributed: bool = False,
               events: Iterable[Event] = ()) -> str:
    ranks = sorted(set(ranks))
    if not ranks:
        nodes = sorted({e.host for e in events if e.host})
        if nodes:
            return ", ".join(nodes)
        return "a rank" if unattributed else "the job"
    nodes = sorted({hosts[r] for r in ranks if r in hosts})
    text = f"rank {rank_ranges(ranks)}"
    return text + (f" ({', '.join(nodes)})" if nodes else "")


def nodes_of(ranks: Iterable[int], hosts: dict[int, str], events: Iterable[Event] = ()) -> tuple[str, ...]:
    found = {hosts[r] for r in ranks if r in hosts} | {e.host for e in events if e.host}
    return tuple(sorted(h for h in found if h and h != "<N/A>"))


def cite(e: Event) -> str:
    more = f" (x{e.count}, last at {e.last_where})" if e.count > 1 else ""
    return f"{e.where}: {e.text[:240]}{more}"


def fill(template: str, **values: Any) -> str:
    """The template with what the log said; a value it did not say leaves no `?` behind, its words close up."""
    class _Missing(dict):
        def __missing__(self, key: str) -> str:
            return "\x00"

    return re.sub(r"\s*\(\x00\)|:\s*\x00|\s*\x00", "", template.format_map(_Missing(values)))


def victims_evidence(waits: dict[int, Event], exclude: Iterable[int] = ()) -> dict[str, str]:
    skip = set(exclude)
    return {str(r): f"{e.label} ({e.where})" for r, e in sorted(waits.items()) if r not in skip}


def agent_root_cause(events: list[Event]) -> Optional[int]:
    for e in events:
        if e.sig == "elastic_block" and e.fields.get("root_cause"):
            return e.rank
    return None
