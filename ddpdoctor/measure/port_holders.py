"""Which process, outside this job, already listens on a TCP port of this host.

Two jobs on one node with the same hard-coded MASTER_PORT (the mp.spawn tutorials hard-code
12355) collide: the second one's rank 0 cannot host its store. The error says only
"address already in use"; naming the process that holds the port, with its command line,
tells the user which job it is. Our own process and its ancestors (torchrun's agent hosts
the store of the ranks it starts) are this job, not a conflict.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, Optional

from ddpdoctor.core.redact import redact_text


@dataclass(frozen=True)
class Holder:
    pid: Optional[int]  # None: a process of another user, which this one may not see
    name: str
    cmdline: str
    user: str
    # A worker started by multiprocessing says only "spawn_main(...)": the script that started it
    # is what the user knows the job by.
    job_pid: Optional[int] = None
    job_cmdline: str = ""

    def describe(self) -> str:
        if self.pid is None:
            return "a process of another user"
        if self.job_pid is not None:
            return f"pid {self.pid}, started by pid {self.job_pid} {self.job_cmdline}"[:200]
        return f"pid {self.pid} {self.cmdline or self.name}"[:200]

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "cmdline": self.cmdline, "user": self.user,
                "job_pid": self.job_pid, "job_cmdline": self.job_cmdline}


def _ancestors() -> set[int]:
    import psutil

    pids = {os.getpid()}
    try:
        pids.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    return pids


def _holder(pid: Optional[int]) -> Holder:
    import psutil

    if pid is None:
        return Holder(None, "", "", "")
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            holder = Holder(pid, proc.name(), redact_text(" ".join(proc.cmdline()))[:400], proc.username())
        starter = proc
        while starter is not None and "multiprocessing" in " ".join(starter.cmdline()):
            starter = starter.parent()
        if starter is not None and starter.pid != pid:
            return replace(holder, job_pid=starter.pid, job_cmdline=redact_text(" ".join(starter.cmdline()))[:400])
        return holder
    except psutil.Error:
        return Holder(pid, "", "", "")


def foreign_listeners(port: int) -> list[Holder]:
    """Processes other than this one and its ancestors listening on `port` (any address)."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):  # not permitted here (macOS without root): nothing can be said
        return []
    ours = _ancestors()
    pids = sorted({c.pid for c in connections
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid not in ours},
                  key=lambda p: (p is None, p or 0))
    return [_holder(pid) for pid in pids]


def is_local_address(addr: str) -> bool:
    """MASTER_ADDR names this host: loopback, one of its interfaces' addresses, or its host name.

    No DNS lookup: a rendezvous name that needs one is taken as another host (a lookup can
    block for the resolver's timeout, and this runs before the user's init_process_group)."""
    import psutil

    text = addr.strip().strip("[]")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        name = text.lower().rstrip(".")
        hostname = socket.gethostname().lower()
        return name in ("localhost", hostname, hostname.split(".")[0])
    if ip.is_loopback or ip.is_unspecified:
        return True
    try:
        mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except (psutil.Error, OSError):
        return False
    return str(ip) in mine
