"""Nothing in the diagnosis or the report grows quadratically with the ranks.

The judging runs once, on the reporter, over every rank's facts: 1024 ranks must cost about
4x what 256 do. Timed on synthetic ranks built from a recorded CPU entry (8 per node, every
rank healthy except one slow rank per 64), with the best of 3 runs against VM noise;
quadratic work would be 16x, the bound is 8x.
"""

from __future__ import annotations

import copy
import io
import json
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from ddpdoctor.probes import RunView
from ddpdoctor.probes.homogeneity.probe import Homogeneity
from ddpdoctor.render.console import render_report
from ddpdoctor.runtime.context import SharedState
from ddpdoctor.session.reporter import build_report
from ddpdoctor.core.run_record import ExitInfo, RunRecord

CPU_ENTRY = Path(__file__).resolve().parent.parent / "fixtures" / "homogeneity" / "cpu_vm_2core_recorded.json"
PER_NODE = 8


def _facts(n: int) -> dict[int, dict]:
    base = json.loads(CPU_ENTRY.read_text())["probes"]["homogeneity"][0]
    base["host_hw"].update(cpus_usable=64, cpu_logical_cores=64, cpu_affinity="0-63")
    facts = {}
    for r in range(n):
        f = copy.deepcopy(base)
        f.update(rank=r, local_rank=r % PER_NODE, local_world_size=PER_NODE, world_size=n, host=f"n{r // PER_NODE:04d}")
        f["env"]["OMP_NUM_THREADS"] = "8"
        if r % 64 == 63:
            mm = f["measured"]["matmul"]
            mm["round_flops_per_s"] = [g / 3 for g in mm["round_flops_per_s"]]
            mm["flops_per_s"] /= 3
        facts[r] = f
    return facts


def _record(n: int, facts: dict[int, dict]) -> RunRecord:
    record = RunRecord(world_size=n, mode="torchrun", probes=("homogeneity",), started=100.0, ended=130.0)
    record.hellos = {r: {"rank": r, "host": facts[r]["host"], "local_rank": r % PER_NODE,
                         "local_world_size": PER_NODE, "world_size": n, "node_rank": r // PER_NODE} for r in range(n)}
    record.timelines = {r: [{"name": "report", "started": 120.0, "ended": 121.0, "status": "ok"}] for r in range(n)}
    record.done = set(range(n))
    record.exits = {r: ExitInfo(0, t=125.0) for r in range(n)}
    record.results = {"homogeneity": facts}
    return record


def _seconds(n: int) -> float:
    facts = _facts(n)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run = RunView(world_size=n, hosts={r: f["host"] for r, f in facts.items()})
        findings = Homogeneity().diagnose(facts, run)
        report = build_report(_record(n, facts), "gloo", "cpu", ["ddpdoctor", "check"])
        report.to_json()
        render_report(report, Console(file=io.StringIO(), width=160, color_system=None))
        best = min(best, time.perf_counter() - t0)
    assert any(f.code == "HOM006" for f in findings)  # the slow ranks were found: real work was timed
    return best


def test_the_diagnosis_and_the_report_grow_linearly_with_the_ranks():
    small, large = _seconds(256), _seconds(1024)
    assert large / small < 8.0, f"256 ranks {small:.3f}s, 1024 ranks {large:.3f}s: {large / small:.1f}x for 4x the ranks"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 1e6), min_size=2, max_size=40))
def test_the_median_of_the_others_is_the_median_without_that_rank(values):
    import statistics

    from ddpdoctor.probes.homogeneity.speed import _median_of_others

    by_rank = dict(enumerate(values))
    got = _median_of_others(by_rank)
    for r in by_rank:
        assert got[r] == statistics.median([v for p, v in by_rank.items() if p != r])


# -- the rendezvous: the gather's first step -----------------------------------------------------

def _rendezvous_reads(n: int, missing: int | None = None) -> tuple[dict[int, int], dict[int, Any]]:
    """n ranks in threads on one in-process store, each through the real _rendezvous: how many
    values each rank read from the store, and what each got (or the error it raised)."""
    import contextlib
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    from ddpdoctor.runtime.channel import Channel
    from ddpdoctor.session.rank import _rendezvous

    class Counting(Channel):
        def __init__(self, store: Any) -> None:
            super().__init__(store)
            self.reads = 0

        def get(self, key: str) -> Any:
            self.reads += 1
            return super().get(key)

    class Ctx:
        def __init__(self, rank: int) -> None:
            self.rank, self.world_size, self.channel = rank, n, Counting(store)
            self.cfg, self.shared = SimpleNamespace(timeout_s=5.0), SharedState()
            self.env = SimpleNamespace(hostname=f"node{rank // PER_NODE}", local_rank=rank % PER_NODE,
                                       local_world_size=PER_NODE, mode="env")

        @contextlib.contextmanager
        def collective(self, op: str, **detail: Any) -> Any:
            yield

    store = dist.HashStore()
    ctxs = {r: Ctx(r) for r in range(n) if r != missing}
    outcome: dict[int, Any] = {}

    def run(ctx: Ctx) -> None:
        try:
            outcome[ctx.rank] = _rendezvous(ctx)
        except RuntimeError as exc:
            outcome[ctx.rank] = exc

    threads = [threading.Thread(target=run, args=(c,)) for c in ctxs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return {r: c.channel.reads for r, c in ctxs.items()}, outcome


def test_the_rendezvous_reads_each_hello_once_on_rank_0_and_one_digest_elsewhere():
    reads, got = _rendezvous_reads(64)
    assert reads[0] == 64 and all(reads[r] == 1 for r in range(1, 64)), reads  # was 64 reads on every rank
    # Every rank knows every rank's host and machine, and agrees.
    assert all(got[r] == got[0] for r in range(64))
    assert [got[5][r]["host"] for r in (0, 8, 63)] == ["node0", "node1", "node7"]
    assert {"machine", "pid", "cuda_devices", "local_world_size"} <= set(got[5][63])


def test_a_missing_rank_is_named_by_every_rank_through_the_digest():
    reads, got = _rendezvous_reads(6, missing=4)
    for rank in (0, 1, 2, 3, 5):
        assert isinstance(got[rank], RuntimeError), got[rank]
        assert str(got[rank]).startswith("ranks [4] did not arrive within 4s (5 of 6 arrived)"), got[rank]


def test_when_rank_0_never_arrives_the_others_name_it_themselves():
    reads, got = _rendezvous_reads(4, missing=0)
    for rank in (1, 2, 3):
        assert str(got[rank]).startswith("ranks [0] did not arrive within 4s (3 of 4 arrived)"), got[rank]
