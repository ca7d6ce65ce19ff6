"""`ddpdoctor.watch()`: an init or rendezvous hang in the user's own job, diagnosed.

Called at the top of a training script, before `init_process_group`. Frameworks' callbacks
start after the process group exists, so a job that never gets there is silent for NCCL's
or the store's timeout (10 to 30 minutes) and then dies with "Timed out after ... clients
joined". Here a daemon thread marks this rank's arrival in the job's own rendezvous store
(under `ddpdoctor/watch/`, as a client that does not count as a worker) as soon as the
store answers, and if `init_process_group` has not returned by the deadline it says what
it can see: whether MASTER_ADDR resolves and MASTER_PORT answers (refused, no answer, no
route), and which ranks arrived at the store and which never did, with their hosts.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from ddpdoctor.core.exits import STAGE_TIMEOUT_EXIT, hard_exit
from ddpdoctor.core import codes, keys
from ddpdoctor.core.findings import Finding
from ddpdoctor.runtime.liveness import main_thread_frame

log = logging.getLogger("ddpdoctor")
LEAVE_WAIT_S = 5.0


@dataclass(frozen=True)
class Target:
    """Who this rank is and where its rendezvous is; None until known."""

    rank: Optional[int]
    world_size: Optional[int]
    addr: Optional[str]
    port: Optional[int]

    def complete(self) -> bool:
        return None not in (self.rank, self.world_size, self.addr, self.port)

    def merge(self, other: "Target") -> "Target":
        """What is known here wins: explicit arguments over the environment over the call."""
        return replace(self, **{k: v for k, v in other.__dict__.items() if getattr(self, k) is None and v is not None})


def _whole(text: Any, low: int = 0) -> Optional[int]:
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        return None
    return value if value >= low else None


def target_from_env(env: dict[str, str]) -> Target:
    port = _whole(env.get("MASTER_PORT"), 1)
    return Target(_whole(env.get("RANK")), _whole(env.get("WORLD_SIZE"), 1), env.get("MASTER_ADDR") or None,
                  port if port is not None and port < 65536 else None)


def target_from_call(arguments: dict[str, Any]) -> Target:
    """From init_process_group(backend, init_method, timeout, world_size, rank, ...)'s arguments
    (-1 is its "not given"); a tcp:// init_method names the rendezvous itself."""
    addr = port = None
    method = arguments.get("init_method")
    if isinstance(method, str) and method.startswith("tcp://"):
        try:
            parts = urlsplit(method)
            addr, port = parts.hostname, parts.port
        except ValueError:
            pass
    return Target(_whole(arguments.get("rank")), _whole(arguments.get("world_size"), 1), addr, port)


def _init_call_arguments() -> dict[str, Any]:
    """The local variables of torch's init_process_group in the main thread's stack (its arguments)."""
    frame = main_thread_frame()
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "distributed" in frame.f_code.co_filename:
            names = ("rank", "world_size", "init_method")
            return {k: frame.f_locals.get(k) for k in names}
        frame = frame.f_back
    return {}


class Watch:
    """The running watch: `finding` is set once the deadline passed without a process group."""

    def __init__(self, timeout_s: float, on_finding: Optional[Callable[[Finding], None]], json_path: Optional[str],
                 on_hang: str, environ: dict[str, str], rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
        self.timeout_s = timeout_s
        self.target = Target(rank, world_size, None, None)
        self.given_world_size = world_size is not None and world_size > 1
        self.on_finding = on_finding
        self.json_path = json_path
        self.on_hang = on_hang
        self.env = environ
        self.finding: Optional[Finding] = None
        self.arrived_at_store = False
        self._store: Any = None
        self._arrived: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-watch", daemon=True)

    def start(self) -> "Watch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    # -- the thread -----------------------------------------------------------------
    def _initialised(self) -> bool:
        if "torch.distributed" not in sys.modules:
            return False
        dist = sys.modules["torch.distributed"]
        try:  # the main thread may be importing it right now
            return bool(dist.is_available() and dist.is_initialized())
        except AttributeError:
            return False

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # a watch that dies must say so, not leave the job unwatched in silence
            log.warning("ddpdoctor.watch stopped: %s: %s", type(exc).__name__, exc)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        last_read = 0.0
        while not self._done.is_set() and time.monotonic() < deadline:
            if self._initialised():
                return
            if not self.target.complete():
                self._resolve()
                if not self.target.complete():
                    self._done.wait(0.25)
                    continue
            rank, world = int(self.target.rank), int(self.target.world_size)  # type: ignore[arg-type]
            addr, port = str(self.target.addr), int(self.target.port)  # type: ignore[arg-type]
            if self._store is None:
                self._store = _client(addr, port)
            if self._store is not None and not self.arrived_at_store and _in_init():
                self._mark(rank)
            if self._store is not None and time.monotonic() - last_read >= 2.0:
                # Read who arrived while the store is up: rank 0 hosts it and may be gone at the deadline.
                self._read_arrivals(world)
                last_read = time.monotonic()
            self._done.wait(0.25)
        if self._done.is_set() or self._initialised():
            return
        if not self._a_rank_of_a_job():
            log.info("ddpdoctor.watch: no process group after %g s, and nothing says this process is one of "
                     "several ranks; not a hang", self.timeout_s)
            return
        if not self.target.complete():
            self.finding = self._unresolved()
        else:
            if self._store is not None:
                self._read_arrivals(int(self.target.world_size))  # type: ignore[arg-type]
            self.finding = self._diagnose(int(self.target.rank), str(self.target.addr),  # type: ignore[arg-type]
                                          int(self.target.port))  # type: ignore[arg-type]
        self._emit(self.finding)

    def _a_rank_of_a_job(self) -> bool:
        """Whether a missing process group here keeps other processes waiting.

        Not for a world of one (torchrun --nproc_per_node=1 running a script that skips
        init_process_group when alone), nor for a process nothing names as a rank: a plain
        script, or mp.spawn's parent, which never calls init_process_group itself, even where
        its script exported WORLD_SIZE. A process multiprocessing started (mp.spawn's worker)
        or one given world_size= is one, named by pid while its rank is unknown."""
        import multiprocessing

        if self.target.world_size == 1:
            return False
        if self.target.rank is not None:
            return True
        return self.given_world_size or multiprocessing.parent_process() is not None

    def _resolve(self) -> None:
        """Fill in what is still unknown: from the environment now (mp.spawn scripts set MASTER_ADDR
        and MASTER_PORT in code), else from the arguments of the init_process_group call the main
        thread is in (rank, world_size and init_method are passed there, not in the environment)."""
        self.target = self.target.merge(target_from_env(dict(os.environ)))
        if not self.target.complete() and _in_init():
            self.target = self.target.merge(target_from_call(_init_call_arguments()))

    def _unresolved(self) -> Finding:
        where = _main_frame()
        host = socket.gethostname()
        rank = self.target.rank
        return codes.finding(
            "WATCH001", "watch",
            (f"{'Rank ' + str(rank) if rank is not None else 'This process (pid ' + str(os.getpid()) + ')'} on "
             f"{host} has not called init_process_group after {self.timeout_s:g} s: stuck at {where}"),
            ranks=(rank,) if rank is not None else (), nodes=(host,),
            evidence={"stuck_at": where, "waited_s": self.timeout_s, "pid": os.getpid(),
                      "known": {k: v for k, v in self.target.__dict__.items() if v is not None}},
            why=("The process never reached init_process_group, so its peers (if they did) wait for it; without "
                 "RANK/WORLD_SIZE in the environment or given to watch(), the rank is known only once it is called."),
            fix=("Look at the stack: the process is stuck before the process group (data loading, a file system, a "
                 "lock). Pass rank= and world_size= to ddpdoctor.watch() to have its peers named too."),
        )

    def _read_arrivals(self, world: int) -> None:
        try:
            for r in range(world):
                key = keys.watch_arrived(r)
                if r not in self._arrived and self._store.check([key]):
                    self._arrived[r] = json.loads(self._store.get(key)).get("host", "?")
        except Exception:  # the store went away: keep what was read
            pass

    def _mark(self, rank: int) -> None:
        try:
            self._store.set(keys.watch_arrived(rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                           "t": time.time()}))
            self.arrived_at_store = True
        except Exception:
            self._store = None

    def _diagnose(self, rank: int, addr: str, port: int) -> Finding:
        from ddpdoctor.measure.net import wait_for_port

        world = int(self.target.world_size)  # type: ignore[arg-type]
        host = socket.gethostname()
        arrived = dict(self._arrived)
        missing = [r for r in range(world) if r not in arrived]
        evidence: dict[str, Any] = {"MASTER_ADDR": addr, "MASTER_PORT": port, "WORLD_SIZE": world,
                                    "waited_s": self.timeout_s}
        if self._store is None:
            reason = wait_for_port(addr, port, 2.0) or f"{addr}:{port} accepts connections but the store did not answer"
            title = f"Rank {rank} on {host} cannot reach the rendezvous at {addr}:{port}: {reason}"
            evidence["why_not_arrived"] = reason
        elif not self.arrived_at_store:
            where = _main_frame()
            title = (f"Rank {rank} on {host} has not called init_process_group after {self.timeout_s:g} s: "
                     f"stuck at {where}; {len(arrived)} of {world} ranks wait for it")
            evidence["stuck_at"] = where
            evidence["arrived"] = {r: h for r, h in sorted(arrived.items())}
            missing = [rank]
        elif missing:
            title = (f"init_process_group has not returned after {self.timeout_s:g} s on rank {rank}: "
                     f"{len(arrived)} of {world} ranks called it; rank {_ranges(missing)} never did")
            evidence["arrived"] = {r: h for r, h in sorted(arrived.items())}
            evidence["never_arrived"] = missing
        else:
            title = (f"init_process_group has not returned after {self.timeout_s:g} s on rank {rank}, though all "
                     f"{world} ranks reached the store: the backend's own connection between them is stuck")
            evidence["arrived"] = {r: h for r, h in sorted(arrived.items())}
        return codes.finding(
            "WATCH001", "watch", title,
            ranks=tuple(missing) or (rank,), nodes=(host,), evidence=evidence,
            why=("Every rank must call init_process_group with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; "
                 "until all have, the ones that did wait (by default for 10 to 30 minutes, silently)."),
            fix=("For ranks that never arrived: check that they started (the launcher's log), that MASTER_ADDR "
                 "resolves and MASTER_PORT is the same on every node, and that no firewall drops the port; run "
                 "`ddpdoctor check` on the same nodes for the full picture (INIT findings). If all arrived: check "
                 "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and the network between the nodes."),
        )

    def _emit(self, finding: Finding) -> None:
        sys.stderr.write(f"ddpdoctor: {finding.title}\n")
        sys.stderr.flush()
        log.warning("ddpdoctor %s %s: %s", finding.severity.label, finding.code, finding.title)
        if self.json_path:
            from ddpdoctor.core.files import atomic_write_json

            try:
                rank = self.target.rank if self.target.rank is not None else f"pid{os.getpid()}"
                atomic_write_json({"rank": self.target.rank, "findings": [finding.to_json()]},
                                  f"{self.json_path}.rank{rank}")
            except OSError as exc:
                log.error("ddpdoctor: cannot write %s: %s", self.json_path, exc)
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception:
                log.exception("ddpdoctor: on_finding raised")
        if self.on_hang == "exit" and finding.code == "WATCH001" and self.target.rank is not None:
            # Never end a process whose rank is unknown: it may be a launcher's parent, not a rank.
            self._leave()
            hard_exit(STAGE_TIMEOUT_EXIT)

    def _leave(self) -> None:
        """Rank 0 hosts the store: the other ranks that reached it say their piece before it goes."""
        rank = self.target.rank
        if self._store is None or rank is None:
            return
        try:
            self._store.set(keys.watch_reported(rank), "1")
            if rank == 0:
                others = [keys.watch_reported(r) for r in self._arrived if r != 0]
                end = time.monotonic() + LEAVE_WAIT_S
                while others and time.monotonic() < end and not self._store.check(others):
                    time.sleep(0.1)
        except Exception:
            pass


def _in_init() -> bool:
    """The main thread is inside torch's init_process_group: this rank has arrived."""
    frame = main_thread_frame()
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _main_frame() -> str:
    """The main thread's innermost frame outside the standard library: where it is stuck."""
    frame = main_thread_frame()
    innermost = None
    while frame is not None:
        code = frame.f_code
        if innermost is None and "/lib/python" not in code.co_filename:
            innermost = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return innermost or "unknown"


def _ranges(ranks: list[int]) -> str:
    from ddpdoctor.core.findings import rank_ranges

    return rank_ranges(ranks)


def _client(addr: str, port: int) -> Any:
    """A client of the job's store that does not count as one of its workers; None while it does not answer."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            pass
    except OSError:
        return None
    # Never import torch here: the main thread may be importing it right now, and a second
    # importer can be handed a half-initialised module. Wait until the script has it.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "TCPStore") or not hasattr(dist, "PrefixStore"):
        return None
    try:
        store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=5), wait_for_workers=False)
        # torchrun's agent store outlives restarts: a restarted job must not see the last attempt's marks.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"attempt{attempt}", store)
    except Exception:
        return None


def watch(timeout_s: float = 300.0, on_finding: Optional[Callable[[Finding], None]] = None,
          json_path: Optional[str] = None, on_hang: str = "report", *, rank: Optional[int] = None,
          world_size: Optional[int] = None) -> Watch:
    """Start watching this rank's way to `init_process_group`.

    The rank, world size and rendezvous are taken from what is given here, else from RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun, srun), else from the arguments of the
    init_process_group call once the main thread is in it (mp.spawn scripts pass rank and
    world_size there and set MASTER_ADDR/MASTER_PORT in code). When the rendezvous is on this
    host and its port is already held by a process outside this job, that is said at once
    (WATCH002): two jobs with the same hard-coded MASTER_PORT."""
    if on_hang not in ("report", "exit"):
        raise ValueError(f"on_hang must be 'report' or 'exit', not {on_hang!r}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (name == "world_size")):
            raise ValueError(f"{name} must be a whole number{' of at least 1' if name == 'world_size' else ''}, "
                             f"not {value!r}")
    running = Watch(timeout_s, on_finding, json_path, on_hang, dict(os.environ), rank, world_size)
    running._resolve()
    conflict = port_conflict(running.target)
    if conflict is not None:
        running._emit(conflict)
    return running.start()


def port_conflict(target: Target) -> Optional[Finding]:
    """WATCH002: the rendezvous port on this host is already listened on by a process outside this job.

    Only the rank that will host the store can tell (rank 0 under mp.spawn or srun; under torchrun
    the agent, our parent, hosts it and is excluded): for any other rank a listener there is
    normally its own job's store."""
    from ddpdoctor.measure.port_holders import foreign_listeners, is_local_address

    if target.port is None or target.addr is None or target.rank != 0 or not is_local_address(target.addr):
        return None
    holders = foreign_listeners(target.port)
    if not holders:
        return None
    host = socket.gethostname()
    named = "; ".join(h.describe() for h in holders[:3])
    return codes.finding(
        "WATCH002", "watch",
        f"MASTER_PORT {target.port} on {host} is already in use by another process ({named}): this job's "
              "rendezvous cannot start there",
        ranks=(0,), nodes=(host,),
        evidence={"MASTER_ADDR": target.addr, "MASTER_PORT": target.port,
                  "held_by": [h.to_json() for h in holders[:3]]},
    )
