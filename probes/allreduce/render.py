"""The allreduce-bench table, laid out like nccl-tests' so its users read it at a glance.

Rendering only: the figures come from busbw.SizeResult, the judging from the probe.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import rank_ranges
from ddpdoctor.judge.busbw import SizeResult, format_size, per_accelerator_network_gbps
from ddpdoctor.probes.allreduce.facts import AllReduceFacts

_REDOP = {"all_reduce": "sum", "reduce_scatter": "sum"}


def render_bench(results: list[SizeResult], facts: Mapping[int, AllReduceFacts], console: Console) -> None:
    """The table, then each node's own times and, across nodes, the network share (facts may be plain dicts)."""
    if not results:
        return
    facts = facts_by_rank(AllReduceFacts, facts)
    if len(facts) == 1 and all(f.world_size == 1 for f in facts.values()):
        # No table at one rank: its algbw is a local copy's and busbw 0 (BW008 says why).
        console.print(f"{results[0].op}  1 rank: no link to measure, no bandwidth table (BW008)")
        return
    placements = sorted({r.in_place for r in results})  # out-of-place first, as nccl-tests
    sides = " | ".join("in-place" if p else "out-of-place" for p in placements)
    table = Table(title=f"{results[0].op}  {len(facts)} ranks  {results[0].dtype}   columns: {sides}; "
                        "algbw and busbw in GB/s", title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("size", "count", "type", "redop"):
        table.add_column(col, justify="right")
    for in_place in placements:
        for col in ("time(us)", "algbw", "busbw", "#wrong"):
            table.add_column(col, justify="right")
    # NCCL's own record of its choice, on rank 0 (absent off NCCL, or when the user's NCCL_DEBUG won).
    chosen = facts[min(facts)].nccl_choices() if facts else {}
    if chosen:
        table.add_column("nccl algo", justify="left")
    by_size: dict[int, dict[bool, SizeResult]] = defaultdict(dict)
    for r in results:
        by_size[r.size_bytes][r.in_place] = r
    for size in sorted(by_size):
        row = by_size[size]
        any_r = next(iter(row.values()))
        cells = [format_size(size), str(any_r.count), any_r.dtype, _REDOP.get(any_r.op, "none")]
        for in_place in placements:
            side = row.get(in_place)
            if side is None:
                cells += ["", "", "", ""]
                continue
            cells += [f"{side.median_s * 1e6:.1f}", f"{side.algbw_gbps:.3f}", f"{side.busbw_gbps:.3f}",
                      "n/a" if side.wrong is None else str(side.wrong)]
        if chosen:
            cells.append(chosen.get(size, ""))
        table.add_row(*cells)
    console.print(table)
    _per_rank(results, facts, console)
    _network_share(results, facts, console)


def _network_share(results: list[SizeResult], facts: Mapping[int, AllReduceFacts], console: Console) -> None:
    """Across nodes, busbw counts NVLink and network hops alike; what one accelerator's NIC carried
    is the figure to hold against its line rate (nccl-tests' busbw * (k-1)/(n-1))."""
    nodes = len({f.host for f in facts.values()})
    if nodes < 2 or len(facts) < 2:
        return
    top = max(r.size_bytes for r in results)
    best = max(r.busbw_gbps for r in results if r.size_bytes == top)
    share = per_accelerator_network_gbps(best, nodes, len(facts))
    console.print(Text(f"across {nodes} nodes, {len(facts)} ranks: per-accelerator network busbw {share:.3g} GB/s "
                       f"at {format_size(top)} (busbw x (k-1)/(n-1); hold it against one NIC's line rate, "
                       "e.g. 400 Gb/s = 50 GB/s)", style="dim"))


def _per_rank(results: list[SizeResult], facts: Mapping[int, AllReduceFacts], console: Console) -> None:
    """Each rank's own median at the largest size: the rank the others wait for spends the least time inside."""
    top = max(r.size_bytes for r in results)
    own: dict[int, float] = {}
    for rank, f in facts.items():
        for entry in f.results:
            if entry.size_bytes == top and entry.times_s:
                own[rank] = statistics.median(entry.times_s)
                break
    if len(own) < 2:
        return
    typical = statistics.median(own.values())
    by_host: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(own):
        by_host[facts[rank].host].append(rank)
    line = Text(f"per node at {format_size(top)} (each rank's own median time): ", style="dim")
    parts = []
    for host, ranks in by_host.items():
        times = [own[r] * 1e6 for r in ranks]
        span = f"{min(times):.0f}-{max(times):.0f}" if len(times) > 1 else f"{times[0]:.0f}"
        parts.append(f"{host}: {'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)} {span} us")
    line.append("; ".join(parts), style="dim")
    console.print(line)
    # With two ranks each is the other's peer: who waited for whom is noise, not a finding.
    late = [r for r, t in own.items() if t < 0.5 * typical] if len(own) >= 3 else []
    if late:
        console.print(Text("ranks the others waited for (they spent under half the typical time inside the call): "
                           + ", ".join(f"{r} ({facts[r].host})" for r in sorted(late)), style="yellow"))
