"""What log collectors and remote shells put in front of a line, before any launcher's prefix.

A line a user pastes has often been through more hands than torchrun's: containerd writes
`2024-05-01T10:00:00.123456789Z stdout F ` in front of every line of a pod, `kubectl logs
--timestamps` an RFC 3339 time, `kubectl logs --prefix` `[pod/NAME/CONTAINER] `, a
compose-style viewer `NAME | `, pdsh (the `deepspeed` runner) `worker-1: `, a log shipper
its own date. Taken off here, what is left starts with `[rank3]:` or the message itself,
and the pod or host they named is where the line came from.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

_CRI = re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d) (?:stdout|stderr) [FP] ?")
_KUBECTL_PREFIX = re.compile(r"\[pod/(?P<host>[^/\]\s]+)/[^\]\s]+\] ")
# Kubernetes names are lowercase DNS labels: `pytorchjob-worker-1 | ` (never `INFO | `).
_POD_BAR = re.compile(r"(?P<host>[a-z0-9][a-z0-9.]*-[a-z0-9.-]*[a-z0-9])\s*\| ")
_STAMP = re.compile(r"\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?(?: ?\|)? ")
# MPICH/Intel MPI's process managers sign their own lines: `[proxy:0:1@node02] `.
_HYDRA = re.compile(r"\[proxy:[\d:]+@(?P<host>[\w.-]+)\] ")
_PDSH = re.compile(r"(?P<host>[A-Za-z0-9][\w.-]*): ")
_PDSH_LINE = re.compile(r"(?m)^([A-Za-z0-9][\w.-]*): ")
_PDSH_NOT_HOSTS = re.compile(r"(?:Error|Exception|Warning|Interrupt|Exit)$|^(?:srun|slurmstepd|pdsh|\d+)$")
# `accelerate test` and other subprocess wrappers: `stderr: ` in front of the child's lines.
_STREAM = re.compile(r"std(?:out|err): ")
_OUTER = (_CRI, _KUBECTL_PREFIX, _STAMP, _HYDRA, _POD_BAR, _STREAM)
# What users type over a host name before pasting: `xxxxxxxx`, `...`, `***`, `SERVER_NAME`, `<hostname>`.
_REDACTED = re.compile(r"[xX*.#?_-]+|<[^>]*>|[A-Z]+(?:_[A-Z]+)+|HOST(?:NAME)?|NODE(?:NAME)?")


def redacted(name: str) -> bool:
    """A placeholder a user put where a host name was: naming it as a culprit node names nothing."""
    return bool(_REDACTED.fullmatch(name))


@dataclass(frozen=True)
class LineStyle:
    """What one file's prefixes mean, decided once from its first chunk."""

    srun_label_is_rank: bool = True
    pdsh_hosts: frozenset[str] = field(default_factory=frozenset)
    mpi_rank_brackets: bool = False  # Intel MPI / MPICH `-l`: `[3] message`


def pdsh_hosts(text: str) -> frozenset[str]:
    """The names pdsh puts in front of its hosts' lines: a host-like word (a digit, a dash or a
    dot in it, or localhost) that starts at least three lines. One such line could be a message."""
    counts = Counter(m.group(1) for m in _PDSH_LINE.finditer(text))
    return frozenset(name for name, n in counts.items() if n >= 3 and not _PDSH_NOT_HOSTS.search(name)
                     and (name == "localhost" or re.search(r"[\d.-]", name)))


def strip_collectors(line: str, style: LineStyle) -> tuple[Optional[str], str]:
    """(the pod or host a collector named, the line without collectors' prefixes)."""
    host: Optional[str] = None
    for _ in range(6):
        for pattern in _OUTER:
            m = pattern.match(line)
            if m:
                host = m.groupdict().get("host") or host
                line = line[m.end():]
                break
        else:
            m = _PDSH.match(line) if style.pdsh_hosts else None
            if not m or m.group("host") not in style.pdsh_hosts:
                return host, line
            host, line = m.group("host"), line[m.end():]
    return host, line
