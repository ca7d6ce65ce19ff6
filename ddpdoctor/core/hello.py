"""What a rank says at the rendezvous, as the probes read it (from rank 0's digest).

Why a type: every probe that needs to know where the other ranks are (which host, which pid,
which kernel) used to fish in a dict; the digest carries exactly these fields
(session/rank.py's `_DIGEST_FIELDS`), and the store and the report keep them as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
