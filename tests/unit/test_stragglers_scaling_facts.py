"""The stragglers and scaling facts, typed: the wire unchanged, tolerant reads, collect's key order.

The recordings in tests/fixtures/stragglers are real reports' facts: read into the dataclasses
and written back they must be the same bytes. A report from an older or newer version, or a
hand-edited one, may miss keys or hold nulls: those read as defaults and the diagnosis still
runs. A freshly built object writes its keys in the order collect has always written them.
"""

from __future__ import annotations

import functools

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from ddpdoctor.core import keys
from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.measure.clock_offset import ClockOffset
from ddpdoctor.probes import get_probe
from ddpdoctor.probes.base import RunView, diagnose_safely
from ddpdoctor.probes.scaling.facts import ScalingFacts
from ddpdoctor.probes.scaling.judge import diagnose_scaling, evaluate
from ddpdoctor.probes.stragglers.facts import ClockFacts, SampledFacts, StragglersFacts
from ddpdoctor.probes.stragglers.scores import diagnose_stragglers
from ddpdoctor.runtime import scaling_run
from ddpdoctor.runtime.scaling_run import DEFAULT_KNOB, KnobRow, SizeRow, SizeTimeline
from ddpdoctor.runtime.step_timing import StepSeries, StepTimeline

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stragglers"
RECORDINGS = sorted(p.name for p in FIXTURES.glob("*.json"))


def compact(value: Any) -> str:
    """JSON as the recordings are written: no spaces."""
    return json.dumps(value, separators=(",", ":"))


# The keys of the collect side before the facts were typed, in the order it wrote them.
STRAGGLERS_KEYS = ["rank", "host", "device", "backend", "device_name", "torch_threads", "batch_size", "parameters",
                   "comm_calls", "steps", "samples", "arrival_s", "clock", "solo_ms", "peak_mem_bytes",
                   "injected_ms", "sampled"]
SCALING_KEYS = ["rank", "host", "device", "backend", "model", "cpus_usable", "sizes", "knobs", "batch_size",
                "sizes_asked", "parameters", "gradient_bytes"]
SERIES = ["data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms", "step_ms"]


def test_there_are_recordings() -> None:
    assert len(RECORDINGS) >= 6


@pytest.mark.parametrize("name", RECORDINGS)
def test_every_recording_round_trips_byte_for_byte(name: str) -> None:
    text = (FIXTURES / name).read_text()
    data = json.loads(text)
    typed = facts_by_rank(StragglersFacts, data["facts"])
    assert all(isinstance(f.steps, StepTimeline) and isinstance(f.sampled, SampledFacts) for f in typed.values())
    again = {"recorded": data["recorded"], "facts": {str(r): f.to_json() for r, f in typed.items()}}
    assert compact(again) == text.rstrip("\n")


@pytest.mark.parametrize("name", RECORDINGS)
def test_recordings_were_written_in_the_field_order(name: str) -> None:
    """A fresh object built from a recording's values writes the recording's bytes: the field
    order is collect's order, down to the nested clock, samples and timeline."""
    data = json.loads((FIXTURES / name).read_text())
    for raw in data["facts"].values():
        read = StragglersFacts.from_json(raw)
        # `contention` came later (issue 31), last, and is left out where it was not read: the
        # recordings made before it have none.
        order = STRAGGLERS_KEYS + (["contention"] if "contention" in raw else [])
        fresh = StragglersFacts(**{k: getattr(read, k) for k in order})
        fresh.steps = StepTimeline(**read.steps.columns())
        fresh.clock = ClockFacts(offset_ms=read.clock.offset_ms, error_ms=read.clock.error_ms,
                                 source=read.clock.source)
        assert list(fresh.to_json()) == order == list(raw)
        assert list(fresh.steps.to_json()) == SERIES == list(raw["steps"])
        assert compact(fresh.to_json()) == compact(raw)


def test_a_fresh_stragglers_object_writes_collects_keys_in_order() -> None:
    assert list(StragglersFacts().to_json()) == STRAGGLERS_KEYS
    assert list(StepTimeline().to_json()) == SERIES


def test_the_step_series_fills_the_timeline_rounded_per_column() -> None:
    series = StepSeries()
    series.add(1.5, 32, data_ms=0.123456, forward_ms=1.0, backward_ms=2.0, comm_wait_ms=3.0, optimizer_ms=0.5,
               step_ms=6.623456)
    assert series.columns.to_json() == {"data_ms": [0.1235], "forward_ms": [1.0], "backward_ms": [2.0],
                                        "comm_wait_ms": [3.0], "optimizer_ms": [0.5], "step_ms": [6.6235]}
    assert series.arrival_s == [1.5] and series.samples == [32]


def test_the_clock_and_samples_types_hold_what_their_producers_write() -> None:
    from ddpdoctor.measure.sampler import RankSampler

    for offset in (ClockOffset(0.0, 0.0, "rank 0"), ClockOffset(0.0, float("inf"), "rank 0 did not answer")):
        assert list(ClockFacts().to_json()) == list(offset.to_json())
        assert ClockFacts.from_json(offset.to_json()).to_json() == offset.to_json()
    with RankSampler(None, interval_s=0.01) as sampler:
        pass
    written = sampler.facts()
    assert list(SampledFacts().to_json()) == list(written)
    assert json.dumps(SampledFacts.from_json(written).to_json()) == json.dumps(written)


def test_missing_and_null_stragglers_keys_read_as_defaults() -> None:
    empty = StragglersFacts.from_json({})
    assert empty.steps.step_ms == [] and empty.clock.error_ms is None and empty.sampled.clock_event_reasons == []
    nulls = StragglersFacts.from_json({"steps": None, "clock": None, "sampled": None, "samples": None,
                                       "peak_mem_bytes": None, "device": None})
    assert nulls.steps == StepTimeline() and nulls.peak_mem_bytes == 0 and nulls.device == ""
    assert nulls.sampled.host_cpu_pct is None and nulls.samples == []
    wrong = StragglersFacts.from_json({"steps": 5, "sampled": {"gpu_util_pct": "busy", "clock_event_reasons": "x"}})
    assert wrong.steps.step_ms == [] and wrong.sampled.gpu_util_pct is None
    assert wrong.sampled.clock_event_reasons == []
    # ... and what was read comes back as it was, nulls and all.
    assert nulls.to_json() == {"steps": None, "clock": None, "sampled": None, "samples": None,
                               "peak_mem_bytes": None, "device": None}


def test_a_recording_without_its_samples_and_clock_is_still_judged() -> None:
    data = json.loads((FIXTURES / "slow_compute_x1.2_rank2.json").read_text())["facts"]
    for f in data.values():
        f["sampled"] = None
        del f["clock"]
    run = RunView(world_size=4, hosts={int(r): "vm" for r in data})
    found = diagnose_safely(get_probe("stragglers"), data, run)
    assert [f.ranks for f in found if f.code == "STR001"] == [(2,)]
    assert "RUN011" not in {f.code for f in found}


def test_typed_and_plain_stragglers_facts_give_the_same_findings() -> None:
    data = json.loads((FIXTURES / "slow_data_2ms_rank2.json").read_text())["facts"]
    run = RunView(world_size=4, hosts={int(r): "vm" for r in data})
    typed = facts_by_rank(StragglersFacts, copy.deepcopy(data))
    assert [(f.code, f.title) for f in diagnose_stragglers(typed, run)] == \
        [(f.code, f.title) for f in diagnose_stragglers(data, run)]


# -- scaling ------------------------------------------------------------------------------------

def _timeline(steps: int, alone: bool) -> SizeTimeline:
    timeline = SizeTimeline()
    for step in range(steps):
        timeline.add(data_ms=0.5 + step, forward_ms=1.0, backward_ms=3.0, optimizer_ms=0.25, step_ms=5.0 + step)
        if alone:
            timeline.add_alone(forward_ms=1.0, backward_ms=2.5)
    timeline.spun_ms.append(0.0)
    return timeline


def test_a_size_row_holds_the_medians_and_omits_the_columns_not_measured() -> None:
    two = _timeline(3, alone=True).row(3).to_json()
    assert list(two) == ["steps", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms",
                         "forward_alone_ms", "backward_alone_ms", "spun_ms", "step_ms_all"]
    assert two["data_ms"] == 1.5 and two["step_ms"] == 6.0 and two["step_ms_all"] == [5.0, 6.0, 7.0]
    one = _timeline(3, alone=False).row(3).to_json()
    assert "forward_alone_ms" not in one and "backward_alone_ms" not in one
    assert list(KnobRow(step_ms=1.0, accumulate=4, ms_per_batch=0.25).to_json()) == [
        "step_ms", "accumulate", "ms_per_batch"]


def _scaling_report() -> dict[str, Any]:
    """Two ranks' facts as a report holds them: string ranks, one size with no alone columns."""
    def rank(r: int) -> dict[str, Any]:
        facts = ScalingFacts(rank=r, host="h", device="cpu", backend="gloo", model="built-in MLP", cpus_usable=8,
                             batch_size=32, sizes_asked=[], parameters=1000, gradient_bytes=4000)
        if r == 0:
            facts.sizes["1"] = _timeline(4, alone=False).row(4)
        facts.sizes["2"] = _timeline(4, alone=True).row(4)
        facts.knobs[DEFAULT_KNOB] = KnobRow(step_ms=5.5, accumulate=1, ms_per_batch=5.5)
        return facts.to_json()
    return {"0": rank(0), "1": rank(1)}


def test_a_fresh_scaling_object_writes_collects_keys_in_order() -> None:
    assert list(ScalingFacts().to_json()) == SCALING_KEYS
    assert list(_scaling_report()["0"]) == SCALING_KEYS


def test_scaling_facts_round_trip_byte_for_byte_with_unknown_and_null_keys() -> None:
    report = _scaling_report()
    report["1"]["sizes"]["2"]["from_a_newer_version"] = [1, 2]
    report["1"]["knobs"] = None
    report["0"]["batch_size"] = None
    text = compact(report)
    typed = facts_by_rank(ScalingFacts, json.loads(text))
    assert typed[1].knobs == {} and typed[0].batch_size is None
    assert compact({str(r): f.to_json() for r, f in typed.items()}) == text


def test_missing_and_malformed_scaling_keys_read_as_defaults_and_are_not_judged() -> None:
    empty = ScalingFacts.from_json({"sizes": {"2": None}, "knobs": [1], "sizes_asked": None})
    assert empty.sizes["2"] == SizeRow() and empty.knobs == {} and empty.sizes_asked == []
    report = _scaling_report()
    assert [r.n for r in evaluate(report)] == [1, 2]
    report["0"]["sizes"]["2"]["step_ms"] = "slow"  # not a number: that rank did not report size 2
    assert [r.n for r in evaluate(report)] == [1]
    report["1"]["sizes"]["2"] = None
    assert [r.n for r in evaluate(report)] == [1]
    assert {f.code for f in diagnose_scaling(report, RunView(world_size=2), DEFAULT_KNOB)} == {"SCL003"}


def test_typed_and_plain_scaling_facts_give_the_same_findings() -> None:
    report = _scaling_report()
    run = RunView(world_size=2, hosts={0: "h", 1: "h"})
    typed = facts_by_rank(ScalingFacts, copy.deepcopy(report))
    plain = [(f.code, f.title, f.evidence) for f in diagnose_scaling(report, run, DEFAULT_KNOB)]
    assert [(f.code, f.title, f.evidence) for f in diagnose_scaling(typed, run, DEFAULT_KNOB)] == plain
    assert "SCL000" in {code for code, _, _ in plain}


class _FakeChannel:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> None:
        self.values[key] = json.loads(json.dumps(value))

    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str) -> Any:
        return self.values.get(key)


class _FakeContext:
    """Just what `_turn` touches: one rank of one, publishing into a dict."""

    rank = 0

    def __init__(self) -> None:
        self.channel = _FakeChannel()
        self.published: list[dict[str, Any]] = []

    def publish_partial(self, probe: str, facts: Any) -> None:
        self.published.append(json.loads(json.dumps(facts.to_json())))

    @contextlib.contextmanager
    def collective(self, name: str, **details: Any) -> Iterator[None]:
        yield

    def progress(self) -> None:
        pass


def test_each_size_is_published_as_the_whole_facts_in_collects_order() -> None:
    ctx = _FakeContext()
    facts = ScalingFacts(rank=0, host="h", device="cpu", backend="gloo", model="built-in MLP", cpus_usable=2,
                         batch_size=32, parameters=10, gradient_bytes=40)
    row = _timeline(2, alone=False).row(2)
    scaling_run._turn(ctx, facts, facts.sizes, "1", functools.partial(keys.scaling_size_done, 1), 1, "size 1",  # type: ignore[arg-type]
                      lambda: row)
    [published] = ctx.published
    assert list(published) == SCALING_KEYS and published["sizes"] == {"1": row.to_json()}
    assert ctx.channel.has(keys.scaling_size_done(1, 0))
