"""Slurm's compressed host lists, e.g. `gpu[01-04,07],login1`."""

from __future__ import annotations

import re

from ddpdoctor.core.errors import UsageError


def expand_nodelist(text: str) -> list[str]:
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if not match:
            if "[" in item or "]" in item or not item:
                raise _unreadable(text)
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not re.fullmatch(r"[0-9]+", lo) or (sep and not re.fullmatch(r"[0-9]+", hi)):
                raise _unreadable(text)
            if not sep:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            if int(hi) < int(lo):
                raise _unreadable(text)
            if int(hi) - int(lo) + 1 > 100_000:
                raise UsageError(f"Slurm node list {text!r} names over 100000 hosts: set MASTER_ADDR explicitly")
            width = len(lo)
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return hosts


def _unreadable(text: str) -> UsageError:
    return UsageError(f"cannot read Slurm node list {text!r}: set MASTER_ADDR to the first node's address")


def first_host(text: str) -> str:
    hosts = expand_nodelist(text)  # validates the whole list; ranges are capped in size
    if not hosts:
        raise UsageError(f"Slurm node list {text!r} is empty: set MASTER_ADDR to the first node's address")
    return hosts[0]


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [i.strip() for i in items]


def tasks_per_node(text: str) -> int:
    """`4(x2),3` → the first node's count: Slurm's SLURM_TASKS_PER_NODE format."""
    match = re.match(r"\s*(\d+)", text)
    if not match or int(match.group(1)) < 1:
        raise UsageError(f"cannot read SLURM_TASKS_PER_NODE={text!r}: expected a count like 4 or 4(x2)")
    return int(match.group(1))
