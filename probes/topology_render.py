"""The topology probe's matrix: `nvidia-smi topo -m` per node, with the problems in red.

Rendering only. Nodes with a problem are drawn first; a healthy cluster shows one node,
since the others look the same (and every node is in the JSON report).
"""

from __future__ import annotations

from typing import Any, Mapping

from rich.table import Table
from rich.text import Text

from ddpdoctor.findings import Severity, rank_ranges

from .base import RunView
from .topology_checks import NodeView, cell, diagnose_topology, node_views

MAX_NODES = 2


def _marks(findings: list[Any], host: str) -> tuple[set[int], set[tuple[int, int]]]:
    gpus: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for f in findings:
        if f.severity < Severity.WARN or host not in f.nodes:
            continue
        if isinstance(f.evidence.get("gpu"), int):
            gpus.add(f.evidence["gpu"])
        for pair in f.evidence.get("pairs") or []:
            a, b = (int(x) for x in str(pair.get("gpus", "")).split("-"))
            pairs.update({(a, b), (b, a)})
        for row in f.evidence.get("ranks") or []:
            if isinstance(row, Mapping) and isinstance(row.get("gpu"), int) and f.code == "TOP005":
                gpus.add(row["gpu"])
    return gpus, pairs


def _link(view: NodeView, facts: Mapping[int, Mapping[str, Any]], index: int) -> str:
    for rank in view.ranks:
        if view.rank_gpu.get(rank) == index:
            link = ((facts[rank].get("load") or {}).get("pcie") or {})
            if "gen" in link:
                return f"Gen{link.get('gen')} x{link.get('width')} / Gen{link.get('max_gen')} x{link.get('max_width')}"
    idle = view.gpu(index).get("pcie_idle") or {}
    return f"idle, max Gen{idle.get('max_gen')} x{idle.get('max_width')}"


def _matrix(view: NodeView, facts: Mapping[int, Mapping[str, Any]], findings: list[Any], console: Any) -> None:
    bad_gpus, bad_pairs = _marks(findings, view.host)
    indices = [g["index"] for g in view.gpus]
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
        ranks = [r for r, g in view.rank_gpu.items() if g == a]
        table.add_row(Text(f"GPU{a}", style="bold red" if a in bad_gpus else ""), *cells,
                      str(gpu.get("cpu_affinity") if isinstance(gpu.get("cpu_affinity"), str) else "?"),
                      str(gpu.get("numa_node") if gpu.get("numa_node") is not None else "-"),
                      _link(view, facts, a), rank_ranges(ranks) if ranks else "")
    console.print(table)


def _cpu_line(view: NodeView, facts: Mapping[int, Mapping[str, Any]]) -> Text:
    node = view.node or {}
    why = str((node.get("gpus") or {}).get("unknown") or "no GPU")
    places = []
    for rank in view.ranks[:4]:
        placement = facts[rank].get("placement") or {}
        if isinstance(placement.get("cpus"), str):
            nodes = ",".join(str(n) for n in placement.get("numa_nodes") or []) or "?"
            places.append(f"rank {rank} on CPUs {placement['cpus']} (NUMA {nodes})")
    cards = [n for n in node.get("nics") or [] if isinstance(n, Mapping) and not n.get("virtual")]
    nic_text = ", ".join(f"{n['name']} {'up' if n.get('up') else 'down'}"
                         f"{' ' + format(n['speed_mbps'] / 1000, 'g') + ' Gb/s' if n.get('speed_mbps') else ''}"
                         f"{' RDMA ' + '/'.join(n['rdma']) if n.get('rdma') else ''}" for n in cards) or "none"
    transport = node.get("transport") or {}
    gloo = transport.get("gloo_interface") or transport.get("gloo_default_interface") or []
    return Text(f"topology  {view.host}: no GPU topology ({why}); {'; '.join(places + [''])}NICs: {nic_text}; "
                f"NCCL net {transport.get('nccl_net', '?')}, gloo on {', '.join(gloo) or '?'}", style="dim")


def render_matrices(facts: Mapping[Any, Mapping[str, Any]], console: Any) -> None:
    facts = {int(k): v for k, v in facts.items()}
    views = [v for v in node_views(facts, RunView(world_size=len(facts))) if v.node is not None]
    findings = diagnose_topology(facts, RunView(world_size=len(facts)))
    troubled = {n for f in findings if f.severity >= Severity.WARN for n in f.nodes}
    ordered = sorted(views, key=lambda v: v.host not in troubled)
    shown = [v for v in ordered if v.host in troubled][:MAX_NODES] or ordered[:1]
    for view in shown:
        if view.gpus:
            _matrix(view, facts, findings, console)
        else:
            console.print(_cpu_line(view, facts))
    if len(views) > len(shown):
        console.print(Text(f"({len(views) - len(shown)} more node{'s' if len(views) - len(shown) != 1 else ''} "
                           "in the JSON report)", style="dim"))
