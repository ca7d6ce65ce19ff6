"""From files and folders to nodes: each tool output read by its kind's reader, grouped by the
node it describes, and each GPU's facts merged across that node's files.

A node is named by the file (nccl-tests prints host names), else by the folder it came from (a
folder per node: `diagnose node07/ node08/`), else all unnamed outputs given together are one
node. A file that cannot be read costs one line naming it and what was expected; the other
files are still read (snapshot.load_inputs collects those lines, the CLI exits 3 after the
diagnosis of the rest).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.facts import Facts
from ddpdoctor.ingest.detect import detect
from ddpdoctor.ingest.model import ToolOutput, merge_facts

UNNAMED_NODE = "node"

# kind -> "module:function"; a reader takes (path, text) and returns a ToolOutput, or raises
# UsageError with one line saying what in the file is not what that tool prints.
READERS: dict[str, str] = {
    "nvidia-smi-q": "ddpdoctor.ingest.smi_query:read_text",
    "nvidia-smi-q-xml": "ddpdoctor.ingest.smi_query:read_xml",
    "topo-m": "ddpdoctor.ingest.topo_matrix:read",
    "nvlink-status": "ddpdoctor.ingest.nvlink_status:read",
    "nccl-tests": "ddpdoctor.ingest.nccl_tests:read",
    "dcgmi-diag": "ddpdoctor.ingest.dcgmi_diag:read",
}

EXPECTED = ("a ddpdoctor snapshot or report, or an output ddpdoctor reads: nvidia-smi -q (or -q -x), "
            "nvidia-smi topo -m, nvidia-smi nvlink --status, nccl-tests (all_reduce_perf, ...), dcgmi diag")


def _reader(kind: str) -> Callable[[str, str], ToolOutput]:
    module, _, name = READERS[kind].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise UsageError(f"reading {kind} output is not available in this ddpdoctor version") from None


def read_tool_output(path: str, raw: bytes, folder_host: Optional[str] = None,
                     kind: Optional[str] = None) -> ToolOutput:
    """One file, or a one-line UsageError naming it and what was expected. `kind`, where the
    caller already detected it, is not detected again."""
    if b"\x00" in raw[:8192]:
        raise UsageError(f"{path} is a binary file: expected {EXPECTED}")
    text = raw.decode("utf-8", errors="replace")
    kind = kind or detect(text)
    if kind is None:
        raise UsageError(f"{path} is not {EXPECTED}")
    out = _reader(kind)(path, text)
    if not out.gpus and kind != "nccl-tests":
        raise UsageError(f"{path} looks like {kind} output but names no GPU: was it cut short?")
    out.host = out.host or folder_host
    return out


@dataclass
class Node:
    """One node's merged facts: per GPU index, per probe; and the files that described it."""

    host: str
    gpus: dict[int, dict[str, Facts]] = field(default_factory=dict)
    outputs: list[ToolOutput] = field(default_factory=list)


def group_by_node(outputs: list[ToolOutput]) -> list[Node]:
    """Outputs of the same node, merged GPU by GPU and probe by probe, in the order first seen."""
    nodes: dict[str, Node] = {}
    parts = [part for out in outputs for part in out.parts()]
    # Unnamed outputs given with files that name exactly one host (an nccl-tests run on one node
    # beside its topo -m) describe that host.
    named = {part.host for part in parts if part.host}
    unnamed = named.pop() if len(named) == 1 else UNNAMED_NODE
    for out in parts:
        host = out.host or unnamed
        node = nodes.setdefault(host, Node(host))
        node.outputs.append(out)
        for index, probes in out.gpus.items():
            mine = node.gpus.setdefault(index, {})
            for probe, facts in probes.items():
                mine[probe] = merge_facts(mine[probe], facts) if probe in mine else facts
    return list(nodes.values())
