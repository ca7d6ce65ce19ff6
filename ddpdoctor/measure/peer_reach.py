"""Can the nodes open TCP connections to each other, apart from the rendezvous store? Tried before init.

Why: the store's port is the one port a cluster's firewall is usually opened for (it is in the job
script: MASTER_PORT, --rdzv-endpoint). Every rank then reaches the store and arrives, and the job
hangs or fails afterwards, in the process group's init or its first collective, because gloo and
NCCL connect rank to rank on ports the system picks (above 1024, a new one each run) and the
firewall drops or rejects those. What the ranks then report is the consequence, a collective that
timed out on every rank; the cause is one TCP connection that never opens, and it can be tried
directly in well under a second.

How: each node's first rank (local rank 0) listens on a port the system picks, on every address,
and says in its hello where it can be reached: the address its route to MASTER_ADDR leaves from
(where the other nodes' traffic comes to it; never a loopback one). After the rendezvous, every
node's first rank dials the MAX_DIALS nodes after it (every other node up to that many), in
parallel, DIAL_TIMEOUT_S each: no node is dialled by more than MAX_DIALS nodes, below the listen
backlog. Where a node's *_SOCKET_IFNAME selects an interface whose IPv4 address is not its route's,
that address is dialled too (on the same listener): the backend binds there and its peers connect
to it (INIT006). The kernel completes a TCP handshake into the backlog without an accept(), so nothing has
to serve the connections. One node: not tried.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from dataclasses import dataclass, field
from typing import Optional

DIAL_TIMEOUT_S = 2.0
MAX_DIALS = 64  # other nodes a node dials at most: the 64 after it (a larger job is tried in a band)
# Addresses a node is dialled at: its route's, and one for each *_SOCKET_IFNAME that selects another.
ADDRESSES_PER_NODE = 3
BACKLOG = 256  # above MAX_DIALS * ADDRESSES_PER_NODE: every handshake fits the queue while nothing accepts

OK = "ok"


@dataclass(frozen=True)
class ReachFrom:
    """Where the other nodes may dial this node: the address its route to the store leaves from, and for
    each *_SOCKET_IFNAME set, the interface it selects first and that interface's address (where the
    backend binds and what it tells its peers to connect to); and this node's own IPv4 addresses, which
    it never dials at another node (it would reach itself)."""

    source: Optional[str] = None
    ifnames: dict[str, tuple[str, str]] = field(default_factory=dict)  # variable -> (interface, address)
    own: frozenset[str] = frozenset()


def listen() -> Optional[socket.socket]:
    """A listening socket on a port the system picks, every address; None where none can be made."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("", 0))
        sock.listen(BACKLOG)
        return sock
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def describe(exc: BaseException) -> str:
    """A failed dial in the words users search for, with what each usually means."""
    if isinstance(exc, socket.timeout) or getattr(exc, "errno", None) in (errno.ETIMEDOUT, errno.EAGAIN):
        return "timed out: no answer (a firewall drops the packets)"
    code = getattr(exc, "errno", None)
    if code == errno.ECONNREFUSED:
        return "Connection refused (a firewall rejects the port, or nothing listens there)"
    if code == errno.EHOSTUNREACH:
        return "No route to host (a firewall rejects with icmp-host-prohibited, firewalld's default)"
    if code == errno.ENETUNREACH:
        return "Network is unreachable (no route to that address)"
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    return f"{name or type(exc).__name__}: {exc}"


def dial(addr: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> str:
    """OK, or why one TCP connection to addr:port did not open within timeout_s."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return OK
    except OSError as exc:
        return describe(exc)


def dial_all(targets: dict[str, tuple[str, int]], timeout_s: float = DIAL_TIMEOUT_S) -> dict[str, str]:
    """Each target (a name: address and port) dialled in parallel; never longer than timeout_s and a little."""
    chosen = dict(list(targets.items())[:MAX_DIALS * ADDRESSES_PER_NODE])  # the caller's order and cap (nodes)
    out: dict[str, str] = {}
    lock = threading.Lock()

    def one(name: str, addr: str, port: int) -> None:
        result = dial(addr, port, timeout_s)
        with lock:
            out[name] = result

    threads = [threading.Thread(target=one, args=(n, a, p), name="ddpdoctor-dial", daemon=True)
               for n, (a, p) in chosen.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1.0)
    with lock:
        return {n: out.get(n, "timed out: no answer (a firewall drops the packets)") for n in chosen}
