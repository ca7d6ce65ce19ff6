"""The topology probe's matrix: `nvidia-smi topo -m` per node, with the problems in red.

Rendering only. Nodes with a problem are drawn first; a healthy cluster shows one node,
since the others look the same (and every node is in the JSON report).
"""

from __future__ import annotations

from typing import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.findings import Finding, Severity, rank_ranges

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.topology.checks import (ByRank, NodeView, RankFacts, cell, diagnose_topology, node_views, ranks_on,
                                              typed)
from ddpdoctor.probes.topology.facts import Nic, NodeFacts

MAX_NODES = 2


def _marks(findings: list[Finding], host: str) -> tuple[set[int], set[tuple[int, int]]]:
    gpus: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for f in findings:
        if f.severity < Severity.WARN or host not in f.nodes:
            continue
        if isinstance(f.evidence.get("gpu"), int):
            gpus.add(f.evidence["gpu"])
        for pair in f.evidence.get("pairs") or []:
            a, _, b = str(pair.get("gpus", "")).partition("-")
            if a.isdigit() and b.isdigit():
                pairs.update({(int(a), int(b)), (int(b), int(a))})
        for row in f.evidence.get("ranks") or []:
            if isinstance(row, Mapping) and isinstance(row.get("gpu"), int) and f.code == "TOP005":
                gpus.add(row["gpu"])
    return gpus, pairs


def _link(view: NodeView, facts: ByRank, index: int) -> str:
    for rank in ranks_on(view, index):
        load = facts[rank].load
        link = load.pcie if load is not None else None
        if link is not None and link.gen is not None:
            return f"Gen{link.gen} x{link.width} / Gen{link.max_gen} x{link.max_width}"
    idle = view.gpu(index).pcie_idle
    if idle.max_gen is None and idle.max_width is None:
        return "not known"  # a tool output that does not show the link (topo -m, nvlink --status)
    return f"idle, max Gen{idle.max_gen} x{idle.max_width}"


def _matrix(view: NodeView, facts: ByRank, findings: list[Finding], console: Console) -> None:
    bad_gpus, bad_pairs = _marks(findings, view.host)
    indices = [g.index for g in view.gpus if g.index is not None]
    table = Table(title=f"topology  {view.host}: {len(indices)} GPUs; PCIe: under load / max",
                  title_justify="left", box=None, pad_edge=False, header_style="bold")
    table.add_column("")
    for i in indices:
        table.add_column(f"GPU{i}", justify="center")
    for col in ("CPU affinity", "NUMA", "PCIe", "ranks"):
        table.add_column(col)
    for a in indices:
        gpu = view.gpu(a)
        cells = []
        for b in indices:
            text = cell(view, a, b)
            cells.append(Text(text, style="bold red" if (a, b) in bad_pairs else ("dim" if text == "X" else "")))
        ranks = ranks_on(view, a)
        table.add_row(Text(f"GPU{a}", style="bold red" if a in bad_gpus else ""), *cells,
                      str(gpu.cpu_affinity if isinstance(gpu.cpu_affinity, str) else "?"),
                      str(gpu.numa_node if gpu.numa_node is not None else "-"),
                      _link(view, facts, a), rank_ranges(ranks) if ranks else "")
    console.print(table)


def _nic(card: Nic) -> str:
    speed = card.speed_mbps
    return (f"{card.name} {'up' if card.up else 'down'}"
            f"{f' {speed / 1000:g} Gb/s' if isinstance(speed, (int, float)) else ''}"
            f"{' RDMA ' + '/'.join(str(d) for d in card.rdma) if card.rdma else ''}")


def _placements(view: NodeView, facts: ByRank) -> list[str]:
    """Where the node's first ranks may run, for a node without GPUs to draw."""
    places = []
    for rank in view.ranks[:4]:
        placement = facts[rank].placement
        if isinstance(placement.cpus, str):
            nodes = placement.numa_nodes
            numa = ",".join(str(n) for n in nodes) if isinstance(nodes, list) and nodes else "?"
            places.append(f"rank {rank} on CPUs {placement.cpus} (NUMA {numa})")
    return places


def _cpu_line(view: NodeView, node: NodeFacts, facts: ByRank) -> Text:
    why = str(node.gpus.unknown or "no GPU")
    cards = [n for n in node.nics if not n.virtual]
    transport = node.transport
    gloo = transport.gloo_interface or transport.gloo_default_interface
    gloo_text = ", ".join(str(g) for g in gloo) if gloo else "?"
    return Text(f"topology  {view.host}: no GPU topology ({why}); {'; '.join(_placements(view, facts) + [''])}"
                f"NICs: {', '.join(_nic(c) for c in cards) or 'none'}; "
                f"NCCL net {transport.nccl_net or '?'}, gloo on {gloo_text}", style="dim")


def render_matrices(facts: RankFacts, console: Console) -> None:
    run = RunView(world_size=len(facts))
    by_rank = typed(facts)
    views = [v for v in node_views(by_rank, run) if v.node is not None]
    findings = diagnose_topology(by_rank, run)
    troubled = {n for f in findings if f.severity >= Severity.WARN for n in f.nodes}
    ordered = sorted(views, key=lambda v: v.host not in troubled)
    shown = [v for v in ordered if v.host in troubled][:MAX_NODES] or ordered[:1]
    for view in shown:
        if view.gpus:
            _matrix(view, by_rank, findings, console)
        elif view.node is not None:  # always, for the views shown: their leader reported
            console.print(_cpu_line(view, view.node, by_rank))
    if len(views) > len(shown):
        console.print(Text(f"({len(views) - len(shown)} more node{'s' if len(views) - len(shown) != 1 else ''} "
                           "in the JSON report)", style="dim"))
