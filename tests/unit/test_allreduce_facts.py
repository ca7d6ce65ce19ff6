"""probes/allreduce/facts.py and localise.py: the typed facts read and write back every source of
allreduce facts byte for byte, a freshly built object writes the keys in the order collect always
wrote them, tolerant reads give defaults, and the slow-pair rule collect applies between its two
rounds of pair timings is the one diagnose judges by.

Sources: the dicts the allreduce unit tests build, and the reports recorded in tests/fixtures/allreduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor.judge import busbw
from ddpdoctor.probes.allreduce.facts import AllReduceFacts, NodeTimings, PairTimings, SizeTiming
from ddpdoctor.probes.allreduce.localise import blamed_pairs, pairs_to_retime, ring_pair_busbw, slow_pairs
from ddpdoctor.probes.allreduce.probe import AllReduce
from tests.unit.test_allreduce_diagnose import (
    RING_HOSTS, _entry, _facts, _minimal, _run, _with_nodes, _with_pairs)
from tests.unit.test_allreduce_expectation import sweep

FIXTURES = sorted((Path(__file__).resolve().parent.parent / "fixtures" / "allreduce").glob("*.json"))


def _dumped(value: object) -> str:
    return json.dumps(value)


def _unit_test_sources() -> dict[str, dict[int, dict]]:
    with_nccl = sweep(2, {2**20: 40.0, 2**28: 480.0})
    with_nccl[0]["nccl_algorithms"] = {str(2**20): "Ring/LL128", str(2**28): "NVLS/Simple"}
    unchecked = _facts()
    for f in unchecked.values():
        for e in f["results"]:
            e["wrong"] = None
    return {
        "sweep": _facts(wrong={(1, 1024): 5}),
        "unchecked": unchecked,
        "pairs": _with_pairs({"1-2", "2-3"}),
        "nodes": _with_nodes(slow_nodes={"n3"}, slow_leader_pairs={"2-4"}),
        "minimal": {0: _minimal(0, [_entry(1024, [0.001], wrong=None)])},
        "expectation": with_nccl,
        # the odd shapes the diagnosis must survive: written back as they were read
        "odd": {0: {}, 1: {"results": None, "op": "all_reduce"}, 2: {"host": "a", "rank": 1, "error": "probe failed"},
                3: {"pairs": {}}, 4: {"pairs": {"size_bytes": 1024, "times_s": {}}}},
    }


@pytest.mark.parametrize("source", sorted(_unit_test_sources()))
def test_the_unit_tests_facts_read_and_write_back_byte_identical(source):
    for rank, raw in _unit_test_sources()[source].items():
        typed = AllReduceFacts.from_json(raw)
        assert _dumped(typed.to_json()) == _dumped(raw), (source, rank)


def _report(path: Path) -> tuple[str, dict]:
    text = path.read_text()
    return text, json.loads(text)


def _allreduce_facts(report: dict) -> dict[str, dict]:
    (entry,) = [p for p in report["probes"] if p["name"] == "allreduce"]
    return entry["facts"]


def test_there_are_recorded_reports():
    assert {p.name for p in FIXTURES} >= {"bench-2rank-gloo.json", "bench-2rank-gloo-pairs.json"}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_a_recorded_report_reads_and_writes_back_byte_identical(path):
    text, report = _report(path)
    facts = _allreduce_facts(report)
    assert facts
    for rank in facts:
        facts[rank] = AllReduceFacts.from_json(facts[rank]).to_json()
    # as ddpdoctor.core.files writes a report
    assert json.dumps(report, indent=2) + "\n" == text


def _built_as_collect_builds(raw: dict) -> AllReduceFacts:
    """A fresh object from a recorded rank's values, field by field as collect fills it."""
    facts = AllReduceFacts(host=raw["host"], rank=raw["rank"], local_rank=raw["local_rank"], device=raw["device"],
                           backend=raw["backend"], op=raw["op"], dtype=raw["dtype"], world_size=raw["world_size"],
                           warmup=raw["warmup"], iters=raw["iters"])
    for e in raw["results"]:
        facts.results.append(SizeTiming(size_bytes=e["size_bytes"], count=e["count"], in_place=e["in_place"],
                                        times_s=e["times_s"], wrong=e["wrong"]))
    if "pairs" in raw:
        facts.pairs = PairTimings(size_bytes=raw["pairs"]["size_bytes"], times_s=raw["pairs"]["times_s"])
    return facts


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_a_fresh_object_writes_what_collect_wrote_in_its_order(path):
    _, report = _report(path)
    for rank, raw in _allreduce_facts(report).items():
        assert _dumped(_built_as_collect_builds(raw).to_json()) == _dumped(raw), rank


def test_keys_collect_writes_only_when_known_are_left_out_until_set():
    facts = AllReduceFacts(host="a", op="all_reduce")
    assert list(facts.to_json())[-1] == "results"
    facts.nccl_algorithms = {"1024": "Ring/LL"}
    facts.pairs = PairTimings(size_bytes=4096, times_s={"0-1": [0.5]})
    facts.nodes = NodeTimings(size_bytes=4096, node_of_rank=["a", "b"], intra_times_s={}, leader_times_s={"0-1": [1.0]})
    out = facts.to_json()
    assert list(out)[-3:] == ["nccl_algorithms", "pairs", "nodes"]
    assert out["pairs"] == {"size_bytes": 4096, "times_s": {"0-1": [0.5]}}
    assert list(out["nodes"]) == ["size_bytes", "node_of_rank", "intra_times_s", "leader_times_s"]
    facts.pairs.retimed = ["0-1"]
    assert facts.to_json()["pairs"] == {"size_bytes": 4096, "times_s": {"0-1": [0.5]}, "retimed": ["0-1"]}


def test_tolerant_reads_give_defaults():
    facts = AllReduceFacts.from_json({"results": None, "pairs": [], "nodes": "n1", "world_size": "2",
                                      "nccl_algorithms": ["not", "a", "mapping"],
                                      "host": None})
    assert (facts.results, facts.pairs, facts.nodes, facts.world_size, facts.host) == ([], None, None, 0, "")
    assert facts.nccl_choices() == {}
    entry = SizeTiming.from_json({"size_bytes": 1024, "times_s": "fast"})
    assert (entry.size_bytes, entry.times_s, entry.in_place, entry.wrong) == (1024, [], False, None)
    assert AllReduceFacts.from_json(None) == AllReduceFacts()
    assert PairTimings.from_json({"times_s": None}).times_s == {}
    assert AllReduceFacts.from_json({"nccl_algorithms": {"1024": "Tree/LL", "x": "?"}}).nccl_choices() == \
        {1024: "Tree/LL"}


# -- the slow-pair rule: collect's re-timing and diagnose's BW003 agree ---------

def _pair_parts(facts: dict[int, dict]) -> dict[int, PairTimings]:
    return {r: AllReduceFacts.from_json(f).pairs for r, f in facts.items()}


@pytest.mark.parametrize("slow", [{"1-2", "2-3"}, {"0-1"}, set()])
def test_the_pairs_collect_times_again_are_the_ones_diagnose_would_call_slow(slow):
    facts = _with_pairs(slow)
    retimed = pairs_to_retime(_pair_parts(facts), "cpu")
    assert retimed == sorted(tuple(int(x) for x in key.split("-")) for key in slow)
    judged = [f for f in AllReduce().diagnose(facts, _run(hosts=RING_HOSTS)) if f.code == "BW003"]
    assert [f"{a}-{b}" for a, b in retimed] == sorted(judged[0].evidence["slow_pairs"] if judged else [])


def test_a_pair_slowed_by_noise_once_is_not_timed_again():
    assert pairs_to_retime(_pair_parts(_with_pairs(set(), noisy={"0-1"})), "cpu") == []


def test_the_gpu_margin_is_narrower_than_the_cpu_one():
    # 0.7 of the typical pair: noise on shared CPU ranks, a slow link on GPUs.
    size, fast = 4 * 2**20, 1e-3
    parts = {r: PairTimings(size_bytes=size, times_s={f"{a}-{b}": [fast / 0.7 if (a, b) == (0, 1) else fast]
                                                       for a, b in busbw.ring_pairs(4) if r in (a, b)})
             for r in range(4)}
    assert pairs_to_retime(parts, "cpu") == []
    assert pairs_to_retime(parts, "cuda") == [(0, 1)]


def test_no_pair_timings_mean_nothing_to_time_again():
    assert pairs_to_retime({}, "cpu") == []
    assert pairs_to_retime({0: PairTimings(), 1: PairTimings(size_bytes=1024)}, "cuda") == []


def test_a_pair_never_timed_twice_is_not_blamed_when_the_typical_pair_rose():
    """Recorded in a full suite run on 2 cores (`blip:ranks=1,2` on 4 ranks): round one had pair
    1-2 crawling (the blip) and the typical pair depressed by it, so only 1-2 was timed again; it
    was fast then, the typical pair rose to 2.7 GB/s, and pair 2-3 (0.8 GB/s, fine against round
    one's typical) fell under the line without ever being timed again, and was named."""
    size = 4 * 2**20

    def seconds(gbps: float) -> float:  # a 2-rank all-reduce's time for this busbw
        return size / (gbps * 1e9)

    bw = {"0-1": 2.7, "1-2": 2.7, "2-3": 0.8, "0-3": 2.6}  # the best of both rounds for 1-2
    parts = {r: PairTimings(size_bytes=size, retimed=["1-2"],
                            times_s={k: [seconds(v)] for k, v in bw.items() if str(r) in k.split("-")})
             for r in range(4)}
    assert slow_pairs(ring_pair_busbw(parts)[0], "cpu") == [(2, 3)]  # below half the typical pair
    assert blamed_pairs(parts, "cpu")[0] == []  # but it was timed once: not blamed

    def bw003(parts: dict[int, PairTimings]) -> list[str]:
        facts = _facts(hosts=RING_HOSTS)
        for rank, part in parts.items():
            facts[rank]["pairs"] = part.to_json()
        return [f.title for f in AllReduce().diagnose(facts, _run(hosts=RING_HOSTS)) if f.code == "BW003"]

    assert bw003(parts) == []
    for part in parts.values():
        part.retimed = ["1-2", "2-3"]
    assert blamed_pairs(parts, "cpu")[0] == [(2, 3)]  # slow both times: a slow link
    [title] = bw003(parts)
    assert "rank 2" in title and "rank 3" in title, title
