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
from typing import Any, Callable, Optional

from ddpdoctor.findings import Finding, Severity

log = logging.getLogger("ddpdoctor")
PREFIX = "ddpdoctor/watch/"
LEAVE_WAIT_S = 5.0


class Watch:
    """The running watch: `finding` is set once the deadline passed without a process group."""

    def __init__(self, timeout_s: float, on_finding: Optional[Callable[[Finding], None]], json_path: Optional[str],
                 on_hang: str, environ: dict[str, str]) -> None:
        self.timeout_s = timeout_s
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
        rank, addr, port = int(self.env["RANK"]), self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"])
        world = int(self.env["WORLD_SIZE"])
        deadline = time.monotonic() + self.timeout_s
        last_read = 0.0
        while not self._done.is_set() and time.monotonic() < deadline:
            if self._initialised():
                return
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
        if self._store is not None:
            self._read_arrivals(world)
        self.finding = self._diagnose(rank, addr, port)
        self._emit(self.finding)

    def _read_arrivals(self, world: int) -> None:
        try:
            for r in range(world):
                key = f"{PREFIX}{r}"
                if r not in self._arrived and self._store.check([key]):
                    self._arrived[r] = json.loads(self._store.get(key)).get("host", "?")
        except Exception:  # the store went away: keep what was read
            pass

    def _mark(self, rank: int) -> None:
        try:
            self._store.set(f"{PREFIX}{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                           "t": time.time()}))
            self.arrived_at_store = True
        except Exception:
            self._store = None

    def _diagnose(self, rank: int, addr: str, port: int) -> Finding:
        from ddpdoctor.net_facts import wait_for_port

        world = int(self.env["WORLD_SIZE"])
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
        return Finding(
            code="WATCH001", severity=Severity.CRITICAL, probe="watch", title=title,
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
            from ddpdoctor.report import atomic_write_json

            try:
                atomic_write_json({"rank": int(self.env["RANK"]), "findings": [finding.to_json()]},
                                  f"{self.json_path}.rank{self.env['RANK']}")
            except OSError as exc:
                log.error("ddpdoctor: cannot write %s: %s", self.json_path, exc)
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception:
                log.exception("ddpdoctor: on_finding raised")
        if self.on_hang == "exit":
            self._leave()
            os._exit(124)

    def _leave(self) -> None:
        """Rank 0 hosts the store: the other ranks that reached it say their piece before it goes."""
        rank = int(self.env["RANK"])
        if self._store is None:
            return
        try:
            self._store.set(f"{PREFIX}reported/{rank}", "1")
            if rank == 0:
                others = [f"{PREFIX}reported/{r}" for r in self._arrived if r != 0]
                end = time.monotonic() + LEAVE_WAIT_S
                while others and time.monotonic() < end and not self._store.check(others):
                    time.sleep(0.1)
        except Exception:
            pass


def _in_init() -> bool:
    """The main thread is inside torch's init_process_group: this rank has arrived."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _main_frame() -> str:
    """The main thread's innermost frame outside the standard library: where it is stuck."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost = None
    while frame is not None:
        code = frame.f_code
        if innermost is None and "/lib/python" not in code.co_filename:
            innermost = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return innermost or "unknown"


def _ranges(ranks: list[int]) -> str:
    from ddpdoctor.findings import rank_ranges

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
          json_path: Optional[str] = None, on_hang: str = "report") -> Optional[Watch]:
    """Start watching this rank's way to `init_process_group`; None when the job is not launched with
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (mp.spawn jobs set them in code: call it after)."""
    if on_hang not in ("report", "exit"):
        raise ValueError(f"on_hang must be 'report' or 'exit', not {on_hang!r}")
    environ = dict(os.environ)
    if not all(environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        log.info("ddpdoctor.watch: RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT not set; nothing to watch")
        return None
    try:
        int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
    except ValueError:
        log.warning("ddpdoctor.watch: RANK, WORLD_SIZE and MASTER_PORT must be whole numbers; nothing to watch")
        return None
    return Watch(timeout_s, on_finding, json_path, on_hang, environ).start()
