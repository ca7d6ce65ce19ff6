"""allreduce-bench end to end on gloo CPU ranks: real collectives, real faults.

The faults are injected on the ranks themselves: `corrupt` makes one rank's results
arrive wrong, `slowlink` makes every collective between two ranks crawl (both ends wait
size / 0.25 GB/s extra per call). Sizes are kept small so a run takes seconds.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import xml.etree.ElementTree as ET

import pytest

from tests.trace_format import check_rules, spans_of

from .harness import assert_nothing_left, probe_section, run_check, run_command, run_hand_set_ranks, tagged_processes

pytestmark = pytest.mark.ranks

SMALL = ("--min-bytes", "4K", "--max-bytes", "1M", "--factor", "16", "--warmup", "1", "--iters", "5")


def _bench(tmp_path, *args, env=None):
    import sys

    from .harness import free_port

    report = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ddpdoctor", "allreduce-bench", "--no-live", "--json", str(report),
           "--port", str(free_port()), *args]
    return run_command(cmd, tmp_path, env=env, report_name="bench.json")


def test_healthy_sweep_is_correct_and_reported_like_nccl_tests(tmp_path):
    csv_path, svg_path = tmp_path / "bw.csv", tmp_path / "bw.svg"
    run = _bench(tmp_path, "--nproc", "3", *SMALL, "--csv", str(csv_path), "--plot", str(svg_path))
    assert run.returncode == 0, run.explain()
    # The bench runs topology first for the bandwidth to expect; on CPU ranks there is none to model.
    assert [f["code"] for f in run.findings()] == ["TOP009", "BW000"], run.explain()
    [verdict] = run.findings("BW000")
    assert verdict["evidence"]["expected_busbw"] == f"not modelled: {run.report['nodes'][0]} has no GPU topology"
    assert "efficiency_pct" not in verdict["evidence"] and "topology allows" not in verdict["title"]
    facts = probe_section(run.report, "allreduce")["facts"]
    sizes = [e["size_bytes"] for e in facts["0"]["results"]]
    # 4K, 64K, 1M: each a multiple of 4 bytes; the 25 MiB bucket is outside the asked range.
    assert sizes == [4096, 65536, 1048576]
    assert all(e["wrong"] == 0 and len(e["times_s"]) == 5 and min(e["times_s"]) > 0
               for f in facts.values() for e in f["results"])
    # 3 ranks: the ring pairs were measured, and none is slow.
    assert sorted(facts["0"]["pairs"]["times_s"]) == ["0-1", "2-0"]
    assert sorted(facts["1"]["pairs"]["times_s"]) == ["0-1", "1-2"]
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    assert [int(r["size_bytes"]) for r in rows] == sizes and all(r["wrong"] == "0" for r in rows)
    # busbw = algbw x 2(n-1)/n for all_reduce on 3 ranks.
    assert all(abs(float(r["busbw_gbps"]) - float(r["algbw_gbps"]) * 4 / 3) < 2e-4 for r in rows)
    assert ET.fromstring(svg_path.read_text()).tag.endswith("svg")
    head = run.stdout.splitlines()
    assert head[0].startswith("ddpdoctor allreduce-bench  OK")
    assert any("busbw" in line and "#wrong" in line for line in head) and any(line.strip().startswith("1M") for line in head)
    assert_nothing_left(run)


def test_a_corrupted_result_is_counted_and_named(tmp_path):
    run = _bench(tmp_path, "--nproc", "2", *SMALL, "--inject", "corrupt:rank=1")
    assert run.returncode == 2, run.explain()
    wrong = run.findings("BW001")
    assert len(wrong) == 1 and wrong[0]["ranks"] == [1], run.explain()
    facts = probe_section(run.report, "allreduce")["facts"]
    assert all(e["wrong"] == 0 for e in facts["0"]["results"])
    assert all(e["wrong"] > 0 for e in facts["1"]["results"])
    assert_nothing_left(run)


def test_one_rank_says_there_is_no_link_and_prints_no_table(tmp_path):
    """Issue 41: at one rank the report said "OK ... peak busbw 0 GB/s" under a table of local-copy
    figures (the H100 record, judged in tests/unit/test_allreduce_one_rank.py); the same here on CPU."""
    run = _bench(tmp_path, "--nproc", "1", *SMALL)
    assert run.returncode == 0, run.explain()
    assert [f["code"] for f in run.findings() if f["probe"] == "allreduce"] == ["BW008"], run.explain()
    assert "no link to measure" in run.stdout and "algbw" not in run.stdout, run.explain()
    assert_nothing_left(run)


def test_a_slow_link_between_two_ranks_is_localised(tmp_path):
    run = _bench(tmp_path, "--nproc", "4", *SMALL, "--inject", "slowlink:ranks=1,2")
    assert run.returncode == 1, run.explain()
    link = run.findings("BW003")
    assert len(link) == 1 and link[0]["ranks"] == [1, 2], run.explain()
    assert link[0]["evidence"]["slow_pairs"] == ["1-2"]
    bw = link[0]["evidence"]["pair_busbw_gbps"]
    assert bw["1-2"] < 0.5 * statistics.median([bw["0-1"], bw["2-3"], bw["3-0"]])
    # Blamed only after a second timing: the slow pair was timed twice, the others once.
    pairs = {r: f["pairs"] for r, f in probe_section(run.report, "allreduce")["facts"].items()}
    # On a busy host a pair that noise slowed may be timed again too (retiming suspects is the
    # point); every rank retimes the same pairs, and the injected one among them.
    assert all("1-2" in p["retimed"] and p["retimed"] == pairs["0"]["retimed"] for p in pairs.values()), pairs
    times = pairs["1"]["times_s"]
    once = [q for q in times if q not in pairs["1"]["retimed"]]  # rank 1 times its own pairs: 0-1, 1-2
    assert all(len(times["1-2"]) == 2 * len(times[q]) for q in once), pairs
    assert_nothing_left(run)


@pytest.mark.slow
def test_a_pair_slow_once_is_timed_again_and_not_blamed(tmp_path):
    """A pair slow at its first timing only is retimed and not blamed.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_a_slow_link_between_two_ranks_is_localised
    (the same retiming of a suspect ring pair on 4 ranks: its slow pair is timed twice there and
    blamed, the best of both judges the link; here the second timing clears it)."""
    # blip: the pair's first timing crawls as slowlink's does, the second does not (a burst of
    # noise on a busy host). The best of both judges the link: no BW003, and no false alarm.
    run = _bench(tmp_path, "--nproc", "4", *SMALL, "--inject", "blip:ranks=1,2")
    assert run.returncode == 0, run.explain()
    assert not run.findings("BW003") and not run.findings("BW002"), run.explain()
    pairs = {r: f["pairs"] for r, f in probe_section(run.report, "allreduce")["facts"].items()}
    # On a busy host a pair that noise slowed may be timed again too (retiming suspects is the
    # point); every rank retimes the same pairs, and the injected one among them.
    assert all("1-2" in p["retimed"] and p["retimed"] == pairs["0"]["retimed"] for p in pairs.values()), pairs
    first, again = pairs["1"]["times_s"]["1-2"][:10], pairs["1"]["times_s"]["1-2"][10:]
    assert min(first) > 2 * min(again), (first, again)  # the best call: slow the first time, not after
    assert_nothing_left(run)


# Every op and placement is checked for correctness on one rank in the unit tier
# (test_allreduce_diagnose.py); here they cross real processes. All in the slow tier: the default
# tier's sweep (all_reduce, in and out of place, checked on every rank) crosses the same bench.
@pytest.mark.slow
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "broadcast", "all_to_all"])
def test_other_collectives_are_measured_and_checked(tmp_path, op):
    """Each other collective measured across real ranks, every result checked, and named in the verdict.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_healthy_sweep_is_correct_and_reported_like_nccl_tests
    (the same allreduce-bench sweep, its per-size timings and the check of every result on every rank,
    with all_reduce; the ops' own exchange and correctness rules are the unit tier's)."""
    run = _bench(tmp_path, "--nproc", "2", "--op", op, "--min-bytes", "4K", "--max-bytes", "64K", "--factor", "16",
                 "--warmup", "1", "--iters", "3", "--localise", "never")
    assert run.returncode == 0, run.explain()
    facts = probe_section(run.report, "allreduce")["facts"]
    placements = {e["in_place"] for e in facts["0"]["results"]}
    assert placements == ({True} if op == "broadcast" else {False} if op == "all_to_all" else {False, True})
    assert all(e["wrong"] == 0 for f in facts.values() for e in f["results"])
    [verdict] = run.findings("BW000")
    assert op in verdict["title"]
    assert_nothing_left(run)


@pytest.mark.slow
def test_min_busbw_gates_the_exit_code(tmp_path):
    """--min-busbw 1000: BW002 fails the gate (exit 2) and the BW000 summary still says what was measured.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_a_corrupted_result_is_counted_and_named
    (the same bench verdict turning a critical finding into exit 2, BW001 there; the gate's rule and
    the flag are tests/unit/test_allreduce_diagnose.py's and test_bench_cli.py's)."""
    run = _bench(tmp_path, "--nproc", "2", *SMALL, "--min-busbw", "1000")
    assert run.returncode == 2, run.explain()
    gate = run.findings("BW002")
    assert len(gate) == 1 and gate[0]["evidence"]["required_gbps"] == 1000
    # The gate failed, and what was measured is still there to read it against.
    [summary] = run.findings("BW000")
    assert summary["severity"] == "info" and summary["evidence"]["peak_busbw_gbps"] > 0, summary
    assert summary["title"].endswith("; see BW002")
    assert run.report["settings"] == {"min_busbw_gbps": 1000.0}
    assert_nothing_left(run)


@pytest.mark.slow
def test_the_allreduce_probe_runs_inside_check(tmp_path):
    """`check --probes allreduce` runs the bench's probe, with DDP's 25 MiB bucket in its default sweep.

    Default twin: tests/ranks/test_allreduce_bench_e2e.py::test_healthy_sweep_is_correct_and_reported_like_nccl_tests
    (the same allreduce probe and its BW000 verdict on real ranks; allreduce-bench goes through check's
    own path, cli._check, with that probe alone and more iterations)."""
    run = run_check(tmp_path, "--nproc", "2", "--probes", "allreduce")
    assert run.returncode == 0, run.explain()
    assert [f["code"] for f in run.findings()] == ["BW000"]
    sizes = [e["size_bytes"] for e in probe_section(run.report, "allreduce")["facts"]["0"]["results"]]
    assert 25 * 2**20 in sizes  # DDP's bucket size is always in the default sweep
    assert_nothing_left(run)


def test_across_nodes_a_slow_node_and_a_slow_path_are_named(tmp_path):
    # Six real ranks, named as three nodes of two (DDPDOCTOR_NODE_NAME): what grouping by node
    # sees on a real cluster. Faults: both ranks of node n3 talk slowly to each other (at 500 Mbit/s, as a
    # link throttled with tc), and the leader of n2 (rank 2) to the leader of n3 (rank 4).
    # Why 500 Mbit/s inside n3: at the default 2 Gbit/s, n3 reached 0.15-0.27 of the fastest node in 8 quiet
    # runs (0.177 vs 0.728 GB/s at worst), against the CPU node rule's 0.3 (probes/allreduce/localise.py:
    # healthy nodes sharing busy cores come down to 0.46): a fault at the rule's margin, missed once in CI
    # (issue 40) when the fastest node ran slower. A throttled node sits near 0.1 or below.
    env = {r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "DDPDOCTOR_NODE_NAME": f"n{r // 2 + 1}"}
           for r in range(6)}
    timeline = tmp_path / "bench.trace.json"
    procs, report, tag = run_hand_set_ranks(
        tmp_path, 6, env, *SMALL, "--timeout", "30", "--inject", "slowlink:ranks=4,5:mbps=500,slowlink:ranks=2,4",
        "--trace", str(timeline), command="allreduce-bench", timeout_s=150)
    assert report is not None, procs[0].stdout + procs[0].stderr
    codes = {f["code"]: f for f in report["findings"]}
    assert report["nodes"] == ["n1", "n2", "n3"]
    assert "BW004" in codes, report["findings"]
    assert codes["BW004"]["nodes"] == ["n3"] and codes["BW004"]["ranks"] == [4, 5], report["findings"]
    assert codes["BW005"]["nodes"] == ["n2", "n3"], report["findings"]
    assert list(codes["BW005"]["evidence"]["leader_pair_busbw_gbps"]) == ["n1-n2", "n2-n3", "n3-n1"]
    assert procs[0].returncode == 1
    assert not tagged_processes(tag)
    # The timeline shows it at a glance: the slow node's own pair and the slow leader pair are the long bars.
    doc = json.loads(timeline.read_text())
    check_rules(doc)

    def bar_us(rank: int, name: str) -> int:
        [bar] = [e["dur"] for e in spans_of(doc, rank, "collective") if e["name"] == name]
        return bar

    assert bar_us(4, "inside node n3") > 2 * max(bar_us(0, "inside node n1"), bar_us(2, "inside node n2"))
    assert bar_us(4, "nodes n2 - n3") > 2 * bar_us(0, "nodes n1 - n2")
