"""The topology probe's matrix: `nvidia-smi topo -m` per node, with the problems in red.

Rendering only. Nodes with a problem are drawn first; a healthy cluster shows one node,
since the others look the same (and every node is in the JSON report).
"""

from __future__ import annotations

from typing import Any, Mapping

from rich.table import Table
from rich.text import Text

from ddpdoctor.core.findings import Severity, rank_ranges

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.topology.checks import NodeView, as_mapping, cell, diagnose_topology, node_views, ranks_on

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
            a, _, b = str(pair.get("gpus", "")).partition("-")
            if a.isdigit() and b.isdigit():
                pairs.update({(int(a), int(b)), (int(b), int(a))})
        for row in f.evidence.get("ranks") or []:
            if isinstance(row, Mapping) and isinstance(row.get("gpu"), int) and f.code == "TOP005":
                gpus.add(row["gpu"])
    return gpus, pairs


def _link(view: NodeView, facts: Mapping[int, Mapping[str, Any]], index: int) -> str:
    for rank in ranks_on(view, index):
        link = as_mapping(as_mapping(facts[rank].get("load")).get("pcie"))
        if "gen" in link:
            return f"Gen{link.get('gen')} x{link.get('width')} / Gen{link.get('max_gen')} x{link.get('max_width')}"
    idle = as_mapping(view.gpu(index).get("pcie_idle"))
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
        ranks = ranks_on(view, a)
        table.add_row(Text(f"GPU{a}", style="bold red" if a in bad_gpus else ""), *cells,
                      str(gpu.get("cpu_affinity") if isinstance(gpu.get("cpu_affinity"), str) else "?"),
                      str(gpu.get("numa_node") if gpu.get("numa_node") is not None else "-"),
                      _link(view, facts, a), rank_ranges(ranks) if ranks else "")
    console.print(table)


def _nic(card: Mapping[str, Any]) -> str:
    speed = card.get("speed_mbps")
    rdma = card.get("rdma")
    return (f"{card.get('name')} {'up' if card.get('up') else 'down'}"
            f"{f' {speed / 1000:g} Gb/s' if isinstance(speed, (int, float)) else ''}"
            f"{' RDMA ' + '/'.join(str(d) for d in rdma) if isinstance(rdma, list) and rdma else ''}")


def _cpu_line(view: NodeView, facts: Mapping[int, Mapping[str, Any]]) -> Text:
    node = view.node or {}
    gpus = node.get("gpus")
    why = str(gpus.get("unknown") if isinstance(gpus, Mapping) and gpus.get("unknown") else "no GPU")
    places = []
    for rank in view.ranks[:4]:
        placement = facts[rank].get("placement")
        if isinstance(placement, Mapping) and isinstance(placement.get("cpus"), str):
            nodes = placement.get("numa_nodes")
            numa = ",".join(str(n) for n in nodes) if isinstance(nodes, list) and nodes else "?"
            places.append(f"rank {rank} on CPUs {placement['cpus']} (NUMA {numa})")
    listed = node.get("nics")
    cards = [n for n in (listed if isinstance(listed, list) else []) if isinstance(n, Mapping) and not n.get("virtual")]
    transport = node.get("transport") if isinstance(node.get("transport"), Mapping) else {}
    gloo = transport.get("gloo_interface") or transport.get("gloo_default_interface")
    gloo_text = ", ".join(str(g) for g in gloo) if isinstance(gloo, list) and gloo else "?"
    return Text(f"topology  {view.host}: no GPU topology ({why}); {'; '.join(places + [''])}"
                f"NICs: {', '.join(_nic(c) for c in cards) or 'none'}; "
                f"NCCL net {transport.get('nccl_net', '?')}, gloo on {gloo_text}", style="dim")


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
