"""CUDA_VISIBLE_DEVICES as CUDA reads it: indices, GPU- UUIDs or MIG- ids, in order.

CUDA stops at the first entry it cannot read and ignores the rest, silently: "0,1,x,3"
shows two GPUs. An empty value or -1 hides every GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class VisibleDevices:
    raw: Optional[str]
    entries: tuple[str, ...] = ()  # what CUDA will use, in order
    ignored: tuple[str, ...] = ()  # the first unreadable entry and everything after it
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def restricts(self) -> bool:
        return self.raw is not None

    @property
    def count(self) -> Optional[int]:
        """GPUs this variable allows, or None when it does not restrict."""
        return len(self.entries) if self.restricts else None


_INDEX = re.compile(r"[0-9]+")
_UUID = re.compile(r"GPU-[0-9a-fA-F-]{4,}")
_MIG = re.compile(r"MIG-[0-9A-Za-z/-]+")


def parse(raw: Optional[str]) -> VisibleDevices:
    if raw is None:
        return VisibleDevices(None)
    text = raw.strip()
    if text in ("", "-1"):
        return VisibleDevices(raw, problems=("hides every GPU",) if text == "-1" or raw == "" else ())
    entries: list[str] = []
    items = [t.strip() for t in text.split(",")]
    for i, item in enumerate(items):
        if _INDEX.fullmatch(item) or _UUID.fullmatch(item) or _MIG.fullmatch(item):
            if item in entries:
                return VisibleDevices(raw, tuple(entries), tuple(items[i:]),
                                      (f"{item!r} is listed twice; CUDA ignores it and what follows",))
            entries.append(item)
            continue
        return VisibleDevices(raw, tuple(entries), tuple(items[i:]),
                              (f"{item!r} is not a GPU index, GPU- UUID or MIG- id; CUDA ignores it and what follows",))
    return VisibleDevices(raw, tuple(entries))
