"""Judging the run itself: who never arrived, who crashed, who hung, who was only waiting.

A failure on one rank makes its peers fail too (a collective with a dead peer errors or
times out), so findings name the *first cause* and list the ranks it dragged down as
`affected_ranks`, instead of N alarms for one fault. The rule: a rank that failed while
waiting inside a collective is a victim whenever some rank failed outside one.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from ddpdoctor.core.behaviour_env import said, setting_for
from ddpdoctor.judge import crash_settings
from ddpdoctor.judge.flight_recorder import DumpSet, Mismatch, compare, dump_from_entries, format_dtypes, format_shapes
from ddpdoctor.core.grouping import group_ranks, minority
from ddpdoctor.core.codes import finding
from ddpdoctor.core.findings import Finding, rank_ranges
from ddpdoctor.core.faults import parse_faults
from ddpdoctor.core.exits import INJECTED_CRASH_EXIT, ORPHANED_EXIT, STAGE_TIMEOUT_EXIT
from ddpdoctor.core.run_record import RunRecord, signal_name

PROBE = "run"
# What a rank prints when it cannot reach the store (rank_runtime._connect): the cause, then
# its explanation in parentheses.
_NOT_ARRIVED = re.compile(r"(?:could not reach the rendezvous store at \S+(?: within [\d.]+s)?: |error: )"
                          r"(?P<reason>(?:connection refused|no answer|no route|connecting to|\S+ accepts connections"
                          r"|MASTER_ADDR=).*)")


def arrival_failure(log_tail: list[str]) -> Optional[str]:
    """The reason a rank that exited before its hello printed for not reaching the store, if any."""
    for line in reversed(log_tail or []):
        m = _NOT_ARRIVED.search(line)
        if m:
            return m.group("reason").strip()
    return None


@dataclass(frozen=True)
class RankFate:
    rank: int
    kind: str  # ok | crash | error | timeout | silent | stopped | missing | interrupted
    t: float
    in_collective: Optional[dict[str, Any]]
    stage: str
    detail: dict[str, Any]

    @property
    def waiting_on_peers(self) -> bool:
        # A frozen rank is a cause even if it froze inside a collective: its peers wait on it.
        if self.kind in ("silent", "crash"):
            return False
        return self.in_collective is not None or self.kind in ("stopped", "interrupted")


def rank_fates(record: RunRecord) -> dict[int, RankFate]:
    fates: dict[int, RankFate] = {}
    for rank in range(record.world_size):
        stage = record.last_stage(rank)
        exit_info = record.exits.get(rank)
        hb = record.heartbeats.get(rank) or {}
        if rank in record.timeouts:
            t = record.timeouts[rank]
            fates[rank] = RankFate(rank, "timeout", float(t.get("t", 0)), t.get("collective"), str(t.get("stage", stage)),
                                   {"deadline_s": t.get("deadline_s"), "stack": t.get("stack", "")})
        elif rank in record.errors:
            e = record.errors[rank]
            detail: dict[str, Any] = {"error": f"{e.get('type')}: {e.get('message')}", "traceback": e.get("traceback", "")}
            if out_of_memory(f"{detail['error']}\n{detail['traceback']}"):
                detail["out_of_memory"] = True
            if _injected(record, rank, ("oom",)):
                detail["injected"] = True
            fates[rank] = RankFate(rank, "error", float(e.get("t", 0)), e.get("collective"), str(e.get("stage", stage)),
                                   detail)
        elif record.interrupted and exit_info is not None and exit_info.killed_by_us \
                and exit_info.killed_by_us.startswith("interrupted"):
            # Stopped because the launcher was: wherever it was then (even before its hello), the
            # signal is the cause, not the rank.
            fates[rank] = RankFate(rank, "interrupted", exit_info.t, hb.get("collective"), stage,
                                   {"reason": exit_info.killed_by_us, "log_tail": exit_info.log_tail})
        elif exit_info is not None and exit_info.killed_by_us and rank not in record.hellos and not hb:
            # Its process ran, but it never said hello: it never joined (stuck before the
            # rendezvous, or pointed elsewhere). Its output says where it was.
            # A rank stopped while it still dialled the store prints why it could not reach it.
            said = arrival_failure(exit_info.log_tail)
            fates[rank] = RankFate(rank, "missing", exit_info.t, None, "rendezvous",
                                   {"reason": exit_info.killed_by_us, "log_tail": exit_info.log_tail,
                                    **({"arrival_failure": said} if said else {})})
        elif exit_info is not None and exit_info.killed_by_us:
            # Frozen, or stuck past every deadline: a cause. Stopped after another failed: a victim.
            kind = "silent" if exit_info.killed_by_us.startswith(("silent", "stuck")) else "stopped"
            if record.interrupted:
                kind = "interrupted"
            fates[rank] = RankFate(rank, kind, exit_info.t, hb.get("collective"), stage,
                                   {"reason": exit_info.killed_by_us, "log_tail": exit_info.log_tail})
        elif exit_info is not None and rank not in record.hellos and not hb \
                and arrival_failure(exit_info.log_tail) is not None:
            fates[rank] = RankFate(rank, "missing", exit_info.t, None, "rendezvous",
                                   {"arrival_failure": arrival_failure(exit_info.log_tail), "exit_code": exit_info.code,
                                    "log_tail": exit_info.log_tail})
        elif exit_info is not None and exit_info.code not in (0, None):
            code = int(exit_info.code)
            detail = {"exit_code": code, "log_tail": exit_info.log_tail}
            if code < 0:
                detail["signal"] = signal_name(code)
            if code == INJECTED_CRASH_EXIT or _injected(record, rank, ("kill", "oom")):
                detail["injected"] = True
            if out_of_memory("\n".join(exit_info.log_tail)):
                detail["out_of_memory"] = True
            if code == STAGE_TIMEOUT_EXIT:
                detail["note"] = "the rank's own stage deadline fired, but its report did not reach the store"
            if code == ORPHANED_EXIT:
                detail["note"] = "the rank lost its launcher or the out-of-band store"
            fates[rank] = RankFate(rank, "crash", exit_info.t, None, stage, detail)
        elif rank in record.dead:
            detail = {"exit_code": None, "note": record.dead[rank]}
            if _injected(record, rank, ("crash", "kill", "oom")):
                detail["injected"] = True
            fates[rank] = RankFate(rank, "crash", record.ended, None, stage, detail)
        elif rank in record.done:
            fates[rank] = RankFate(rank, "ok", 0.0, None, stage, {})
        elif rank not in record.hellos and not record.heartbeats.get(rank):
            fates[rank] = RankFate(rank, "missing", record.ended, None, "rendezvous", {})
        elif record.interrupted:
            fates[rank] = RankFate(rank, "interrupted", record.ended, hb.get("collective"), stage, {})
        else:
            age = record.ended - float(hb.get("t", record.started))
            fates[rank] = RankFate(rank, "silent", float(hb.get("t", record.ended)), hb.get("collective"),
                                   str(hb.get("stage", stage)), {"heartbeat_age_s": round(age, 1)})
    return fates


# What an allocation failure says: Python, torch's CPU allocator, CUDA, and C++ under both.
_OOM = re.compile(r"MemoryError|OutOfMemoryError|out of memory|can't allocate memory|Cannot allocate memory"
                  r"|std::bad_alloc|CUBLAS_STATUS_ALLOC_FAILED")


def out_of_memory(text: str) -> bool:
    return bool(_OOM.search(text))


def _injected(record: RunRecord, rank: int, kinds: tuple[str, ...]) -> bool:
    return any(f.kind in kinds and f.rank == rank for f in parse_faults(",".join(record.faults)))


@dataclass(frozen=True)
class _Outcome:
    """The run sorted once for every finding: each rank's fate and host, and which failed ranks
    are causes (`primaries`), which only waited on a peer (`victims`), which an interrupt stopped."""

    record: RunRecord
    fates: dict[int, RankFate]
    hosts: dict[int, str]
    primaries: dict[int, RankFate]
    victims: dict[int, RankFate]
    stopped: dict[int, RankFate]

    @classmethod
    def of(cls, record: RunRecord) -> "_Outcome":
        fates = rank_fates(record)
        failed = {r: f for r, f in fates.items() if f.kind not in ("ok", "interrupted")}
        return cls(record, fates, {r: record.host(r) for r in range(record.world_size)},
                   primaries={r: f for r, f in failed.items() if not f.waiting_on_peers},
                   victims={r: f for r, f in failed.items() if f.waiting_on_peers},
                   stopped={r: f for r, f in fates.items() if f.kind == "interrupted"})

    def nodes(self, ranks: Any) -> tuple[str, ...]:
        return tuple(sorted({self.hosts[r] for r in ranks if self.hosts[r] != "?"}))


def diagnose_run(record: RunRecord) -> list[Finding]:
    """The run's own findings, in the order a reader needs them: how the run was set up (injected
    faults, world sizes, GPUs), whether it was cut short, then the first causes (who never
    arrived, who crashed, failed or hung) and last what only shows across ranks (a desync, a
    rank stuck before the call, the transport)."""
    run = _Outcome.of(record)
    odd_sizes = _odd_world_sizes(record)
    found = [_injected_faults(record), _world_size_disagreement(run, odd_sizes), _ranks_without_gpu(run),
             _interrupted(run), _never_arrived(run)]
    found += _primary_findings(run)
    if not run.primaries and not odd_sizes:  # a first cause, or a world-size disagreement, explains the waits
        found.append(_with_a_setting(_across_ranks(run), run))
    return [f for f in found if f is not None]


def _with_a_setting(f: Optional[Finding], run: _Outcome) -> Optional[Finding]:
    """Every rank failed alike inside one collective (RUN008): a setting every rank read is as likely a cause
    as the network, so it is listed, and where `check` ran the stage again without it and it passed, the
    setting leads (RUN013)."""
    first = crash_settings.failed_alike(run.fates)
    settings = crash_settings.env_settings(run.record)
    if f is None or first is None or not settings:
        return f
    return _settings_said(f, tuple(sorted(run.fates)), first, run, {}, settings)


def _settings_said(f: Finding, ranks: tuple[int, ...], first: RankFate, run: _Outcome, victims: dict[int, RankFate],
                   settings: dict[str, str]) -> Finding:
    """A failure the settings may have made: led by the setting where `check`'s try without it passed (RUN013),
    else `f` with the settings and what the try showed, or how to make it."""
    retry = crash_settings.Retry.of(run.record, first.stage)
    if retry is not None and retry.cleared:
        return _made_by_a_setting(ranks, first, run, victims, settings, retry)
    return _with_settings(f, settings, retry)


def _injected_faults(record: RunRecord) -> Optional[Finding]:
    """RUN010: faults were injected on purpose; said first so no one takes the drill for real."""
    if not record.faults:
        return None
    return finding("RUN010", PROBE, "Faults were injected on purpose: " + ", ".join(record.faults),
                   evidence={"injected": list(record.faults)})


def _odd_world_sizes(record: RunRecord) -> list[int]:
    """The ranks whose hello gives another WORLD_SIZE than the launcher's."""
    return sorted(r for r, h in record.hellos.items() if h.get("world_size") != record.world_size)


def _world_size_disagreement(run: _Outcome, odd_sizes: list[int]) -> Optional[Finding]:
    """RUN007: ranks launched with another WORLD_SIZE; it also explains every wait that follows."""
    if not odd_sizes:
        return None
    sizes = {r: h.get("world_size") for r, h in run.record.hellos.items()}
    return finding(
        "RUN007", PROBE,
        f"Ranks disagree on the world size: rank {rank_ranges(odd_sizes)} expected a different WORLD_SIZE",
        ranks=tuple(odd_sizes), nodes=run.nodes(odd_sizes),
        evidence={"world_size_by_rank": sizes, "expected": run.record.world_size})


def _ranks_without_gpu(run: _Outcome) -> Optional[Finding]:
    """RUN012: some ranks see a GPU and others none, so the whole check fell back to gloo on CPU."""
    gpus = {r: int(h.get("cuda_devices") or 0) for r, h in run.record.hellos.items()}
    without = sorted(r for r, n in gpus.items() if n == 0)
    if not without or len(without) == len(gpus):
        return None
    with_gpu = sorted(r for r, n in gpus.items() if n > 0)
    return finding(
        "RUN012", PROBE,
        f"Rank {rank_ranges(without)} see no GPU while rank {rank_ranges(with_gpu)} do: the check ran on CPU with gloo",
        ranks=tuple(without), nodes=run.nodes(without), evidence={"cuda_devices_by_rank": gpus})


def _interrupted(run: _Outcome) -> Optional[Finding]:
    """RUN006: the launcher was stopped by a signal and no rank failed first.

    With a cause found, the stop is its consequence (torchrun stops every worker when one
    fails): the stopped ranks are listed as affected, not as a second alarm."""
    record = run.record
    if not record.interrupted or run.primaries:
        return None
    return finding(
        "RUN006", PROBE, f"The run was interrupted by {record.interrupted}; results are partial",
        ranks=tuple(run.stopped), nodes=run.nodes(run.stopped),
        evidence={"signal": record.interrupted, "stage_by_rank": {r: f.stage for r, f in run.fates.items()}})


def _never_arrived(run: _Outcome) -> Optional[Finding]:
    """RUN001: ranks that never reached the rendezvous, as whole nodes where the layout shows it,
    with the reason each printed for not reaching the store where it printed one."""
    record, primaries = run.record, run.primaries
    missing = sorted(r for r, f in primaries.items() if f.kind == "missing")
    if not missing:
        return None
    arrived = sorted(record.hellos)
    reasons = {r: primaries[r].detail["arrival_failure"] for r in missing
               if primaries[r].detail.get("arrival_failure")}
    short = sorted({reason.split(" (")[0] for reason in reasons.values()})
    said = {r for r in missing if r in reasons}
    gone = missing_nodes(record, missing)
    return finding(
        "RUN001", PROBE,
        ((f"{_nodes_said(gone)} never arrived: none of {'its' if len(gone) == 1 else 'their'} ranks "
          f"({rank_ranges(missing)}) connected" if gone and sum(len(n['ranks']) for n in gone) == len(missing)
          else f"Rank {rank_ranges(missing)} never arrived")
         + f" ({len(arrived)} of {record.world_size} ranks connected)"
         + (f": {short[0]}" if len(short) == 1 and said == set(missing) else "")),
        ranks=tuple(missing), nodes=tuple(n["host"] for n in gone if n.get("host")),
        evidence={"arrived_ranks": rank_ranges(arrived) or "none", "expected_world_size": record.world_size,
                  "arrived_hosts": sorted({run.hosts[r] for r in arrived}),
                  **({"missing_nodes": [{**n, "ranks": rank_ranges(n["ranks"])} for n in gone]} if gone else {}),
                  **({"why_not_arrived": {str(r): reason for r, reason in sorted(reasons.items())}}
                     if reasons else {}),
                  "affected_ranks": _victims_evidence(run.victims),
                  **{f"last_output_rank_{r}": _tail("\n".join(primaries[r].detail["log_tail"]))
                     for r in missing if primaries[r].detail.get("log_tail") and r not in said}},
        why=(("The rank(s) said why they could not reach the rendezvous store (why_not_arrived). "
              if said == set(missing) else
              "These ranks never reached the rendezvous: fewer processes were launched than WORLD_SIZE says, they "
              "crashed while starting, or they could not reach MASTER_ADDR:MASTER_PORT (wrong address, another "
              "port, a firewall). ")
             + "A rank that cannot reach the store on another node can only say so in its own output."),
        fix=_arrival_fix(short) if said == set(missing) else
            (("A whole node is missing: check that its job step started there (its torchrun or srun task log, "
              "`sacct -j JOB --format=JobID,NodeList,State,ExitCode`), that the node is not drained or down "
              "(`sinfo -n HOST`), and that it reaches MASTER_ADDR:MASTER_PORT (`nc -zv MASTER_ADDR MASTER_PORT` "
              "from that node). " if gone else "")
             + "Check that WORLD_SIZE equals nodes x processes per node, that every node uses the same MASTER_ADDR "
               "and MASTER_PORT, and that the port is open between nodes (`nc -zv MASTER_ADDR MASTER_PORT`)."),
    )


def _across_ranks(run: _Outcome) -> Optional[Finding]:
    """With no first cause: what only the ranks together show. Every failed rank waited in a
    collective (a desync, a rank stuck before the call, or the transport: _collective_hang), or
    every rank got through yet torch recorded different calls at one sequence number (a backend
    that does not check shapes, NCCL, runs them and reduces garbage, or hangs later)."""
    mismatches = recorded_mismatches(run.record)
    recorded = recorded_mismatch(mismatches)
    if run.victims:
        return _collective_hang(run.victims, run.hosts, recorded, recorded_laggards(mismatches, run.record.timeouts),
                                _network(run.record), _recorder_off(run.record))
    if recorded is not None:
        return _recorded_desync(recorded, run.hosts, {})
    return None


def missing_nodes(record: RunRecord, missing: list[int]) -> list[dict[str, Any]]:
    """Whole nodes none of whose ranks arrived, from the layout the arrived ranks show.

    Launchers number ranks node by node (torchrun by its node rank, srun by task blocks): when
    every arrived rank sits at rank // local_world_size == its node rank, a node rank none of
    whose ranks arrived is a node that is missing as a whole. Its host name comes from Slurm's
    node list (SLURM_STEP_NODELIST): by position where the node rank is Slurm's SLURM_NODEID;
    where it is torchrun's GROUP_RANK (c10d orders nodes its own way), only when exactly one
    listed host has no arrived rank."""
    hellos = record.hellos.values()
    sizes = {h.get("local_world_size") for h in hellos}
    per_node = next(iter(sizes)) if len(sizes) == 1 else None
    if not isinstance(per_node, int) or per_node < 1:
        return []
    if any(not isinstance(h.get("node_rank"), int) or h["node_rank"] != int(h["rank"]) // per_node for h in hellos):
        return []
    nodelist = [str(h) for h in next((h["nodelist"] for h in hellos if isinstance(h.get("nodelist"), list)), [])]
    by_position = all(h.get("node_rank_from") == "slurm" for h in hellos)
    arrived_hosts = {str(h.get("host", "")).split(".")[0] for h in hellos}
    unaccounted = [h for h in nodelist if h.split(".")[0] not in arrived_hosts]
    lost = set(missing)
    out: list[dict[str, Any]] = []
    for node in range((record.world_size + per_node - 1) // per_node):
        ranks = list(range(node * per_node, min((node + 1) * per_node, record.world_size)))
        if lost.issuperset(ranks):
            out.append({"node_rank": node, "ranks": ranks})
    for entry in out:
        if by_position and entry["node_rank"] < len(nodelist):
            entry["host"] = nodelist[entry["node_rank"]]
        elif len(out) == 1 and len(unaccounted) == 1:
            entry["host"] = unaccounted[0]
    return out


def _nodes_said(gone: list[dict[str, Any]]) -> str:
    """`Node rank 1 (gpu-a02)`, `Node ranks 1, 2 (gpu-a02, gpu-a03)`."""
    ranks = ", ".join(str(n["node_rank"]) for n in gone)
    hosts = [n["host"] for n in gone if n.get("host")]
    return f"Node rank{'s' if len(gone) > 1 else ''} {ranks}" + (f" ({', '.join(hosts)})" if len(hosts) == len(gone) else "")


def _arrival_fix(short: list[str]) -> str:
    text = " ".join(short)
    if "does not resolve" in text:
        return ("Set MASTER_ADDR to a name or IP every node resolves the same way (the first node's IP is safest); "
                "check with `getent hosts $MASTER_ADDR` on the failing node.")
    if "connection refused" in text:
        return ("Give every rank the same MASTER_PORT as rank 0 (and the same MASTER_ADDR), and start rank 0 first "
                "or together with the others; `ss -ltnp | grep PORT` on rank 0's host shows what listens.")
    if "no answer" in text or "no route" in text:
        return ("Open MASTER_PORT between the nodes (firewall, security group) and check that MASTER_ADDR is rank "
                "0's host on a network every node reaches: `nc -zv MASTER_ADDR MASTER_PORT` from the failing node.")
    return "Check that nothing but rank 0 listens on MASTER_PORT on MASTER_ADDR (`ss -ltnp` there)."


def _victims_evidence(victims: dict[int, RankFate]) -> dict[str, Any]:
    out = {}
    for r, f in sorted(victims.items()):
        text = f"{f.kind} in {f.stage}" + (f" waiting in {_coll(f.in_collective)}" if f.in_collective else "")
        if f.detail.get("error"):
            text += f": {str(f.detail['error'])[:200]}"
        out[str(r)] = text
    return out


def _coll(c: Optional[dict[str, Any]]) -> str:
    if not c:
        return "no collective"
    extra = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("op", "seq"))
    return f"{c.get('op')} #{c.get('seq')}" + (f" ({extra})" if extra else "")


def _coll_short(c: Optional[dict[str, Any]]) -> str:
    """`barrier #4`: what to compare across ranks (the details, like the step, go in the evidence)."""
    return f"{c.get('op')} #{c.get('seq')}" if c else "no collective"


def _tail(text: str, lines: int = 12) -> list[str]:
    return [line for line in str(text).rstrip().splitlines()][-lines:]


_OOM_FIX = ("Lower the per-rank batch or model size, or run fewer ranks per node; on a GPU check `nvidia-smi` for "
            "other processes on that device and try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against "
            "fragmentation; on the host check the job's memory limit (Slurm --mem, cgroup, `ulimit -v`).")


def _cause_key(fate: RankFate) -> tuple[Any, ...]:
    """Two ranks' failures are one cause when they are of a kind, in a stage, by the same signal, exit code or
    error (its numbers aside: a rank's own index or address in the message does not make another cause)."""
    d = fate.detail
    return (fate.kind, fate.stage, d.get("signal"), d.get("exit_code"), bool(d.get("out_of_memory")),
            bool(d.get("injected")), crash_settings.error_shape(d), d.get("note"))


def _primary_findings(run: _Outcome) -> list[Finding]:
    """One finding per cause: the same crash, error or hang on several ranks is one finding naming them all,
    in the order the first of each happened; a crash a setting makes is led by that setting."""
    groups: dict[tuple[Any, ...], list[tuple[int, RankFate]]] = {}
    for rank, fate in sorted(run.primaries.items(), key=lambda kv: kv[1].t):
        if fate.kind != "missing":
            groups.setdefault(_cause_key(fate), []).append((rank, fate))
    victims = {**run.victims, **run.stopped}
    settings = crash_settings.env_settings(run.record)
    out = []
    for members in groups.values():
        ranks = tuple(sorted(r for r, _ in members))
        first = members[0][1]  # the earliest: its output is the one shown
        f = _primary_finding(ranks, first, run, victims)
        out.append(_settings_said(f, ranks, first, run, victims, settings)
                   if settings and crash_settings.is_crash(first.kind, first.detail) else f)
    return out


def _where(ranks: tuple[int, ...], run: _Outcome) -> str:
    hosts = run.nodes(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}" + (f" ({', '.join(hosts)})" if hosts else
                                                                         " (?)")


def _stage_words(fate: RankFate) -> str:
    """What the crashed stage was doing, in the user's words: DDP's constructor where the stack shows it."""
    stack = "\n".join(str(line) for line in fate.detail.get("log_tail") or []) + str(fate.detail.get("traceback", ""))
    if "_ddp_init_helper" in stack or re.search(r"distributed\.py\S*\s*,?\s*line \d+,? in __init__", stack):
        return "DDP construction (DistributedDataParallel(model))"
    words = {"ddp": "The DDP training steps", "init": "init_process_group", "rendezvous": "The rendezvous",
             "reach": "Dialling the other nodes"}
    if fate.stage in words:
        return words[fate.stage]
    return f"The {fate.stage.removeprefix('probe:')} stage"


def _made_by_a_setting(ranks: tuple[int, ...], fate: RankFate, run: _Outcome, victims: dict[int, RankFate],
                       settings: dict[str, str], retry: crash_settings.Retry) -> Finding:
    """RUN013: the stage crashed with these settings and ran cleanly without them, the culprits told apart."""
    culprits = {n: settings[n] for n in retry.culprits if n in settings}
    listed = said(culprits)
    how = fate.detail.get("signal") or fate.detail.get("error") or f"exit code {fate.detail.get('exit_code')}"
    one = len(culprits) == 1
    entries = [setting_for(n) for n in culprits]
    verb = "crashes" if fate.kind == "crash" else "fails"
    return finding(
        "RUN013", PROBE,
        title=f"{_stage_words(fate)} {verb} with {listed} and passes without {'it' if one else 'them'}",
        ranks=ranks, nodes=run.nodes(ranks),
        evidence={"stage": fate.stage, "crash": how, "crashed_ranks": rank_ranges(ranks), "settings": settings,
                  "what_they_change": crash_settings.described(culprits),
                  "retried": retry.evidence(),
                  "last_output": fate.detail.get("log_tail", [])[-8:] or _tail(fate.detail.get("traceback", ""), 8),
                  "affected_ranks": _victims_evidence(victims)},
        why=(f"ddpdoctor ran the failing stage once more without {said(settings)}: it passed "
             f"({retry.seconds:g} s); with {listed} alone it {'crashed' if fate.kind == 'crash' else 'failed'} "
             f"again ({how}). "
             + " ".join(f"What {e.name} changes: {e.changes}." for e in entries if e is not None)).strip(),
        fix=(f"Unset {' and '.join(culprits)} for this job ({crash_settings.unset_command(culprits)} ..., or remove "
             f"the export from the job script and ~/.bashrc): {crash_settings.why_unset(entries)} If you need what "
             f"it gives, try it on another {'/'.join(sorted({e.project for e in entries if e is not None}))} "
             "version, or report the crash to that project with this report attached."),
    )


def _with_settings(f: Finding, settings: dict[str, str], retry: Optional[crash_settings.Retry]) -> Finding:
    """A crash finding with the behaviour-changing settings the ranks ran with, and what a try without showed."""
    why, fix = crash_settings.crash_text(settings, retry)
    evidence = {**f.evidence, "settings": settings, "what_they_change": crash_settings.described(settings)}
    if retry is not None:
        evidence["retried"] = retry.evidence()
    return dataclasses.replace(f, evidence=evidence, why=f"{f.why} {why}".strip(),
                               fix=f"{fix} {f.fix}".strip() if fix else f.fix)


def _primary_finding(ranks: tuple[int, ...], fate: RankFate, run: _Outcome, victims: dict[int, RankFate]) -> Finding:
    affected = _victims_evidence(victims)
    where = _where(ranks, run)
    alike = {"same_on_ranks": rank_ranges(ranks)} if len(ranks) > 1 else {}
    if fate.kind == "crash":
        how = fate.detail.get("signal") or (f"exit code {fate.detail['exit_code']}"
                                            if fate.detail.get("exit_code") is not None else "process gone")
        injected = fate.detail.get("injected")
        killed_oom = fate.detail.get("signal") == "SIGKILL"
        oom = fate.detail.get("out_of_memory")
        return finding(
            "RUN002", PROBE,
            title=f"{where} crashed in stage {fate.stage} ({how})" + (": out of memory" if oom else "")
                  + (" [injected]" if injected else ""),
            ranks=ranks, nodes=run.nodes(ranks),
            evidence={"stage": fate.stage, **{k: v for k, v in fate.detail.items() if k != "log_tail"},
                      "last_output": fate.detail.get("log_tail", [])[-12:], "affected_ranks": affected, **alike},
            why=("The process died; its peers then failed or were stopped waiting for it. "
                 + ("SIGKILL without a Python error is most often the kernel's out-of-memory killer. " if killed_oom else "")
                 + ("This crash was injected on purpose (--inject or DDPDOCTOR_INJECT)." if injected else "")).strip(),
            fix=("Nothing to fix: run without --inject / DDPDOCTOR_INJECT." if injected else
                 _OOM_FIX if oom else
                 "Check `dmesg | grep -i -E 'oom|killed process'` on that host; if memory is short, run fewer ranks "
                 "per node or a smaller batch." if killed_oom else
                 "Read the rank's last output above: it shows the error that ended the process."
                 if fate.detail.get("log_tail") else
                 "Read that rank's own output (torchrun prefixes it with [rankN]:) for the error that ended it."),
        )
    if fate.kind == "error":
        oom, injected = fate.detail.get("out_of_memory"), fate.detail.get("injected")
        return finding(
            "RUN003", PROBE,
            title=f"{where} {'ran out of memory' if oom else 'failed'} in stage {fate.stage}: "
                  f"{fate.detail.get('error')}" + (" [injected]" if injected else ""),
            ranks=ranks, nodes=run.nodes(ranks),
            evidence={"stage": fate.stage, "error": fate.detail.get("error"),
                      **{k: True for k in ("out_of_memory", "injected") if fate.detail.get(k)},
                      "traceback": _tail(fate.detail.get("traceback", ""), 6), "affected_ranks": affected, **alike},
            why=("An allocation failed on this rank (host memory or GPU memory), which ended its stage; the ranks "
                 "waiting for it could not go on." if oom else
                 "An exception ended this stage on this rank; the ranks waiting for it could not go on.")
                + (" It was injected on purpose (--inject or DDPDOCTOR_INJECT)." if injected else ""),
            fix=("Nothing to fix: run without --inject / DDPDOCTOR_INJECT." if injected else _OOM_FIX if oom else
                 "Fix the error shown; if it names a backend or device, see docs/runtime.md for that message."),
        )
    if fate.kind == "timeout":
        return finding(
            "RUN004", PROBE,
            f"{where} hung in stage {fate.stage}, outside any collective"
            + ("; the others waited for it" if victims else ""),
            ranks=ranks, nodes=run.nodes(ranks),
            evidence={"stage": fate.stage, "deadline_s": fate.detail.get("deadline_s"),
                      "python_stack": _tail(fate.detail.get("stack", ""), 16), "affected_ranks": affected, **alike},
        )
    # silent: frozen (no heartbeat) or stopped while running
    return finding(
        "RUN005", PROBE, f"{where} stopped answering in stage {fate.stage}",
        ranks=ranks, nodes=run.nodes(ranks),
        evidence={"stage": fate.stage, **{k: v for k, v in fate.detail.items() if k != "log_tail"},
                  "last_output": fate.detail.get("log_tail", [])[-12:], "affected_ranks": affected, **alike},
    )


def recorded_mismatches(record: RunRecord) -> list[Mismatch]:
    """Per process group, the first sequence number where the ranks' Flight Recorders part ways."""
    dumps = DumpSet({int(r): dump_from_entries(int(r), f"rank {r}", d["entries"])
                     for r, d in record.flight_recorder.items()
                     if isinstance(d, dict) and isinstance(d.get("entries"), list)})
    return compare(dumps)[0]


def recorded_laggards(mismatches: list[Mismatch], timeouts: dict[int, dict[str, Any]]) -> Optional[Mismatch]:
    """The first sequence number some ranks issued to the backend and others never did (all
    that did agree), where those others' main thread is in their own code, not inside torch.

    gloo never marks a call completed, so a rank one call behind may just as well be inside
    the previous call in the backend (a ring whose last receive never came): only its stack
    tells "stuck before the call" from "stuck in the transport".
    """
    for m in mismatches:
        present = [c for c in m.calls.values() if c is not None]
        if present and m.missing and len({c.signature() for c in present}) == 1:
            stacks = [str((timeouts.get(r) or {}).get("stack", "")) for r in m.missing]
            if all(_innermost_outside_torch(s) for s in stacks):
                return m
            return None
    return None


def _innermost_outside_torch(stack: str) -> bool:
    """The main thread's innermost frame (python_stacks puts it first) is not torch's own code."""
    main = stack.split("\nThread ", 1)[0]
    files = [line for line in main.splitlines() if line.strip().startswith("File ")]
    return bool(files) and "/torch/" not in files[-1].replace("\\", "/")


def recorded_mismatch(mismatches: list[Mismatch]) -> Optional[Mismatch]:
    """The first collective where the ranks' Flight Recorders disagree on op, shapes or dtypes.

    A rank that simply stopped earlier is not a disagreement here: our own marks and deadlines
    say where each rank stopped; torch's record is read for what only the backend saw.
    """
    for m in mismatches:
        present = [c for c in m.calls.values() if c is not None]
        if len({c.signature() for c in present}) > 1:
            return m
    return None


def _recorded_calls(m: Mismatch) -> dict[int, str]:
    def text(c: Any) -> str:
        shapes = format_shapes(c.in_sizes)
        return f"{c.op} #{m.seq}" + (f" (in {shapes} {format_dtypes(c.in_dtypes)})" if shapes else "")

    return {r: text(c) if c is not None else f"not reached (last #{m.last_seq.get(r)})"
            for r, c in sorted(m.calls.items())}


def _desync_text(calls: dict[int, str], called: bool) -> tuple[tuple[int, ...], str]:
    """The rank(s) apart from the majority (all of them when there is none) and the words for it:
    "rank 1 is in barrier #4, while rank 0,2 are in all_reduce #4" (where ranks wait), or with
    `called` "rank 1 called ..., while rank 0,2 called ..." (what torch recorded)."""
    ranks = tuple(sorted(calls))
    groups = group_ranks(calls)  # largest first
    odd = minority(groups)
    culprits = tuple(odd) if odd and len(odd) < len(ranks) else ranks
    if culprits == ranks:
        return culprits, "; ".join(f"rank {rank_ranges(rs)} {'called' if called else 'in'} {call}" for call, rs in groups)
    majority, rest = groups[0]
    odd_verb = "called" if called else "is in"
    majority_verb = "called" if called else ("is in" if len(rest) == 1 else "are in")
    others = "; ".join(f"rank {rank_ranges(rs)} {odd_verb} {call}" for call, rs in groups[1:])
    return culprits, f"{others}, while rank {rank_ranges(rest)} {majority_verb} {majority}"


def _recorded_desync(m: Mismatch, hosts: dict[int, str], evidence: dict[str, Any]) -> Finding:
    """RUN009 from torch's record: the op, shapes or dtypes differ at one sequence number."""
    present = {r: c for r, c in m.calls.items() if c is not None}
    calls = _recorded_calls(m)
    culprits, desc = _desync_text({r: calls[r] for r in present}, called=True)
    differ = [what for what, values in (("op", {c.op for c in present.values()}),
                                        ("shapes", {format_shapes(c.in_sizes) for c in present.values()}),
                                        ("dtypes", {format_dtypes(c.in_dtypes) for c in present.values()}))
              if len(values) > 1]
    differs = " and ".join(differ)
    return finding(
        "RUN009", PROBE,
        title=f"Collective mismatch (desync) in torch's Flight Recorder: {desc}",
        ranks=culprits, nodes=tuple(sorted({hosts.get(r, "?") for r in culprits} - {"?"})),
        evidence={**evidence, "flight_recorder": {"process_group": m.group, "seq": m.seq, "differs_in": differs,
                                                  "calls": {str(r): c for r, c in calls.items()}}},
        why=(f"torch's Flight Recorder shows the ranks issued different calls at the same sequence number ({differs} "
             "differ): NCCL runs such calls without checking and reduces garbage or hangs; gloo fails them only when "
             "their byte sizes differ. The rank(s) apart from the majority built other tensors or took another code "
             "path."),
        fix=("Make every rank issue the same collectives with the same shapes and dtypes, in the same order: look for "
             "data-dependent tensor sizes (a last partial batch, a variable-length sequence) or rank-dependent code "
             "at the named ranks. TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch check every call up front."),
    )


def _recorder_off(record: RunRecord) -> dict[str, str]:
    """Ranks whose Flight Recorder could not be read, and how to turn it on."""
    return {str(r): f"{d['unknown']}; set TORCH_FR_BUFFER_SIZE=2000 (TORCH_NCCL_TRACE_BUFFER_SIZE on torch before "
                    "2.8) so torch records every collective"
            for r, d in sorted(record.flight_recorder.items()) if isinstance(d, dict) and d.get("off")}


def _network(record: RunRecord) -> dict[str, str]:
    """Per host, the interface toward MASTER_ADDR and any *_SOCKET_IFNAME, from the init-hang probe."""
    out: dict[str, str] = {}
    for rank, facts in sorted((record.results.get("init-hang") or {}).items()):
        if not isinstance(facts, dict):
            continue
        route, ifnames = facts.get("route"), facts.get("socket_ifname")
        route = route if isinstance(route, dict) else {}
        ifnames = ifnames if isinstance(ifnames, dict) else {}
        said = [f"{var}={v.get('value')} (selects {', '.join(v.get('selects') or []) or 'nothing'})"
                for var, v in sorted(ifnames.items()) if isinstance(v, dict)]
        out.setdefault(record.host(rank), "; ".join([f"route to MASTER_ADDR via {route.get('interface')}"] + said))
    return out


def _stuck_before_the_backend(laggards: Mismatch, victims: dict[int, RankFate], hosts: dict[int, str],
                              evidence: dict[str, Any]) -> Finding:
    stuck = tuple(laggards.missing)
    op = next(c.op for c in laggards.calls.values() if c is not None)
    where = ", ".join(f"rank {r} ({hosts.get(r, '?')})" for r in stuck)
    stacks = {f"python_stack_rank_{r}": _tail(victims[r].detail.get("stack", ""), 16)
              for r in stuck if r in victims and victims[r].detail.get("stack")}
    others = sorted(r for r in laggards.calls if r not in stuck)
    return finding(
        "RUN004", PROBE,
        (f"{where[0].upper() + where[1:]} never handed {op} #{laggards.seq} to the backend: "
         f"stuck in its own code, the others waited for it"),
        ranks=stuck, nodes=tuple(sorted({hosts.get(r, "?") for r in stuck} - {"?"})),
        evidence={**evidence, "flight_recorder": {"process_group": laggards.group, "seq": laggards.seq,
                                                  "calls": {str(r): c for r, c in _recorded_calls(laggards).items()}},
                  "waiting_ranks": rank_ranges(others), **stacks},
    )


def _collective_hang(victims: dict[int, RankFate], hosts: dict[int, str],
                     recorded: Optional[Mismatch] = None, laggards: Optional[Mismatch] = None,
                     network: Optional[dict[str, str]] = None, recorder_off: Optional[dict[str, str]] = None) -> Finding:
    """Every failed rank was inside a collective: a desync, a rank stuck before the call, or the transport."""
    ops = {r: (f.in_collective or {}).get("op") for r, f in victims.items()}
    ranks = tuple(sorted(victims))
    nodes = tuple(sorted({hosts[r] for r in ranks if hosts[r] != "?"}))
    evidence: dict[str, Any] = {
        "collective_by_rank": {str(r): _coll(f.in_collective) for r, f in sorted(victims.items())},
        "state_by_rank": {str(r): f.kind for r, f in sorted(victims.items())}}
    if recorder_off:
        evidence["flight_recorder_off"] = recorder_off
    calls = {r: _coll_short(f.in_collective) for r, f in victims.items()}
    if len(set(calls.values())) > 1:  # another op, or the same op at another sequence number
        culprits, desc = _desync_text(calls, called=False)
        evidence["waiting_ranks"] = rank_ranges(ranks)
        if recorded is not None:
            evidence["flight_recorder"] = {"process_group": recorded.group, "seq": recorded.seq,
                                           "calls": {str(r): c for r, c in _recorded_calls(recorded).items()}}
        return finding(
            "RUN009", PROBE,
            title=f"Collective mismatch (desync): {desc}",
            ranks=culprits, nodes=tuple(sorted({hosts[r] for r in culprits if hosts[r] != "?"})), evidence=evidence,
            why=("Ranks called different collectives at the same point, so each waits for a partner that never comes; "
                 "the rank(s) apart from the majority took another code path."),
            fix=("Make every rank issue the same collectives in the same order: look for rank-dependent code "
                 "(`if rank == 0:` around an all_reduce, barrier or broadcast, an early exit from a loop, an "
                 "unused parameter skipped on some ranks) at the Python stacks of the named ranks. "
                 "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's op and shapes across ranks."),
        )
    errors = {str(r): f.detail.get("error") for r, f in victims.items() if f.detail.get("error")}
    if errors:
        evidence["errors"] = errors
    if recorded is not None:  # our marks agree, torch's record does not: shapes or dtypes differ
        return _recorded_desync(recorded, hosts, evidence)
    if laggards is not None:  # our marks agree, but some ranks never issued the call
        return _stuck_before_the_backend(laggards, victims, hosts, evidence)
    if network:
        evidence["network"] = network
    return finding(
        "RUN008", PROBE,
        title=f"All ranks failed inside {next(iter(ops.values()))}: the collective itself did not complete",
        ranks=ranks, nodes=nodes, evidence=evidence,
        why="Every rank entered the same collective and none finished it: the transport between ranks is broken or blocked.",
        fix=("Check the network interface the backend uses (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), firewalls "
             "between nodes, and for NCCL run with NCCL_DEBUG=INFO."),
    )
