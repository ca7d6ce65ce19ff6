"""Probe `allreduce` (and the `allreduce-bench` command): what the interconnect delivers.

Collect sweeps message sizes on every rank, timing each call on its own, checks every
result against values each rank can compute alone, then looks for a slow link along a
ring of rank pairs (n pairs, not n²). Diagnose takes, per iteration, the slowest rank's
time (a collective is done when its last rank is) and derives algbw and busbw exactly
as nccl-tests does, from the median.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ddpdoctor.core import codes, keys
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding, Severity, rank_ranges
from ddpdoctor.judge import busbw
from ddpdoctor.judge.node_search import NodeEvidence, NodeSearch, replay
from ddpdoctor.measure import nccl_tuning
from ddpdoctor.measure.collectives import (
    PLACEMENTS, check_once, element_size, make_buffers, time_iterations, torch_dtype)
from ddpdoctor.probes.allreduce.by_model import expected_from_model
from ddpdoctor.probes.allreduce.facts import AllReduceFacts, NodeTimings, PairTimings, SizeTiming
from ddpdoctor.probes.allreduce.localise import (
    FAR_BELOW, NODE_RATIO, NodePair, NodeVerdict, Pair, blamed_pairs, crosses_nodes, device_kind, intra_node_busbw,
    judge_nodes, leader_pair_busbw, node_pair_busbw, pair_ratio, pairs_to_retime, ring_pair_busbw, slow_hosts)
from ddpdoctor.probes.base import RunView

if TYPE_CHECKING:
    import torch
    from rich.console import Console
    from torch.distributed import ProcessGroup

    from ddpdoctor.runtime.config import CheckConfig
    from ddpdoctor.runtime.context import RankContext

NAME = "allreduce"
SEARCH_ABOVE_NODES = 4  # from 5 nodes on, the node search runs too: O(log N) rounds, not a group per node pair
PAIR_CAP_BYTES = {"cuda": 64 * 2**20, "cpu": 4 * 2**20}  # big enough to be bandwidth-bound, small enough to be quick


def _fmt_bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


class AllReduce:
    name = NAME
    trains = False
    summary = "Sweep collective sizes: algbw/busbw as nccl-tests, wrong elements counted, slow link localised."
    facts_type = AllReduceFacts

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, Any]:
        bench = ctx.cfg.bench
        dtype = torch_dtype(bench.dtype)
        elem = element_size(bench.dtype)
        lo, hi, factor = busbw.default_range(ctx.device.type)
        sizes = busbw.sweep_sizes(bench.min_bytes or lo, bench.max_bytes or hi, bench.factor or factor, elem,
                                  ctx.world_size, bench.op)
        facts = AllReduceFacts(host=ctx.env.hostname, rank=ctx.rank, local_rank=ctx.env.local_rank,
                               device=str(ctx.device), backend=ctx.backend, op=bench.op, dtype=bench.dtype,
                               world_size=ctx.world_size, warmup=bench.warmup, iters=bench.iters)
        _sweep(ctx, facts, sizes, dtype, elem)
        _record_nccl_choices(ctx, facts, sizes)
        if bench.localise == "always" and ctx.world_size >= 2 or bench.localise == "auto" and (
                ctx.world_size >= 3 or len(set(_hosts(ctx))) > 1):
            _localise(ctx, facts, min(sizes[-1], PAIR_CAP_BYTES.get(ctx.device.type, sizes[-1])), dtype, elem)
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, AllReduceFacts], run: RunView) -> list[Finding]:
        facts = facts_by_rank(AllReduceFacts, facts)
        if not facts:
            return []
        run = _with_model_expectation(facts, run)
        results = merge_results(facts)
        findings: list[Finding] = []
        findings += _wrong_results(facts, run)
        if run.world_size == 1 and len(facts) == 1 and results:
            return findings + _one_rank(results, facts[min(facts)], run)
        summary = busbw.summarise(results) if results else None
        gate = run.settings.get("min_busbw_gbps")
        sample = facts[min(facts)]
        if summary is not None and gate is not None:
            findings += _gate(results, float(gate), sample, run)
        findings += _slow_link(facts, run)
        findings += _slow_nodes(facts, run)
        if summary is not None:
            findings += _against_topology(summary, sample, run)
        findings += _cpu_instead_of_gpus(run)
        if summary is not None:
            # The measured figures stay in the report when something is wrong too: a failed gate or a
            # slow link is read against them. Beside a problem the summary is information, not "ok".
            troubled = [f.code for f in findings if f.severity >= Severity.WARN]
            findings.insert(0, _verdict(summary, results, sample, run, len(facts), troubled))
        return findings

    def write_outputs(self, facts: Mapping[int, AllReduceFacts], cfg: CheckConfig) -> None:
        from ddpdoctor.probes.allreduce.outputs import to_csv, write_plot

        from ddpdoctor.core.files import atomic_write_text

        results = merge_results(facts)
        if cfg.bench.csv_path:
            atomic_write_text(to_csv(results), cfg.bench.csv_path, overwrite=cfg.force)
        if cfg.bench.plot_path and results:
            write_plot(results, cfg.bench.plot_path, f"{results[0].op} busbw, {len(facts)} ranks, {results[0].dtype}",
                       overwrite=cfg.force)

    def render_details(self, facts: Mapping[int, AllReduceFacts], console: Console) -> None:
        from ddpdoctor.probes.allreduce.render import render_bench

        render_bench(merge_results(facts), facts, console)


def _publish(ctx: RankContext, facts: AllReduceFacts) -> None:
    """What is measured so far reaches the report even if a later size hangs or crashes."""
    ctx.publish_partial(NAME, facts)


def _sweep(ctx: RankContext, facts: AllReduceFacts, sizes: Sequence[int], dtype: torch.dtype | None,
           elem: int) -> None:
    """Every size in every placement the op has: this rank's time of each call, and its wrong elements."""
    bench = ctx.cfg.bench
    n, rank, device = ctx.world_size, ctx.rank, ctx.device
    everyone = range(n)
    for in_place in PLACEMENTS[bench.op]:
        for size in sizes:
            ctx.progress()
            count = busbw.count_per_rank(bench.op, size, elem, n)
            buffers = make_buffers(bench.op, count, n, rank, in_place, dtype, device)
            with ctx.collective(bench.op, size=size, in_place=in_place):
                times = time_iterations(buffers, device, bench.warmup, bench.iters,
                                        ctx.injector.link_delay_s(everyone, size))
                wrong = check_once(buffers, corrupt=ctx.injector.corrupts()) if bench.check else None
            facts.results.append(SizeTiming(size_bytes=size, count=count, in_place=in_place, times_s=times,
                                            wrong=wrong))
            del buffers
            _publish(ctx, facts)


def _record_nccl_choices(ctx: RankContext, facts: AllReduceFacts, sizes: Sequence[int]) -> None:
    """What NCCL chose for the sweep's sizes, before the pairs' calls add theirs (where it was asked)."""
    folder, ctx.shared.nccl_tuning_dir = ctx.shared.nccl_tuning_dir, None
    if not folder:
        return
    import shutil

    chosen = nccl_tuning.by_size(nccl_tuning.read_choices(folder), ctx.cfg.bench.op)
    facts.nccl_algorithms = {str(size): chosen[size] for size in sizes if size in chosen}
    shutil.rmtree(folder, ignore_errors=True)
    _publish(ctx, facts)


def _localise(ctx: RankContext, facts: AllReduceFacts, pair_size: int, dtype: torch.dtype | None,
              elem: int) -> None:
    """The ring pairs' timings, and across nodes each node's and the node leaders' timings."""
    hosts = _hosts(ctx)
    across = len(set(hosts)) > 1
    facts.pairs = _measure_ring_pairs(ctx, pair_size, dtype, elem, hosts if across else [])
    if across:
        facts.nodes = _measure_nodes(ctx, hosts, pair_size, dtype, elem)
        facts.nodes.nic_name, facts.nodes.nic_speed_mbps = _socket_nic(ctx)


def _hosts(ctx: RankContext) -> list[str]:
    """Every rank's node, from the hellos read at rendezvous (every rank re-reading N keys would
    be N² store calls)."""
    hellos = ctx.hellos
    return [(hellos[r].host or "?") if r in hellos else "?" for r in range(ctx.world_size)]


def _socket_nic(ctx: RankContext) -> tuple[str | None, int | None]:
    """The interface this rank's backend was told to use and the rate it declares: what its node's
    network should carry. Only an exact name counts ("eth0", "=eth0"; not a prefix or "^" list),
    and only the socket transport's variable (NCCL over InfiniBand picks its HCA elsewhere)."""
    import os

    from ddpdoctor.measure import host_layout

    var = "NCCL_SOCKET_IFNAME" if ctx.backend == "nccl" else "GLOO_SOCKET_IFNAME"
    named = os.environ.get(var, "").split(",")[0].strip()
    exact = named[1:] if named.startswith("=") else named
    if not exact or exact.startswith("^"):
        return None, None
    cards = host_layout.nics()
    card = next((c for c in cards if isinstance(c, dict) and c.get("name") == exact), None) \
        if isinstance(cards, list) else None
    return exact, (card or {}).get("speed_mbps")


def _measure_ring_pairs(ctx: RankContext, size: int, dtype: torch.dtype | None, elem: int,
                        hosts: Sequence[str]) -> PairTimings:
    """Every ring pair's own 2-rank all-reduce, disjoint pairs at the same time (`hosts` across
    nodes: pairs inside a node and pairs across nodes are judged each against their own kind)."""
    import torch.distributed as dist

    pairs = busbw.ring_pairs(ctx.world_size)
    groups = {pair: dist.new_group(list(pair)) for pair in pairs}  # every rank creates every group, in order
    out = PairTimings(size_bytes=size, times_s=_time_pairs(ctx, groups, size, dtype, elem, "pair_all_reduce"))
    suspects = pairs_to_retime(_everyones_pairs(ctx, out), _rank_device_kind(ctx), hosts)
    if suspects:
        # Once more before anyone is blamed: a pair slowed by a burst of noise (another process on
        # a busy host) is fast the second time, a slow link is slow every time. The best of both
        # rounds judges it, so this can clear a pair and never accuse one.
        again = _time_pairs(ctx, {pair: groups[pair] for pair in suspects}, size, dtype, elem, "pair_all_reduce")
        for key, values in again.items():
            out.times_s[key] = out.times_s[key] + values
        out.retimed = [f"{a}-{b}" for a, b in suspects]
    with ctx.collective("localise_barrier"):
        dist.barrier()
    return out


def _rank_device_kind(ctx: RankContext) -> str:
    return "cuda" if ctx.device.type == "cuda" else "cpu"


def _everyones_pairs(ctx: RankContext, mine: PairTimings) -> dict[int, PairTimings]:
    """Every rank's first-round pair timings, through the store: each rank then applies the same
    rule to the same timings, so all pick the same pairs to time again without talking."""
    import torch.distributed as dist

    ctx.channel.set(keys.localise_pairs(ctx.rank), mine.times_s)
    with ctx.collective("localise_barrier"):
        dist.barrier()
    return {r: PairTimings.from_json({"size_bytes": mine.size_bytes,
                                      "times_s": ctx.channel.get(keys.localise_pairs(r))})
            for r in range(ctx.world_size)}


def _localise_iters(ctx: RankContext) -> int:
    """Timed calls per pair or node group: the best of them judges the link."""
    return max(10, ctx.cfg.bench.iters)


def _time_pairs(ctx: RankContext, groups: Mapping[Pair, ProcessGroup | int], size: int, dtype: torch.dtype | None,
                elem: int, what: str) -> dict[str, list[float]]:
    """This rank's timings of the pairs it belongs to, pair by pair in phases of disjoint pairs."""
    import torch.distributed as dist

    count = busbw.count_per_rank("all_reduce", size, elem, 2)
    iters = _localise_iters(ctx)
    times: dict[str, list[float]] = {}
    for phase in _phases(list(groups)):
        ctx.progress()
        with ctx.collective("localise_barrier"):
            dist.barrier()
        for pair in phase:
            if ctx.rank not in pair:
                continue
            buffers = make_buffers("all_reduce", count, 2, pair.index(ctx.rank), True, dtype, ctx.device,
                                   group=groups[pair])
            with ctx.collective(what, pair=list(pair)):
                times[f"{pair[0]}-{pair[1]}"] = time_iterations(buffers, ctx.device, 2, iters,
                                                                 ctx.injector.link_delay_s(pair, size))
    return times


def _measure_nodes(ctx: RankContext, hosts: list[str], size: int, dtype: torch.dtype | None,
                   elem: int) -> NodeTimings:
    """Across nodes: each node's ranks among themselves (all nodes at once, they share no
    link), then the node leaders along a ring: a slow node, or a slow node-to-node path."""
    import torch.distributed as dist

    nodes = list(dict.fromkeys(hosts))
    members = {h: [r for r, host in enumerate(hosts) if host == h] for h in nodes}
    leaders = [members[h][0] for h in nodes]
    # Every rank creates every group, in the same order (torch requires it).
    node_groups = {h: dist.new_group(members[h]) for h in nodes}
    leader_pairs = [(leaders[a], leaders[b]) for a, b in busbw.ring_pairs(len(nodes))]
    pair_groups = {pair: dist.new_group(list(pair)) for pair in leader_pairs}
    out = NodeTimings(size_bytes=size, node_of_rank=hosts)
    ctx.progress()
    with ctx.collective("localise_barrier"):
        dist.barrier()
    mine = hosts[ctx.rank]
    own = len(members[mine]) > 1
    if own:
        out.intra_times_s[mine] = _time_own_node(ctx, members[mine], node_groups[mine], mine, size, dtype, elem)
    # Two rounds, always: a node is blamed only on a path slow twice (its best call of both), and
    # the leader ring is n pairs in 2-3 phases, cheap beside the sweep.
    first = _time_pairs(ctx, pair_groups, size, dtype, elem, "leader_all_reduce")
    again = _time_pairs(ctx, pair_groups, size, dtype, elem, "leader_all_reduce")
    out.leader_times_s = {key: values + again.get(key, []) for key, values in first.items()}
    if own:
        # Each node's own ranks a second time, apart from the first: slow inside (BW004) only when
        # slow both times (CPU ranks sharing a host's cores put one node at 40% of another once).
        out.intra_times_s[mine] += _time_own_node(ctx, members[mine], node_groups[mine], mine, size, dtype, elem)
    if len(nodes) > SEARCH_ABOVE_NODES:
        _search_nodes(ctx, out, nodes, leaders, size, dtype, elem)
    with ctx.collective("localise_barrier"):
        dist.barrier()
    return out


def _search_nodes(ctx: RankContext, out: NodeTimings, nodes: list[str], leaders: list[int], size: int,
                  dtype: torch.dtype | None, elem: int) -> None:
    """The node search (ddpdoctor/judge/node_search.py): rounds of disjoint groups of node leaders,
    one all-reduce per group, all groups of a round at once, each round planned from the busbw of
    the rounds before. Every rank plans the same rounds from the same figures, which one small
    all-reduce per round hands to every rank; rank 0 keeps them for the diagnosis to replay."""
    import torch
    import torch.distributed as dist

    leader_of = dict(zip(nodes, leaders))
    search = NodeSearch(nodes)
    rounds: list[tuple[list[list[str]], list[float]]] = []
    while True:
        groups = search.plan()
        if not groups:
            break
        ranks = [[leader_of[n] for n in g] for g in groups]
        process_groups = [dist.new_group(r) for r in ranks]  # every rank creates every group, in order
        ctx.progress()
        figures = torch.zeros(len(groups), dtype=torch.float64, device=ctx.device)
        for members, group in zip(ranks, process_groups):
            if ctx.rank in members and not isinstance(group, int):  # a member's group is never NON_GROUP_MEMBER
                bw = _time_search_group(ctx, members, group, size, dtype, elem)
                figures[ranks.index(members)] = bw if members[0] == ctx.rank else 0.0
        with ctx.collective("node_search_round", round=search.rounds + 1):
            dist.all_reduce(figures)
        values = [float(v) for v in figures.cpu()]
        search.record(values)
        rounds.append(([list(g) for g in groups], values))
    if ctx.rank == 0:
        out.search_groups = [groups for groups, _ in rounds]
        out.search_busbw = [values for _, values in rounds]


def _time_search_group(ctx: RankContext, members: list[int], group: ProcessGroup, size: int,
                       dtype: torch.dtype | None, elem: int) -> float:
    """One group's busbw: every member's time of each call, the slowest member's per call (a
    collective ends with its last rank), the best call (noise only slows a call down)."""
    import torch
    import torch.distributed as dist

    count = busbw.count_per_rank("all_reduce", size, elem, len(members))
    buffers = make_buffers("all_reduce", count, len(members), members.index(ctx.rank), True, dtype, ctx.device,
                           group=group)
    with ctx.collective("node_search_all_reduce", ranks=members):
        times = time_iterations(buffers, ctx.device, 2, _localise_iters(ctx), ctx.injector.link_delay_s(members, size))
        slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return busbw.busbw_gbps("all_reduce", len(members), size, float(slowest.min()))


def _time_own_node(ctx: RankContext, members: list[int], group: ProcessGroup | int, host: str, size: int,
                   dtype: torch.dtype | None, elem: int) -> list[float]:
    """This rank's times of an all-reduce among its own node's ranks."""
    count = busbw.count_per_rank("all_reduce", size, elem, len(members))
    buffers = make_buffers("all_reduce", count, len(members), members.index(ctx.rank), True, dtype, ctx.device,
                           group=group)
    with ctx.collective("node_all_reduce", node=host):
        return time_iterations(buffers, ctx.device, 2, _localise_iters(ctx), ctx.injector.link_delay_s(members, size))


def _phases(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Pairs that share no rank run together: 2 phases for an even ring, 3 for an odd one."""
    phases: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for phase in phases:
            if not any(set(pair) & set(other) for other in phase):
                phase.append(pair)
                break
        else:
            phases.append([pair])
    return phases


def merge_results(facts: Mapping[int, AllReduceFacts]) -> list[busbw.SizeResult]:
    """Per size and placement: each iteration's slowest rank, and every rank's wrong elements.

    Entries are matched by (size, placement), not by position, so a rank that lacks one
    size does not shift the others. A size some rank timed a different number of times
    is left out rather than guessed. Plain dicts (facts as read from JSON) are read too.
    """
    facts = facts_by_rank(AllReduceFacts, facts)
    ranks = sorted(facts)
    first = facts[ranks[0]]
    n = int(first.world_size or len(ranks))
    by_rank = {r: {(int(e.size_bytes), e.in_place): e for e in facts[r].results} for r in ranks}
    merged = []
    for entry in first.results:
        key = (int(entry.size_bytes), entry.in_place)
        found = {r: by_rank[r][key] for r in ranks if key in by_rank[r]}
        try:
            slowest = busbw.slowest_per_iteration({r: e.times_s for r, e in found.items()})
        except ValueError:
            continue
        checked = [e.wrong for e in found.values() if e.wrong is not None]
        merged.append(busbw.SizeResult(op=first.op, size_bytes=key[0], count=int(entry.count),
                                       dtype=first.dtype, in_place=key[1], per_iter_s=slowest,
                                       wrong=sum(int(w) for w in checked) if checked else None, world_size=n))
    return merged


def _wrong_results(facts: Mapping[int, AllReduceFacts], run: RunView) -> list[Finding]:
    bad: dict[int, dict[str, int]] = {}
    for r, f in sorted(facts.items()):
        for entry in f.results:
            if entry.wrong:
                place = "in-place" if entry.in_place else "out-of-place"
                bad.setdefault(r, {})[f"{_fmt_bytes(int(entry.size_bytes))} {place}"] = int(entry.wrong)
    if not bad:
        return []
    ranks = tuple(sorted(bad))
    total = sum(v for sizes in bad.values() for v in sizes.values())
    op = facts[ranks[0]].op
    return [codes.finding(
        "BW001", NAME, f"{op} returned wrong values on rank {rank_ranges(ranks)}: {total} wrong elements",
        ranks=ranks, nodes=run.nodes_of(ranks),
        evidence={"wrong_elements_by_rank": {str(r): v for r, v in bad.items()}})]


def _largest(results: list[busbw.SizeResult]) -> busbw.SizeResult:
    top = max(r.size_bytes for r in results)
    return max((r for r in results if r.size_bytes == top), key=lambda r: r.busbw_gbps)


def _gate(results: list[busbw.SizeResult], gate: float, sample: AllReduceFacts, run: RunView) -> list[Finding]:
    largest = _largest(results)
    if largest.busbw_gbps >= gate:
        return []
    ranks = tuple(range(run.world_size))
    return [codes.finding(
        "BW002", NAME,
        (f"{sample.op} busbw {largest.busbw_gbps:.3g} GB/s at {_fmt_bytes(largest.size_bytes)} is below "
         f"the required {gate:g} GB/s"),
        ranks=ranks, nodes=run.nodes_of(ranks),
        evidence={"busbw_gbps": round(largest.busbw_gbps, 3), "required_gbps": gate,
                  "size": _fmt_bytes(largest.size_bytes), "backend": sample.backend,
                  "median_us": round(largest.median_s * 1e6, 1)})]


def _device_kind(facts: Mapping[int, AllReduceFacts]) -> str:
    return device_kind(f.device for f in facts.values())


def _node_part(facts: Mapping[int, AllReduceFacts]) -> NodeTimings | None:
    """Any rank's node timings that say which node each rank is on (None on one node)."""
    return next((f.nodes for f in facts.values() if f.nodes is not None and f.nodes.node_of_rank), None)


def _slow_link(facts: Mapping[int, AllReduceFacts], run: RunView) -> list[Finding]:
    """BW003: a slow ring pair of ranks. Across nodes only the pairs inside a node: the pairs that
    cross nodes are read by node (BW005), where a slow node is told from a slow path."""
    kind = _device_kind(facts)
    part = _node_part(facts)
    hosts = part.node_of_rank if part is not None else []
    slow, pair_bw, size = blamed_pairs({r: f.pairs for r, f in facts.items() if f.pairs is not None}, kind, hosts)
    slow = [pair for pair in slow if not crosses_nodes(pair, hosts)]
    if not slow:
        return []
    suspects = tuple(busbw.suspect_ranks(slow, pair_bw))
    fastest = max(v for pair, v in pair_bw.items() if not crosses_nodes(pair, hosts))
    worst = slow[0]
    where = (f"rank {suspects[0]} ({run.hosts.get(suspects[0], '?')})" if len(suspects) == 1 else
             f"the link between rank {worst[0]} ({run.hosts.get(worst[0], '?')}) and rank {worst[1]} "
             f"({run.hosts.get(worst[1], '?')})")
    return [codes.finding(
        "BW003", NAME,
        f"Slow link: {where}: {pair_bw[worst]:.3g} GB/s where the fastest ring pair reaches {fastest:.3g} GB/s",
        ranks=suspects, nodes=run.nodes_of(suspects),
        evidence={"pair_busbw_gbps": {f"{a}-{b}": round(v, 3) for (a, b), v in sorted(pair_bw.items())},
                  "slow_pairs": [f"{a}-{b}" for a, b in slow], "size": _fmt_bytes(int(size)),
                  "threshold": f"below {pair_ratio(kind, hosts):.0%} of the fastest pair"
                               + (" inside a node" if hosts else "")})]


def _slow_nodes(facts: Mapping[int, AllReduceFacts], run: RunView) -> list[Finding]:
    """Across nodes: a node slow among its own ranks (BW004), a slow node or path between nodes (BW005)."""
    part = _node_part(facts)
    if part is None:
        return []
    kind = _device_kind(facts)
    hosts, size = part.node_of_rank, int(part.size_bytes)
    intra = intra_node_busbw(facts, hosts, size)
    leader_bw = leader_pair_busbw({r: f.nodes for r, f in facts.items() if f.nodes is not None})
    ring_bw, _ = ring_pair_busbw({r: f.pairs for r, f in facts.items() if f.pairs is not None})
    views = [v for v in (node_pair_busbw([leader_bw], hosts), node_pair_busbw([ring_bw], hosts)) if v]
    nics = _nic_rates(facts, hosts)
    node_pairs = {p for view in views for p in view}
    verdict = judge_nodes(views, kind, _expected_node_pairs(node_pairs, nics, intra, kind))
    between = _slow_between_nodes(verdict, leader_bw, nics, hosts, size, kind)
    named = {node for finding in between for node in finding.nodes}
    return (_slow_inside_node(intra, hosts, size, NODE_RATIO[kind]) + between
            + _searched_nodes(facts, hosts, nics, size, named))


def _searched_nodes(facts: Mapping[int, AllReduceFacts], hosts: Sequence[str], nics: Mapping[str, tuple[str, int]],
                    size: int, named: set[str]) -> list[Finding]:
    """BW005 for a node the node search names (above 4 nodes) that the node pairs did not already
    name: the search's rounds replayed from what rank 0 recorded, its verdict read again."""
    part = next((f.nodes for f in facts.values() if f.nodes is not None and f.nodes.search_busbw), None)
    if part is None or part.search_groups is None or part.search_busbw is None:
        return []
    nodes = list(dict.fromkeys(hosts))
    try:
        result = replay(nodes, [([tuple(g) for g in groups], values)
                                for groups, values in zip(part.search_groups, part.search_busbw)])
    except ValueError:
        return []  # a record this planner did not make: nothing to judge it by
    return [_searched_node(e, result.rounds, hosts, nics, size) for e in result.slow if e.node not in named]


def _searched_node(found: NodeEvidence, rounds: int, hosts: Sequence[str], nics: Mapping[str, tuple[str, int]],
                   size: int) -> Finding:
    node = found.node
    partners = sorted({n for g in found.groups for n in g if n != node})
    return codes.finding(
        "BW005", NAME,
        (f"Slow node {node}: every group it was in reached at best {max(found.busbw):.3g} GB/s "
         f"({len(found.busbw)} timings beside {', '.join(partners)}), where groups of healthy nodes reach "
         f"{found.healthy_busbw:.3g} GB/s; {_nic_said(node, nics)}"),
        ranks=tuple(r for r, h in enumerate(hosts) if h == node), nodes=(node,),
        evidence={"search_busbw_gbps": [round(v, 3) for v in found.busbw],
                  "search_groups": ["+".join(g) for g in found.groups],
                  "healthy_busbw_gbps": round(found.healthy_busbw, 3), "search_rounds": rounds,
                  "size": _fmt_bytes(size)})


def _nic_rates(facts: Mapping[int, AllReduceFacts], hosts: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Each node's socket interface and its declared rate (Mb/s), where a rank of it read both."""
    out: dict[str, tuple[str, int]] = {}
    for r, f in sorted(facts.items()):
        part = f.nodes
        if part is not None and part.nic_name and isinstance(part.nic_speed_mbps, int) and 0 <= r < len(hosts):
            out.setdefault(hosts[r], (part.nic_name, part.nic_speed_mbps))
    return out


def _expected_node_pairs(node_pairs: set[NodePair], nics: Mapping[str, tuple[str, int]],
                         intra: Mapping[str, float], kind: str) -> dict[NodePair, float]:
    """What each node pair should carry, GB/s: the slower declared NIC rate of its ends (a 2-rank
    all-reduce's busbw is the bytes each rank sends per second). With one node pair on CPU ranks,
    also what the nodes' own ranks reach among themselves: the only figure to hold it against
    there (on GPUs NVLink is far faster than any NIC, so never then). The lower figure wins."""
    out: dict[NodePair, float] = {}
    for pair in node_pairs:
        figures = [nics[h][1] / 8000 for h in pair if h in nics]
        if kind == "cpu" and len(node_pairs) == 1:
            own = [intra[h] for h in pair if h in intra]
            figures += [max(own)] if own else []
        if figures:
            out[pair] = min(figures)
    return out


def _slow_inside_node(intra: Mapping[str, float], hosts: Sequence[str], size: int, ratio: float) -> list[Finding]:
    """BW004: a node whose ranks all-reduce among themselves slower than the other nodes' do."""
    slow, fastest = slow_hosts(intra, ratio)
    if not slow:
        return []
    ranks = tuple(r for r, h in enumerate(hosts) if h in slow)
    return [codes.finding(
        "BW004", NAME,
        (f"Slow inside node {slow[0]}: its ranks all-reduce at {intra[slow[0]]:.3g} GB/s where the fastest "
         f"node reaches {fastest:.3g} GB/s"),
        ranks=ranks, nodes=tuple(slow),
        evidence={"intra_node_busbw_gbps": {h: round(v, 3) for h, v in intra.items()},
                  "size": _fmt_bytes(size), "threshold": f"below {ratio:.0%} of the fastest node"})]


def _nic_said(host: str, nics: Mapping[str, tuple[str, int]]) -> str:
    if host not in nics:
        return "its NIC's rate is not known (no GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME named it, or it declares none)"
    name, mbps = nics[host]
    return f"its NIC {name} declares {mbps / 1000:g} Gb/s ({mbps / 8000:.3g} GB/s)"


def _slow_between_nodes(verdict: NodeVerdict, leader_bw: Mapping[Pair, float], nics: Mapping[str, tuple[str, int]],
                        hosts: Sequence[str], size: int, kind: str) -> list[Finding]:
    """BW005: a node whose every path to the others is slow (named alone), or a slow path between
    two nodes that are fine elsewhere (both named: one pair cannot tell which end is slow)."""
    node_bw = verdict.node_gbps
    evidence: dict[str, Any] = {
        "node_pair_busbw_gbps": {f"{a}-{b}": round(v, 3) for (a, b), v in node_bw.items()},
        "leader_pair_busbw_gbps": {f"{hosts[a]}-{hosts[b]}": round(v, 3) for (a, b), v in sorted(leader_bw.items())},
        "nic_gbps": {h: round(mbps / 1000, 3) for h, (_, mbps) in nics.items()},
        "size": _fmt_bytes(size),
        "threshold": (f"below {NODE_RATIO[kind]:.0%} of the fastest node pair, or below "
                      f"{FAR_BELOW[kind]:.0%} of what the pair should carry"),
    }
    if verdict.expected_gbps:
        evidence["expected_gbps"] = {f"{a}-{b}": round(v, 3) for (a, b), v in verdict.expected_gbps.items()}
    out = []
    for node in verdict.slow_nodes:
        own = max(v for p, v in node_bw.items() if node in p)
        peers = verdict.peers_gbps(node)
        out.append(codes.finding(
            "BW005", NAME,
            (f"Slow node {node}: its network reaches at best {own:.3g} GB/s to any other node, where its peers "
             f"reach {peers:.3g} GB/s between themselves; {_nic_said(node, nics)}"),
            ranks=tuple(r for r, h in enumerate(hosts) if h == node), nodes=(node,),
            evidence={**evidence, "node_gbps": round(own, 3), "peers_gbps": round(peers or 0.0, 3)}))
    if verdict.slow_paths:
        a, b = verdict.slow_paths[0]
        against = (f"where the fastest node pair reaches {verdict.fastest_gbps:.3g} GB/s" if verdict.fastest_gbps
                   and node_bw[(a, b)] < NODE_RATIO[kind] * verdict.fastest_gbps else
                   f"where it should carry {verdict.expected_gbps.get((a, b), 0.0):.3g} GB/s")
        honest = "; one pair of nodes cannot tell which end is slow" if len(node_bw) == 1 else ""
        at = tuple(dict.fromkeys(h for p in verdict.slow_paths for h in p))
        out.append(codes.finding(
            "BW005", NAME,
            (f"Slow network path between nodes {a} and {b}: {node_bw[(a, b)]:.3g} GB/s {against}{honest}"),
            ranks=tuple(r for r, h in enumerate(hosts) if h in at), nodes=at,
            evidence={**evidence, "slow_paths": [f"{x}-{y}" for x, y in verdict.slow_paths]}))
    return out


def _cpu_instead_of_gpus(run: RunView) -> list[Finding]:
    """BW009: the launcher left the GPUs unused for want of one per rank (session/launcher.py
    `cpu_instead_of_gpus`), so these are gloo's CPU figures: said, never an OK of the GPUs."""
    unused = run.settings.get("cpu_instead_of_gpus")
    if not unused:
        return []
    gpus, ranks = int(unused.get("gpus", 0)), int(unused.get("ranks", run.world_size))
    every = tuple(range(run.world_size))
    return [codes.finding(
        "BW009", NAME,
        (f"Measured gloo on CPU processes, not the GPUs: {ranks} ranks but {gpus} GPU{'' if gpus == 1 else 's'} "
         "here, and NCCL needs one GPU per rank"),
        ranks=every, nodes=run.nodes_of(every), evidence={"gpus": gpus, "ranks": ranks, "backend": "gloo"})]


def _one_rank(results: list[busbw.SizeResult], sample: AllReduceFacts, run: RunView) -> list[Finding]:
    """BW008 in place of the bandwidth verdict: one rank has no link to measure (the H100 record said
    "OK ... peak busbw 0 GB/s" beside an algbw of 209,715 GB/s). What was run is kept as evidence, and
    the results' correctness is still judged (BW001, before this)."""
    gate = run.settings.get("min_busbw_gbps")
    fastest = max(results, key=lambda r: r.algbw_gbps) if results else None
    return [codes.finding(
        "BW008", NAME,
        f"{sample.op} on 1 rank: no link to measure (its time is a local copy, busbw is 0 by definition)",
        ranks=(0,), nodes=run.nodes_of((0,)),
        evidence={"device": sample.device, "backend": sample.backend, "sizes_run": len({r.size_bytes for r in results}),
                  **({"fastest_local_algbw_gbps": round(fastest.algbw_gbps, 1),
                      "at_bytes": fastest.size_bytes} if fastest else {}),
                  **({"min_busbw_gbps": f"{gate:g}: not judged at one rank"} if gate is not None else {})})]


# Below this share of what the topology allows, on a bandwidth-bound size, the measurement is lost
# somewhere. The model already carries NCCL's usual efficiency (docs/probes/topology.md), so a
# healthy machine lands near 100%; half is a transport or link problem, not tuning.
LOW_EFFICIENCY = 0.5
BANDWIDTH_BOUND_BYTES = 64 * 2**20
# busbw above the links' full speed by more than noise: the switch reduced in the network.
ABOVE_WIRE = 1.05


def _with_model_expectation(facts: Mapping[int, AllReduceFacts], run: RunView) -> RunView:
    """Where no topology gave a figure, what the GPUs' model allows: facts read from a tool's
    output (nccl-tests) name their GPUs, a live run's do not and are judged as before."""
    if run.expected_busbw.get("gbps") is not None:
        return run
    by_name = expected_from_model((f.gpu_name for f in facts.values()),
                                  (run.hosts.get(r, f.host) for r, f in facts.items()))
    return replace(run, expected_busbw=by_name) if by_name else run


def _allows(expected: Mapping[str, Any]) -> str:
    return "its GPUs' model allows" if expected.get("from_model") else "this topology allows"


def _expected(sample: AllReduceFacts, run: RunView) -> Mapping[str, Any]:
    """The topology's figure where it applies: a ring-bound collective on GPUs (all_to_all's
    busbw is not bounded by the ring)."""
    if sample.op == "all_to_all" or not run.expected_busbw:
        return {}
    return run.expected_busbw


def _efficiency_evidence(summary: busbw.Summary, sample: AllReduceFacts, run: RunView) -> dict[str, Any]:
    expected = _expected(sample, run)
    if not expected:
        return {}
    if expected.get("gbps") is None:
        return {"expected_busbw": f"not modelled: {expected.get('why', 'unknown')}"}
    out = {"expected_busbw_gbps": expected["gbps"], "expected_bottleneck": expected.get("bottleneck"),
           "efficiency_pct": round(100 * summary.peak_busbw_gbps / expected["gbps"], 1)}
    if expected.get("from_model"):
        out["expected_from"] = "the GPUs' model name: no topology was read beside this measurement"
    if not _judged(expected):
        out["expected_judged"] = ("no: across nodes the network figure counts every NIC of a node, used by this "
                                  "job or not, and cannot see in-network reduction")
    return out


def _judged(expected: Mapping[str, Any]) -> bool:
    """Only a one-node expectation is firm enough to judge by: across nodes the model adds every
    NIC a node has (a job on 2 of 8 GPUs uses fewer), and CollNet/SHARP reductions in the switch
    are invisible to it, so BW006 would cry wolf and BW007 would credit the wrong cause."""
    return int(expected.get("nodes") or 1) == 1


def _against_topology(summary: busbw.Summary, sample: AllReduceFacts, run: RunView) -> list[Finding]:
    """BW006: far below what the links allow; BW007: above what they carry (in-network reduction)."""
    expected = _expected(sample, run)
    if not expected.get("gbps") or not _judged(expected) or not sample.device.startswith("cuda"):
        return []
    peak, gbps = summary.peak_busbw_gbps, float(expected["gbps"])
    at_peak = sample.nccl_choices().get(summary.peak_size_bytes)
    # One evidence for both findings: the algorithm NCCL chose at the peak is read beside either.
    evidence = {"peak_busbw_gbps": round(peak, 3), "peak_at": _fmt_bytes(summary.peak_size_bytes),
                "expected_busbw_gbps": gbps, "expected_at_full_link_speed_gbps": expected.get("at_full_link_gbps"),
                "bottleneck_wire_gbps": expected.get("wire_gbps"),
                "bottleneck": expected.get("bottleneck"), "efficiency_pct": round(100 * peak / gbps, 1),
                "largest_size": _fmt_bytes(summary.largest_size_bytes)}
    if at_peak:
        evidence["nccl_algorithm_at_peak"] = at_peak
    out = []
    if peak < LOW_EFFICIENCY * gbps and summary.largest_size_bytes >= BANDWIDTH_BOUND_BYTES:
        out.append(_far_below_links(sample.op, peak, gbps, expected, evidence, run))
    wire = expected.get("wire_gbps")
    if wire and peak > ABOVE_WIRE * float(wire):
        out.append(_above_links(sample.op, peak, float(wire), at_peak, evidence, run))
    return out


def _far_below_links(op: str, peak: float, gbps: float, expected: Mapping[str, Any], evidence: dict[str, Any],
                     run: RunView) -> Finding:
    """BW006: under half of what the topology allows on bandwidth-bound sizes."""
    ranks = tuple(range(run.world_size))
    return codes.finding(
        "BW006", NAME,
        (f"{op} peak busbw {peak:.3g} GB/s is {100 * peak / gbps:.0f}% of the ~{gbps:g} GB/s "
         f"{_allows(expected)} ({expected.get('bottleneck')})"),
        ranks=ranks, nodes=run.nodes_of(ranks), evidence=evidence)


def _above_links(op: str, peak: float, wire: float, at_peak: str | None, evidence: dict[str, Any],
                 run: RunView) -> Finding:
    """BW007: above what the slowest link carries, which only a reduction in the switch explains."""
    in_network = bool(at_peak) and str(at_peak).split("/")[0] in nccl_tuning.IN_NETWORK
    said = (f"NCCL chose {at_peak} there: the switch reduces in the network" if in_network else
            f"NCCL chose {at_peak} there, which reduces on the GPUs: check the topology model" if at_peak else
            "the switch reduces in the network (NVLS on NVSwitch, CollNet/SHARP)")
    ranks = tuple(range(run.world_size))
    return codes.finding(
        "BW007", NAME, f"{op} busbw {peak:.3g} GB/s is above the {wire:g} GB/s its slowest link carries: {said}",
        ranks=ranks, nodes=run.nodes_of(ranks), evidence=evidence)


def _verdict_evidence(summary: busbw.Summary, results: list[busbw.SizeResult], sample: AllReduceFacts,
                      run: RunView, present: int) -> dict[str, Any]:
    """BW000's figures: nccl-tests' own, the network share across nodes, and the topology's expectation."""
    nodes = run.nodes_of(range(run.world_size))
    evidence: dict[str, Any] = {
        "peak_busbw_gbps": round(summary.peak_busbw_gbps, 3), "peak_at": _fmt_bytes(summary.peak_size_bytes),
        "busbw_at_largest_gbps": round(summary.busbw_at_largest_gbps, 3),
        "busbw_at_ddp_bucket_gbps": round(summary.busbw_at_bucket_gbps, 3),
        "bucket_figure_measured_at": _fmt_bytes(summary.bucket_size_bytes),
        "small_message_latency_us": round(summary.latency_us, 1),
        "latency_measured_at": _fmt_bytes(summary.latency_size_bytes),
        "backend": sample.backend, "dtype": sample.dtype, "ranks_reporting": present,
    }
    if len(nodes) > 1:
        evidence["per_accelerator_network_gbps"] = round(
            busbw.per_accelerator_network_gbps(_largest(results).busbw_gbps, len(nodes), run.world_size), 3)
    evidence.update(_efficiency_evidence(summary, sample, run))
    chosen = sample.nccl_choices()
    if chosen:
        evidence["nccl_algorithm_by_size"] = {_fmt_bytes(size): algo for size, algo in sorted(chosen.items())}
    return evidence


def _verdict(summary: busbw.Summary, results: list[busbw.SizeResult], sample: AllReduceFacts, run: RunView,
             present: int, troubled: Sequence[str] = ()) -> Finding:
    ranks = tuple(range(run.world_size))
    checked = all(e.wrong is not None for e in sample.results)
    on_bucket = summary.bucket_size_bytes == busbw.DDP_BUCKET_BYTES
    evidence = _verdict_evidence(summary, results, sample, run, present)
    against = ("" if "efficiency_pct" not in evidence else
               f"; {evidence['efficiency_pct']:.0f}% of the ~{evidence['expected_busbw_gbps']:g} GB/s "
               + (_allows(_expected(sample, run)).replace("this ", "the ") if "expected_judged" not in evidence else
                  "a rough across-node model gives (an upper bound, not judged)"))
    return codes.finding(
        "BW000", NAME,
        (f"{sample.op} on {run.world_size} ranks: peak busbw {summary.peak_busbw_gbps:.3g} GB/s "
         f"(at {_fmt_bytes(summary.peak_size_bytes)}), {summary.busbw_at_bucket_gbps:.3g} GB/s at "
         + (f"DDP's {_fmt_bytes(busbw.DDP_BUCKET_BYTES)} bucket size" if on_bucket else
            f"{_fmt_bytes(summary.bucket_size_bytes)} (the size nearest DDP's {_fmt_bytes(busbw.DDP_BUCKET_BYTES)} "
            "bucket)")
         + f", {summary.latency_us:.0f} us for small messages" + against
         + ("; results not checked (--no-check)" if not checked else
            "" if "BW001" in troubled else "; every result correct")
         + (f"; see {', '.join(dict.fromkeys(troubled))}" if troubled else "")),
        severity=Severity.INFO if troubled else Severity.OK, ranks=ranks, nodes=run.nodes_of(ranks),
        evidence=evidence)
