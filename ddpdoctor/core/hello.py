"""What a rank says at the rendezvous, as the probes read it (from rank 0's digest).

Why a type: every probe that needs to know where the other ranks are (which host, which pid,
which kernel) used to fish in a dict; the digest carries exactly these fields
(session/rank.py's `_DIGEST_FIELDS`), and the store and the report keep them as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ddpdoctor.core.facts import Facts


@dataclass
class Hello(Facts):
    rank: Optional[int] = None
    host: Optional[str] = None
    # This kernel's boot id and the process's pid namespace (measure/host.machine_identity):
    # where `pid` means something.
    machine: Optional[str] = None
    pid: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    cuda_devices: Optional[int] = None


def peer_pids(hellos: Mapping[int, Hello], rank: int) -> frozenset[int]:
    """The pids of the other ranks on this rank's machine (same kernel and pid namespace): not "another
    process" on its cores when they share them, but the job's own ranks time-sharing them (the CPU-denied
    rules judge that from the lost time). Seen on 4 ranks pinned two to a core: rank 0's busiest co-runner
    was rank 2."""
    me = hellos.get(rank)
    if me is None or not me.machine:
        return frozenset()
    return frozenset(h.pid for r, h in hellos.items() if r != rank and h.machine == me.machine and h.pid)
