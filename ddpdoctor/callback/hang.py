"""One verdict on a hung step, the same on every rank: which rank caused it, which only waited.

Each rank's own watchdog sees only itself: a rank waiting in the gradient all-reduce looks as
stuck as the rank it waits for. So when a step outlives its allowance the ranks trade what
they know through the job's store (never a collective: one is stuck): each rank's record
(inside a collective, and which one, or in its own code; its step, pid, host, its innermost
frame in the user's own code and its stack). The lowest rank that answered judges, by the
first-cause rule `ddpdoctor check` applies (judge/run_diagnosis.py, RUN004): a rank outside
any collective (stuck in its own code, dead, frozen, or gone from the loop) is the cause and
the ranks waiting in a collective are its victims; with every rank in a collective, the ones
in another collective or step than the rest (a desync) are the cause.

Here only what needs no torch: the records, the frames, the process states and the verdict.
`Doctor`'s hang watch (hang_watch.py) builds its record from its comm hook and main thread and runs the exchange.
"""

from __future__ import annotations

import json
import os
import re
import site
import sysconfig
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any, Callable, Optional

from ddpdoctor.core import codes, keys
from ddpdoctor.core.findings import Finding

PROBE = "callback"
DDP_ALLREDUCE = "DDP's gradient all-reduce"
# How long a rank waits for its peers' records, and a victim for the culprit to be gone.
COLLECT_S = 4.0
CULPRIT_EXIT_GRACE_S = 8.0
# After the culprit is gone, a victim stays this long so the launcher sees the culprit exit first
# (torchrun polls its workers every 0.1 s).
AFTER_CULPRIT_S = 1.0


def leave_within_s() -> float:
    """The longest a rank's part in a hang may take, every wait at its deadline: collecting the
    records, waiting for the verdict, a victim's grace for the culprit to leave and a little more.
    Past it (plus a margin) a backstop ends the process: a store call can block past every wait."""
    return COLLECT_S + (COLLECT_S + 2.0) + CULPRIT_EXIT_GRACE_S + AFTER_CULPRIT_S


# A culprit that can exit: stuck in its own code, in another collective (desync), gone from the loop.
CAN_EXIT = ("own code", "desync", "left")


def _library_roots() -> tuple[str, ...]:
    """Where code that is not the user's lives: the standard library, site-packages, ddpdoctor."""
    paths = sysconfig.get_paths()
    roots = {paths.get("stdlib", ""), paths.get("platstdlib", ""), os.path.dirname(os.path.dirname(__file__))}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


_LIBRARY = _library_roots()


def is_user_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    real = os.path.realpath(filename)
    return not real.startswith(_LIBRARY) and "site-packages" not in real and "dist-packages" not in real


def _torch_distributed(filename: str) -> bool:
    return "/torch/distributed/" in filename.replace("\\", "/")


def frames_of(frame: Optional[FrameType]) -> list[FrameType]:
    """A thread's frames, outermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out[::-1]


def _tensor_text(value: Any) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None:
        return ""
    return f" of a {str(dtype).replace('torch.', '')}{list(shape)} tensor"


def user_collective(frames: list[FrameType]) -> str:
    """The collective the main thread is in, with its tensor's shape ("all_reduce of a float32[3]
    tensor"): the outermost public call into torch.distributed's c10d (the one the user's code, FSDP
    or ddpdoctor's check called), else the first torch.distributed frame ("forward" of FSDP); '' if none."""
    public = [f for f in frames if _torch_distributed(f.f_code.co_filename)
              and not f.f_code.co_name.startswith("_") and f.f_code.co_name != "wrapper"]
    c10d = [f for f in public if f.f_code.co_filename.endswith("distributed_c10d.py")]
    if not public:
        return ""
    frame = (c10d or public)[0]
    try:
        tensor = frame.f_locals.get("tensor", frame.f_locals.get("output_tensor"))
    except Exception:  # a frame's locals can be unreadable mid-call
        tensor = None
    return frame.f_code.co_name + _tensor_text(tensor)


def untimed_backward(frames: list[FrameType]) -> bool:
    """The main thread is inside torch's backward, below any user frame: where the gradient
    collectives wait unseen when no comm hook of ours times them (FSDP, the job's own hook, NCCL)."""
    return bool(frames) and "/torch/" in frames[-1].f_code.co_filename.replace("\\", "/") and any(
        "/torch/autograd/" in f.f_code.co_filename.replace("\\", "/") for f in frames)


# What a collective says when a peer's process is gone (gloo closes its connections at once).
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|EPIPE|"
                        r"Socket closed|Connection refused", re.IGNORECASE)


def peer_gone(exc: BaseException) -> bool:
    """The error a collective raises when a peer died or left, rather than the user's own."""
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or (
        isinstance(exc, RuntimeError) and bool(_PEER_GONE.search(str(exc))))


@dataclass(frozen=True)
class RankRecord:
    """What one rank knows of itself when a step hangs; JSON through the store."""

    rank: int
    step: int
    pid: int
    host: str
    collective: str  # "" when outside any collective: in the user's own code
    user_frame: str  # "train.py:57 in train" (the full path): the user's line the rank is at
    stack: list[str] = field(default_factory=list)
    error: str = ""  # the collective failed (a peer's connection closed) instead of hanging
    left: bool = False  # this rank's loop had ended (close() ran) when the others hung
    deadline: dict[str, Any] = field(default_factory=dict)  # how this rank's allowance was set

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> "RankRecord":
        return cls(**json.loads(text))


def describe(frames: list[tuple[FrameType, int]], limit: int = 16) -> tuple[str, list[str]]:
    """The innermost user frame ("file:line in function") and the stack's last lines, from
    (frame, line) pairs outermost first (a traceback's line is not its frame's current one)."""
    summaries = traceback.StackSummary.extract(iter(frames), capture_locals=False)
    user = next((s for s in reversed(summaries) if is_user_file(s.filename)), None)
    where = f"{user.filename}:{user.lineno} in {user.name}" if user is not None else "unknown"
    lines = "".join(summaries.format()[-limit:]).rstrip().splitlines()
    return where, lines


def process_state(pid: int) -> str:
    """A process on this host, from /proc: "gone" (exited, or a zombie), "frozen" (stopped, SIGSTOP),
    "alive", or "unknown" (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "unknown"
    return {"Z": "gone", "X": "gone", "T": "frozen", "t": "frozen"}.get(state, "alive")


@dataclass(frozen=True)
class Absent:
    """A rank that sent no record: its fate as seen from here."""

    rank: int
    how: str  # dead | frozen | silent (alive, or on another host, and not answering)
    pid: Optional[int] = None
    host: str = ""
    step: Optional[int] = None  # the step it left the loop after (close() ran), if it did
    left: bool = False


def _rank_list(ranks: list[int]) -> str:
    return ",".join(map(str, sorted(ranks)))


def absent_rank(store: Any, rank: int, here: str) -> Absent:
    """A rank that sent nothing, as the rank on host `here` sees it through the job's store: the pid and host it
    published at start (keys.callback_pid), the step it left the loop after if it did, and its fate (a process on
    this host gone or stopped is known from /proc; one elsewhere is only silent). Shared by the hang's exchange
    and the end of the run's (callback/final_check.py)."""
    pid, host, left = None, "", None
    if store.check([keys.callback_pid(rank)]):
        raw = json.loads(store.get(keys.callback_pid(rank)))
        pid, host = int(raw["pid"]), str(raw["host"])
    if store.check([keys.callback_left(rank)]):
        left = int(store.get(keys.callback_left(rank)))
    how = process_state(pid) if host == here and pid is not None else "unknown"
    how = {"gone": "dead", "frozen": "frozen"}.get(how, "silent")
    return Absent(rank, how, pid, host, left, left=left is not None)


@dataclass(frozen=True)
class Verdict:
    """The same finding for every rank: causes, victims, and each rank's whereabouts."""

    culprits: dict[int, str]  # rank -> how: own code | dead | frozen | silent | left | desync | transport
    victims: list[int]
    records: dict[int, RankRecord]
    absent: dict[int, Absent]
    written_by: int

    def to_json(self) -> str:
        return json.dumps({"culprits": {str(r): h for r, h in self.culprits.items()}, "victims": self.victims,
                           "records": {str(r): asdict(v) for r, v in self.records.items()},
                           "absent": {str(r): asdict(a) for r, a in self.absent.items()},
                           "written_by": self.written_by})

    @classmethod
    def from_json(cls, text: bytes | str) -> "Verdict":
        raw = json.loads(text)
        return cls({int(r): h for r, h in raw["culprits"].items()}, list(raw["victims"]),
                   {int(r): RankRecord(**v) for r, v in raw["records"].items()},
                   {int(r): Absent(**a) for r, a in raw["absent"].items()}, int(raw["written_by"]))


def judge(records: dict[int, RankRecord], absent: dict[int, Absent], written_by: int) -> Verdict:
    """The first-cause rule on the ranks' records.

    Causes, first found first: ranks that sent nothing (dead, frozen, silent) or whose loop had
    ended, and ranks outside any collective (stuck in their own code). With none, every rank is
    in a collective: those in another collective or step than the rest are the cause (a desync;
    with two ranks, the one not in DDP's gradient all-reduce, the loop's own collective); all in
    the same one is the transport. Every other rank is a victim."""
    culprits = {r: ("left" if a.left else a.how) for r, a in absent.items()}
    culprits.update({r: "left" for r, rec in records.items() if rec.left})
    culprits.update({r: "own code" for r, rec in records.items() if not rec.left and not rec.collective})
    if not culprits:
        culprits = {r: "desync" for r in _desynced(records)} or {r: "transport" for r in records}
    return Verdict(dict(sorted(culprits.items())), sorted(r for r in records if r not in culprits),
                   dict(sorted(records.items())), dict(sorted(absent.items())), written_by)


def _desynced(records: dict[int, RankRecord]) -> list[int]:
    """The ranks apart from the majority's (collective, step); on a tie, those not in DDP's all-reduce."""
    calls = {r: (rec.collective, rec.step) for r, rec in records.items()}
    counts = Counter(calls.values())
    if len(counts) < 2:
        return []
    top = max(counts.values())
    majority = [call for call, n in counts.items() if n == top]
    if len(majority) == 1:
        return sorted(r for r, call in calls.items() if call != majority[0])
    odd = sorted(r for r, call in calls.items() if not call[0].startswith(DDP_ALLREDUCE))
    return odd if 0 < len(odd) < len(calls) else sorted(calls)


def _how_said(rank: int, how: str, v: Verdict) -> str:
    rec, gone = v.records.get(rank), v.absent.get(rank)
    host = rec.host if rec else (gone.host if gone and gone.host else "?")
    who = f"rank {rank} ({host})"
    if how == "own code":
        return f"{who} is stuck in its own code at {_short(rec.user_frame if rec else '')}"
    if how == "left":
        step = rec.step if rec else (gone.step if gone else None)
        return f"{who} left the training loop" + (f" after step {step}" if step is not None else "")
    if how == "dead":
        return f"{who} died (process {gone.pid if gone else '?'} is gone)"
    if how == "frozen":
        return f"{who} is frozen (process {gone.pid if gone else '?'} is stopped, as by SIGSTOP)"
    if how == "silent":
        return f"{who} did not answer (dead or frozen, on another host or without a process state)"
    if how == "desync" and rec:
        return f"{who} is in {rec.collective or 'no collective'} at step {rec.step}, at {_short(rec.user_frame)}"
    return f"{who} is in {rec.collective if rec else '?'}"


def _short(where: str) -> str:
    """`.../tests/ranks/hang_loop.py:57 in train` as `hang_loop.py:57 in train` for the title."""
    path, _, rest = where.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else where


def _waiting_said(rec: RankRecord) -> str:
    text = f"waiting in {rec.collective} at step {rec.step}, at {rec.user_frame}"
    return text + (f": the collective failed: {rec.error[:200]}" if rec.error else "")


def verdict_finding(v: Verdict) -> Finding:
    """DOC007 naming the cause, its victims as `affected_ranks`: the finding every rank reports."""
    step = max((rec.step for rec in v.records.values()), default=0)
    causes = "; ".join(_how_said(r, how, v) for r, how in v.culprits.items())
    if all(how == "transport" for how in v.culprits.values()):
        title = f"Step {step} hung with every rank inside {next(iter(v.records.values())).collective}: " \
                "the collective itself did not complete"
    else:
        title = f"Step {step} hung: {causes}" + (
            f"; rank {_rank_list(v.victims)} waited for it" if v.victims else "")
    hosts = {r: rec.host for r, rec in v.records.items()} | {r: a.host for r, a in v.absent.items() if a.host}
    evidence: dict[str, Any] = {
        "cause_by_rank": {str(r): how for r, how in v.culprits.items()},
        "affected_ranks": {str(r): _waiting_said(v.records[r]) for r in v.victims},
        "user_frame_by_rank": {str(r): rec.user_frame for r, rec in v.records.items()},
        "state_by_rank": {str(r): rec.collective or ("left the loop" if rec.left else "own code")
                          for r, rec in v.records.items()} | {str(r): a.how for r, a in v.absent.items()},
        "step_by_rank": {str(r): rec.step for r, rec in v.records.items()},
        "deadline_by_rank": {str(r): {k: rec.deadline.get(k) for k in ("allowance_s", "rule")}
                             for r, rec in v.records.items() if rec.deadline},
        "pid_by_rank": {str(r): rec.pid for r, rec in v.records.items()}
                       | {str(r): a.pid for r, a in v.absent.items() if a.pid is not None},
        **{f"python_stack_rank_{r}": rec.stack for r, rec in v.records.items()},
        "flight_recorder": ("on NCCL, set TORCH_FR_BUFFER_SIZE=2000 (TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.8)"
                            " and TORCH_NCCL_DUMP_ON_TIMEOUT=1 to have torch's Flight Recorder dump what every rank "
                            "was in; then `ddpdoctor explain` the dumps"),
        "judged_by_rank": v.written_by}
    culprits = tuple(v.culprits)
    return codes.finding("DOC007", PROBE, title, ranks=culprits,
                         nodes=tuple(sorted({hosts[r] for r in culprits if hosts.get(r)})), evidence=evidence)


class Exchange:
    """The hang's records, traded through the job's store under one episode's keys.

    `store` is any object with torch's Store set/get/check; every wait has a deadline, and a
    rank that never answers costs at most COLLECT_S."""

    def __init__(self, store: Any, rank: int, world: int, episode: int, host: str,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.store, self.rank, self.world, self.episode, self.host = store, rank, world, episode, host
        self.clock, self.sleep = clock, sleep

    def started(self) -> bool:
        """A peer began this episode's exchange (so this rank, even between steps, should answer)."""
        return bool(self.store.check([keys.callback_hang_started(self.episode)]))

    def publish(self, record: RankRecord) -> None:
        self.store.set(keys.callback_hang(self.episode, self.rank), record.to_json())
        self.store.set(keys.callback_hang_started(self.episode), str(self.rank))

    def collect(self, wait_s: float = COLLECT_S) -> tuple[dict[int, RankRecord], dict[int, Absent]]:
        """Every rank's record, or, for one that sent none by the deadline, its fate: a process on
        this host that is gone or stopped is known at once; the others are waited for."""
        end = self.clock() + wait_s
        records: dict[int, RankRecord] = {}
        while True:
            absent: dict[int, Absent] = {}
            for r in range(self.world):
                if r in records:
                    continue
                key = keys.callback_hang(self.episode, r)
                if self.store.check([key]):
                    records[r] = RankRecord.from_json(self.store.get(key))
                else:
                    absent[r] = self._absent(r)
            if not [a for a in absent.values() if a.how == "silent"] or self.clock() >= end:
                return records, absent
            self.sleep(0.1)

    def _absent(self, rank: int) -> Absent:
        return absent_rank(self.store, rank, self.host)

    def decide(self, records: dict[int, RankRecord], absent: dict[int, Absent]) -> Verdict:
        """The lowest rank that answered writes the verdict; the others read it (or, if it never
        comes, judge the same way from what they collected)."""
        key = keys.callback_hang_verdict(self.episode)
        writer = min(records, default=self.rank)
        if writer == self.rank:
            verdict = judge(records, absent, self.rank)
            self.store.set(key, verdict.to_json())
            return verdict
        end = self.clock() + COLLECT_S + 2.0
        while self.clock() < end:
            if self.store.check([key]):
                return Verdict.from_json(self.store.get(key))
            self.sleep(0.1)
        return judge(records, absent, self.rank)

    def reported(self) -> None:
        self.store.set(keys.callback_hang_reported(self.episode, self.rank), "1")

    def wait_reported(self, ranks: list[int], wait_s: float) -> None:
        """The culprit waits (bounded) until its victims have written the verdict down."""
        wanted = [keys.callback_hang_reported(self.episode, r) for r in ranks]
        end = self.clock() + wait_s
        while wanted and self.clock() < end and not self.store.check(wanted):
            self.sleep(0.1)

    def leaving(self) -> None:
        self.store.set(keys.callback_hang_leaving(self.episode, self.rank), "1")

    def wait_gone(self, verdict: Verdict, wait_s: float = CULPRIT_EXIT_GRACE_S) -> None:
        """A victim waits (bounded) until every culprit that can exit has: its process gone on this
        host, or its "leaving" key set elsewhere; then a little more, so the launcher sees it first."""
        pending = [r for r, how in verdict.culprits.items() if how in CAN_EXIT and r != self.rank]
        end = self.clock() + wait_s
        while pending and self.clock() < end:
            pending = [r for r in pending if not self._gone(r, verdict)]
            self.sleep(0.1)
        if not pending:
            self.sleep(AFTER_CULPRIT_S)

    def _gone(self, rank: int, verdict: Verdict) -> bool:
        rec = verdict.records.get(rank)
        pid, host = (rec.pid, rec.host) if rec else (verdict.absent[rank].pid, verdict.absent[rank].host)
        if host == self.host and pid is not None and process_state(pid) in ("gone", "frozen"):
            return True
        return bool(self.store.check([keys.callback_hang_leaving(self.episode, rank)]))
