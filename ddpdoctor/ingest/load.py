"""From files and folders to nodes: each tool output read by its kind's reader, grouped by the
node it describes, and each GPU's facts merged across that node's files.

A node is named by the file (nccl-tests prints host names), else by the folder it came from (a
folder per node: `diagnose node07/ node08/`), else all unnamed outputs given together are one
node. A file that cannot be read costs one line naming it and what was expected; the other
files are still read (snapshot.load_inputs collects those lines, the CLI exits 3 after the
diagnosis of the rest).

A file is read as a paste (paste.py): cleaned of colours and CR line ends, and cut at its prompt
and command lines, so one file holding `topo -m` and then `nvlink -s` (or an nccl-tests run) is
read part by part, each part by its own kind's reader and named by its lines in the result.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.facts import Facts
from ddpdoctor.ingest.detect import detect
from ddpdoctor.ingest.model import ToolOutput, merge_facts
from ddpdoctor.ingest.paste import Part, clean, split

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
    caller already detected it on the whole file, is used for a file that is one output.

    A file of several outputs gives one ToolOutput per part (the first, with the others in its
    `more`), each named by the file and its lines: "paste.txt (lines 1-19)"."""
    if b"\x00" in raw[:8192]:
        raise UsageError(f"{path} is a binary file: expected {EXPECTED}")
    text = clean(raw.decode("utf-8", errors="replace"))
    parts = _joined([(part, found) for part in split(text) if (found := detect(part.text)) is not None])
    if len(parts) < 2:  # one output (perhaps with a prompt or a shell session around it): read whole
        whole = Part(1, len(text.splitlines()), text, host=parts[0][0].host if parts else None)
        found = kind or detect(text)
        parts = [(whole, found)] if found is not None else []
    if not parts:
        raise UsageError(f"{path} is not {EXPECTED}")
    outputs = []
    for part, found in parts:
        label = path if len(parts) == 1 else part.label(path)
        outputs += _read_part(label, part, found, folder_host).parts()
    first, *others = outputs
    first.more = others
    return first


def _joined(parts: list[tuple[Part, str]]) -> list[tuple[Part, str]]:
    """Next parts of one kind from one host read as one: `topo -m` then `topo -p2p r` is one reading
    (the -p2p matrix fills the pairs of the matrix above it)."""
    out: list[tuple[Part, str]] = []
    for part, kind in parts:
        if out and out[-1][1] == kind and out[-1][0].host in (None, part.host):
            last = out[-1][0]
            part = Part(last.first, part.last, last.text + part.text, last.command, last.host or part.host)
            out.pop()
        out.append((part, kind))
    return out


def _read_part(label: str, part: Part, kind: str, folder_host: Optional[str]) -> ToolOutput:
    """One output of the file, read by its kind's reader; the host its prompt names kept as a hint."""
    out = _reader(kind)(label, part.text)
    if not out.gpus and kind != "nccl-tests":
        raise UsageError(f"{label} looks like {kind} output but names no GPU: was it cut short?")
    for one in out.parts():
        one.host = one.host or folder_host
        one.prompt_host = part.host
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
    # The host a prompt names (`root@test1:/# nvidia-smi topo -m`) places an unnamed output where
    # another output names that host, or where the prompts name several hosts (one paste per node).
    prompted = {part.prompt_host for part in parts if not part.host and part.prompt_host}
    trusted = prompted if len(prompted) > 1 else prompted & named
    unnamed = next(iter(named)) if len(named) == 1 else UNNAMED_NODE
    for out in parts:
        host = out.host or (out.prompt_host if out.prompt_host in trusted else None) or unnamed
        node = nodes.setdefault(host, Node(host))
        node.outputs.append(out)
        for index, probes in out.gpus.items():
            mine = node.gpus.setdefault(index, {})
            for probe, facts in probes.items():
                mine[probe] = merge_facts(mine[probe], facts) if probe in mine else facts
    return list(nodes.values())
