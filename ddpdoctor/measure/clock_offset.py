"""How far each host's wall clock is from rank 0's, measured through the store.

Arrival times at a collective are compared across hosts, and two hosts' clocks may
differ by more than a whole training step (NTP keeps them within milliseconds at best,
and a host without it drifts by seconds). One leader per host plays ping-pong with
rank 0 through the out-of-band store, as NTP does with a server: the offset is the
midpoint of the leader's send and receive minus rank 0's stamp (this host's clock minus
rank 0's), good to half the round trip, and the round with the shortest trip wins. Ranks on one host share a clock and the
leader's figure. No collective is used, so a broken backend cannot spoil the correction.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ddpdoctor.core import keys

ROUNDS = 5


@dataclass(frozen=True)
class ClockOffset:
    offset_s: float  # this host's clock minus rank 0's: subtract it to get rank 0's time
    error_s: float  # half the shortest round trip: the offset is good to this
    source: str  # "rank 0's host" | "ping-pong with rank 0" | why it is unknown

    def to_json(self) -> dict[str, Any]:
        known = self.error_s != float("inf")
        return {"offset_ms": round(self.offset_s * 1e3, 4) if known else None,
                "error_ms": round(self.error_s * 1e3, 4) if known else None, "source": self.source}


def host_leaders(hosts: Mapping[int, str]) -> dict[str, int]:
    """The lowest rank of each host."""
    leaders: dict[str, int] = {}
    for rank in sorted(hosts):
        leaders.setdefault(hosts[rank], rank)
    return leaders


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], datetime.timedelta(seconds=max(0.001, timeout_s)))
        return True
    except Exception:  # the store's own timeout, or the store is gone
        return False


def serve(store: Any, rank: int, hosts: Mapping[int, str], timeout_s: float,
          clock: Callable[[], float] = time.time) -> list[int]:
    """Rank 0: answer every other host's leader; returns the leaders that never pinged."""
    deadline = time.monotonic() + timeout_s
    silent = []
    for host, leader in host_leaders(hosts).items():
        if host == hosts.get(rank):
            continue
        for i in range(ROUNDS):
            if not _wait(store, keys.clock_ping(leader, i), deadline - time.monotonic()):
                silent.append(leader)
                break
            store.set(keys.clock_pong(leader, i), repr(clock()))
    return silent


def measure(store: Any, rank: int, hosts: Mapping[int, str], timeout_s: float,
            clock: Callable[[], float] = time.time) -> ClockOffset:
    """This rank's offset to rank 0. Rank 0 must be in `serve` meanwhile."""
    me, zero = hosts.get(rank), hosts.get(0)
    if me is not None and me == zero:
        return ClockOffset(0.0, 0.0, "rank 0's host")
    leader = host_leaders(hosts).get(me, rank) if me is not None else rank
    deadline = time.monotonic() + timeout_s
    if leader != rank:
        if not _wait(store, keys.clock_result(leader), deadline - time.monotonic()):
            return ClockOffset(0.0, float("inf"), f"no figure from this host's leader, rank {leader}")
        offset_s, error_s = (float(x) for x in store.get(keys.clock_result(leader)).decode().split())
        if error_s == float("inf"):
            return ClockOffset(0.0, error_s, f"rank 0 did not answer this host's leader, rank {leader}")
        return ClockOffset(offset_s, error_s, f"ping-pong with rank 0 (by rank {leader})")
    best: Optional[tuple[float, float]] = None
    for i in range(ROUNDS):
        sent = clock()
        store.set(keys.clock_ping(rank, i), "1")
        if not _wait(store, keys.clock_pong(rank, i), deadline - time.monotonic()):
            break
        received = clock()
        stamp = float(store.get(keys.clock_pong(rank, i)).decode())
        trip = received - sent
        if best is None or trip < 2 * best[1]:
            best = (stamp - (sent + received) / 2.0, trip / 2.0)
    if best is None:
        store.set(keys.clock_result(rank), "0 inf")
        return ClockOffset(0.0, float("inf"), "rank 0 did not answer")
    # The store gets the local clock minus rank 0's, so subtracting it gives rank 0's time.
    offset_s, error_s = -best[0], best[1]
    store.set(keys.clock_result(rank), f"{offset_s!r} {error_s!r}")
    return ClockOffset(offset_s, error_s, "ping-pong with rank 0")
