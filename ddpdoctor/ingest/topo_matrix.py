"""`nvidia-smi topo -m` (and `topo -mp`, `topo -p2p r|w|n|p`) read into the topology probe's facts.

What the matrix says: each GPU pair's path (X, NV#, PIX, PXB, PHB, NODE, SYS; SOC in drivers
before NODE existed, the old name of SYS), each GPU's CPU Affinity and NUMA Affinity (columns
that some versions lack), and the NICs (NIC0.. with a "NIC Legend", or their own names such
as mlx5_0 in older versions). A `-p2p` matrix says, per pair, the status of one peer-to-peer
capability (OK, NS, CNS, GNS, TNS, DR, U); which one only the command line shows
(`nvidia-smi topo -p2p p`), so a matrix pasted without it is read as not known.

Why per GPU index: nvidia-smi names GPUs by index only here, so each GPU's facts carry
`gpu_index` (no UUID); the node's GPUs and pairs sit on the first GPU's facts, the way a live
run keeps them on the node's local rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest.model import ToolOutput, not_known
from ddpdoctor.probes.topology.facts import (GpuNode, GpuPair, GpuTopology, Nic, NodeFacts, Placement,
                                             TopologyFacts)

KIND = "topo-m"
PROBE = "topology"
LABELS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")  # trailing columns, by version
_GPU = re.compile(r"GPU(\d+)$")
_LEVEL = re.compile(r"X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC$")
_P2P = re.compile(r"X|OK|NS|CNS|GNS|TNS|DR|U$")
_P2P_COMMAND = re.compile(r"(?:-p2p|--p2pstatus)[\s=]+([rwnap]+)\b")
_P2P_FIELD = {"r": "p2p_read", "w": "p2p_write", "n": "p2p_nvlink", "p": "p2p_pci"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
CANNOT_SHOW = ("GPU model, UUID and PCI bus id (nvidia-smi -q)",
               "each NVLink's state (nvidia-smi nvlink --status)",
               "PCIe link generation and width (nvidia-smi -q)",
               "NIC state and speed",
               "the CPUs each rank runs on")


@dataclass
class Matrix:
    """One matrix of the file: its columns, and per row name the cells and trailing values."""

    columns: list[str]
    labels: list[str]
    rows: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    p2p: Optional[str] = None  # the capability letters of a -p2p matrix, where its command shows them


def _split_header(line: str) -> Optional[tuple[list[str], list[str]]]:
    """A matrix header (columns, trailing labels), or None: the columns are GPU/NIC names only."""
    labels = [label for label in LABELS if label in line]
    head = line.split(labels[0])[0] if labels else line
    columns = head.split()
    if not columns or not _GPU.match(columns[0]):
        return None
    if any(_LEVEL.match(c) or _P2P.match(c) for c in columns[1:]) or not all(re.match(r"[\w.:-]+$", c) for c in columns):
        return None  # a row: its second token is a cell
    return columns, labels


def _is_p2p(rows: dict[str, tuple[list[str], list[str]]]) -> bool:
    return any(_P2P.match(c) and not _LEVEL.match(c) for cells, _ in rows.values() for c in cells)


def _matrices(path: str, text: str) -> list[Matrix]:
    """Every matrix in the text, each with the rows under its header; a row cut short is an error.

    Headers are indented (rows start at the margin, or with one space in -p2p matrices, and
    their second token is a cell); a command line or a legend ends the matrix above it.
    """
    found: list[Matrix] = []
    current: Optional[Matrix] = None
    command: Optional[str] = None
    for number, line in enumerate(text.splitlines(), 1):
        asked = _P2P_COMMAND.search(line)
        if asked or re.search(r"topo\s+(-m|--matrix)", line):
            command, current = (asked.group(1) if asked else None), None
            continue
        header = _split_header(line) if line[:1].isspace() else None
        if header is not None:
            current = Matrix(header[0], header[1], p2p=command)
            found.append(current)
            continue
        tokens = line.split()
        if tokens and tokens[0] == "Legend:":
            current = None
        if current is None or not tokens or tokens[0] not in current.columns:
            continue
        cells = tokens[1:1 + len(current.columns)]
        if len(cells) < len(current.columns):
            raise UsageError(f"{path}: line {number}, the {tokens[0]} row of nvidia-smi topo has {len(cells)} of "
                             f"{len(current.columns)} columns: the matrix was cut short")
        current.rows[tokens[0]] = (cells, tokens[1 + len(current.columns):])
    return found


def _check_complete(path: str, matrix: Matrix) -> None:
    """Every GPU column has its row, and each GPU row its trailing values: else the paste was cut."""
    gpus = [c for c in matrix.columns if _GPU.match(c)]
    missing = [g for g in gpus if g not in matrix.rows]
    if missing:
        raise UsageError(f"{path}: nvidia-smi topo lists {', '.join(gpus)} but has no row for "
                         f"{', '.join(missing)}: the matrix was cut short")
    for gpu in gpus:
        extra = matrix.rows[gpu][1]
        if len(extra) < len(matrix.labels):
            raise UsageError(f"{path}: the {gpu} row of nvidia-smi topo -m lacks its {matrix.labels[len(extra)]} "
                             "value: the matrix was cut short")


def _level(cell: str) -> str:
    return "SYS" if cell == "SOC" else cell  # SOC: the socket interconnect, SYS's name before 2017


def _numa(value: Optional[str]) -> Optional[int]:
    return int(value) if value is not None and value.isdigit() else None


def _gpu_nodes(matrix: Matrix) -> list[GpuNode]:
    """Each GPU row's index, CPU affinity and NUMA node (the columns its version prints)."""
    gpus = []
    for name in (c for c in matrix.columns if _GPU.match(c)):
        values = dict(zip(matrix.labels, matrix.rows[name][1]))
        cpus = values.get("CPU Affinity")
        gpus.append(GpuNode(index=int(name[3:]),
                            cpu_affinity=cpus if cpus not in (None, "N/A") else not_known(KIND),
                            numa_node=_numa(values.get("NUMA Affinity"))))
    return gpus


def _pairs(matrix: Matrix) -> dict[tuple[int, int], GpuPair]:
    """Each GPU pair's path as the matrix names it."""
    gpus = [c for c in matrix.columns if _GPU.match(c)]
    pairs = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            lo, hi = int(a[3:]), int(b[3:])
            cell = matrix.rows[a][0][matrix.columns.index(b)]
            pairs[(min(lo, hi), max(lo, hi))] = GpuPair(a=min(lo, hi), b=max(lo, hi), level=_level(cell))
    return pairs


def _add_p2p(matrix: Matrix, pairs: dict[tuple[int, int], GpuPair]) -> None:
    """A -p2p matrix's letters on each pair, in the field of the capability its command names."""
    gpus = [c for c in matrix.columns if _GPU.match(c)]
    for letter in dict.fromkeys(matrix.p2p or ""):
        name = _P2P_FIELD.get(letter)
        if name is None:
            continue  # atomics: no fact of the probe holds them
        for i, a in enumerate(gpus):
            for b in gpus[i + 1:]:
                lo, hi = sorted((int(a[3:]), int(b[3:])))
                pair = pairs.setdefault((lo, hi), GpuPair(a=lo, b=hi, level=not_known(KIND)))
                status = matrix.rows[a][0][matrix.columns.index(b)]
                setattr(pair, name, "DISABLED" if status == "DR" else status)  # DR: NVML's DISABLED_BY_REGKEY


def _nics(text: str, matrices: list[Matrix]) -> list[Nic]:
    """The NIC columns, by their legend's device names where the file has a NIC Legend, each with its
    path from every GPU row (the socket a NIC sits on is where its paths are not SYS)."""
    legend = {m.group(1): m.group(2) for m in map(_NIC_LEGEND.match, text.splitlines()) if m}
    nics: dict[str, Nic] = {}
    for matrix in matrices:
        gpus = [c for c in matrix.columns if _GPU.match(c)]
        for column in (c for c in matrix.columns if not _GPU.match(c)):
            nic = nics.setdefault(column, Nic(name=legend.get(column, column), gpu_paths={}))
            at = matrix.columns.index(column)
            for gpu in gpus:
                cells = matrix.rows[gpu][0]
                if at < len(cells) and _LEVEL.match(cells[at]) and nic.gpu_paths is not None:
                    nic.gpu_paths[gpu[3:]] = _level(cells[at])
    return list(nics.values())


def read(path: str, text: str) -> ToolOutput:
    """The GPUs, pairs and NICs of a `topo -m` output (with any -p2p matrices beside it)."""
    text = _ANSI.sub("", text)  # a terminal's copy keeps the header's underline escapes
    matrices = _matrices(path, text)
    for matrix in matrices:
        _check_complete(path, matrix)
    links = [m for m in matrices if not _is_p2p(m.rows)]
    p2p = [m for m in matrices if _is_p2p(m.rows)]
    out = ToolOutput(path=path, kind=KIND)
    if not links and not p2p:
        return out  # names no GPU: load says the file looks cut short
    gpus = _gpu_nodes(links[0]) if links else [GpuNode(index=int(c[3:])) for c in p2p[0].columns if _GPU.match(c)]
    pairs = _pairs(links[0]) if links else {}
    for matrix in p2p:
        _add_p2p(matrix, pairs)
    node = NodeFacts(numa=not_known(KIND), gpus=GpuTopology(gpus=gpus, pairs=[pairs[k] for k in sorted(pairs)]),
                     nics=_nics(text, links[:1]))
    for offset, index in enumerate(int(g.index or 0) for g in gpus):
        facts = TopologyFacts(gpu_index=index, placement=Placement(unknown=not_known(KIND)["unknown"]),
                              node=node if offset == 0 else None)
        out.gpus[index] = {PROBE: facts}
    out.cannot_show = list(CANNOT_SHOW)
    if not links:
        out.cannot_show.append("each GPU pair's path: NVLink, PCIe switch, host bridge, socket (nvidia-smi topo -m)")
    if not any(m.p2p for m in p2p):
        out.cannot_show.append("peer-to-peer status (nvidia-smi topo -p2p r)" if not p2p else
                               "which peer-to-peer capability the -p2p matrix shows (its command line is not there)")
    return out
