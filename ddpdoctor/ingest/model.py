"""What one tool output says about one node, as the probes' typed facts, and how two outputs of
the same node combine.

Why per GPU and per probe: a node is usually described by several files (`nvidia-smi -q` for
health, `topo -m` for the links, `nvlink --status` for NVLink), each filling some fields of the
same GPU's facts; `merge_facts` combines them field by field, so a field one file knows is never
overwritten by another file's "not known".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor.core.facts import Facts

# The kinds of output ingest reads; detect.py recognises each by its content.
KINDS = ("nvidia-smi-q", "nvidia-smi-q-xml", "topo-m", "nvlink-status", "nccl-tests", "dcgmi-diag")


def not_known(kind: str) -> dict[str, str]:
    """A reading this kind of output does not show, in the `{"unknown": why}` shape every probe's
    facts already use for a reading that failed: judged as unknown, never guessed."""
    return {"unknown": f"not known from {kind}"}


@dataclass
class ToolOutput:
    """One file read: the node it describes (where the file names it), and per GPU (by
    nvidia-smi's index) the facts of each probe it fills."""

    path: str
    kind: str
    host: Optional[str] = None  # named in the file (nccl-tests' "on HOST"); else the folder's or None
    gpus: dict[int, dict[str, Facts]] = field(default_factory=dict)
    # What this output cannot show: said once in the diagnosis (INP001), never guessed.
    cannot_show: list[str] = field(default_factory=list)
    # The other nodes one file describes (nccl-tests across nodes names each rank's host): one
    # ToolOutput per further host, read as if each were its own file.
    more: list[ToolOutput] = field(default_factory=list)
    # The host the shell prompt above this output names (`root@test1:/#`): a hint, used only where
    # it matches a host another output names, or where one paste's prompts name several hosts.
    prompt_host: Optional[str] = None

    def parts(self) -> list[ToolOutput]:
        """This output and the other nodes it describes, in the file's order."""
        return [self, *self.more]


def _is_unknown(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and set(value) == {"unknown"}) or value == [] or value == {}


def merge_facts(a: Facts, b: Facts) -> Facts:
    """`a` with every field `b` knows and `a` does not; nested facts merged the same way, lists of
    facts merged item by item. Neither argument is changed."""
    if type(a) is not type(b):
        raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        mine, theirs = getattr(a, f.name), getattr(b, f.name)
        if isinstance(mine, Facts) and isinstance(theirs, Facts):
            changes[f.name] = merge_facts(mine, theirs)
        elif isinstance(mine, list) and isinstance(theirs, list) and mine and theirs \
                and all(isinstance(x, Facts) for x in mine + theirs) and len(mine) == len(theirs):
            changes[f.name] = [merge_facts(x, y) for x, y in zip(mine, theirs)]
        elif _is_unknown(mine) and not _is_unknown(theirs):
            changes[f.name] = theirs
    return dataclasses.replace(a, **changes) if changes else a  # type: ignore[type-var]
