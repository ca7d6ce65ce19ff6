"""What a rank's network looks like from where it stands: the rendezvous address, its route, its interfaces.

Read before the rendezvous, so a rank that then hangs or fails to connect has already
said which address it tried, through which interface, and what `*_SOCKET_IFNAME` picks.
Every reading can fail on a locked-down host; a failure is a value (`{"unknown": why}`),
never an exception, because these facts matter most on the machines that are broken.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any, Optional

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _unknown(exc: BaseException) -> dict[str, str]:
    return {"unknown": f"{type(exc).__name__}: {exc}"}


RESOLVE_DEADLINE_S = 3.0
# (addresses, why not when there are none, seconds the lookup took)
Resolution = tuple[list[str], Optional[dict[str, str]], float]


def _getaddrinfo(host: str, port: int, deadline_s: float) -> list[Any]:
    """getaddrinfo with a deadline: a dead nameserver must not hold a rank past its stage's.

    The lookup runs in a daemon thread that is abandoned, not joined, when it overruns.
    """
    import threading

    box: dict[str, Any] = {}

    def lookup() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=lookup, name="ddpdoctor-resolve", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise TimeoutError(f"no answer from the resolver within {deadline_s:g}s")
    if "error" in box:
        raise box["error"]
    return list(box["infos"])


def resolve(host: str, port: int, deadline_s: float = RESOLVE_DEADLINE_S) -> Resolution:
    """The addresses `host` resolves to here (IPv4 first, as the store client tries them)."""
    t0 = time.monotonic()
    try:
        infos = _getaddrinfo(host, port, deadline_s)
    except (OSError, UnicodeError) as exc:
        said = getattr(exc, "strerror", None) or str(exc)
        return [], {"unknown": f"{type(exc).__name__}: {said}"}, time.monotonic() - t0
    addrs = list(dict.fromkeys(str(i[4][0]) for i in sorted(infos, key=lambda i: i[0] != socket.AF_INET)))
    return addrs, None, time.monotonic() - t0


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def interfaces() -> dict[str, dict[str, Any]]:
    """Name → up, addresses, speed; loopback included (it is what a bad hosts file picks)."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, dict[str, Any]] = {}
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        st = stats.get(name)
        out[name] = {
            "up": bool(st.isup) if st else None,
            "ipv4": [a.address for a in addrs if a.family == socket.AF_INET],
            "ipv6": [a.address for a in addrs if a.family == getattr(socket, "AF_INET6", None)],
            "speed_mbps": st.speed if st and st.speed else None,
        }
    return out


def route_to(addr: str, port: int, ifaces: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The interface the kernel would send to `addr` through: a UDP connect sends nothing, only routes."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, port or 9))
            source = str(s.getsockname()[0])
    except OSError as exc:
        return _unknown(exc)
    names = [n for n, i in ifaces.items() if source in i["ipv4"] or source in (a.split("%")[0] for a in i["ipv6"])]
    return {"source": source, "interface": names[0] if names else None}


def ifname_matches(spec: str, names: list[str], exact_only: bool = False) -> list[str]:
    """The interfaces a `*_SOCKET_IFNAME` value selects, by NCCL's rules.

    NCCL: comma-separated prefixes; `=` before the list makes them exact names; `^` makes
    it an exclude list. Gloo takes exact names, comma-separated (`exact_only`).
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = exact_only or spec.startswith("=")
    spec = spec[1:] if spec.startswith("=") else spec
    wanted = [w.strip() for w in spec.split(",") if w.strip()]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def ifname_facts(environ: dict[str, str], ifaces: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each IFNAME variable set: its value and the up interfaces with an address that it selects."""
    usable = [n for n, i in ifaces.items() if i.get("up") is not False and (i["ipv4"] or i["ipv6"])]
    out = {}
    for var in IFNAME_VARS:
        value = environ.get(var)
        if value is None or not value.strip():
            continue
        out[var] = {"value": value, "selects": ifname_matches(value, usable, exact_only=var.startswith("GLOO"))}
        if var.startswith("GLOO"):  # gloo opens a device per listed name: one missing name fails it all
            out[var]["missing"] = [n.strip() for n in value.split(",") if n.strip() and n.strip() not in usable]
    return out


def hostname_addresses(hostname: str) -> tuple[list[str], Optional[dict[str, str]]]:
    """What this host's own name resolves to: gloo binds there when GLOO_SOCKET_IFNAME is unset."""
    addrs, problem, _ = resolve(hostname, 0)
    return addrs, problem


def wait_for_port(addr: str, port: int, deadline_s: float, dial: Optional[str] = None) -> Optional[str]:
    """Dial until `addr:port` accepts or the deadline passes; None, or why it never did.

    Done with plain sockets before the store client, whose own retries overrun its
    timeout by a back-off; this way the deadline holds and the reason is the last errno.
    `dial`: the address `addr` already resolved to, if the caller looked it up.
    """
    import errno

    end = time.monotonic() + deadline_s
    target = dial
    if target is None:
        resolved, problem, _ = resolve(addr, port, max(0.1, min(RESOLVE_DEADLINE_S, deadline_s)))
        if not resolved:  # resolved once, then dialled by address: the deadline holds
            return f"{addr} does not resolve ({(problem or {}).get('unknown')})"
        target = resolved[0]
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection((target, port), timeout=max(0.05, min(1.0, left))):
                return None
        except socket.timeout:
            reason = (f"no answer from {addr}:{port} (a firewall drops the packets, or MASTER_ADDR is not the "
                      "host where rank 0 runs)")
        except ConnectionRefusedError:
            reason = (f"connection refused at {addr}:{port} (nothing listens there: rank 0 is not running, or "
                      "it listens on another port; compare MASTER_PORT on every node)")
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                reason = f"no route to {addr} ({exc.strerror}: MASTER_ADDR is on a network this node cannot reach)"
            else:
                reason = f"connecting to {addr}:{port} failed ({exc.strerror or exc})"
        if time.monotonic() + 0.2 >= end:
            return reason
        time.sleep(0.2)
