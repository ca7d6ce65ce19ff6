"""Reading this rank's Flight Recorder live (fr_snapshot): real entries from a one-process gloo group."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from ddpdoctor.measure import fr_snapshot


@pytest.fixture()
def gloo_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_last_calls_come_back_with_their_shapes_and_dtypes(gloo_group):
    for _ in range(5):
        dist.all_reduce(torch.ones(3))
    dist.all_reduce(torch.ones(7, dtype=torch.float64))
    snap = fr_snapshot.take(limit=4)
    assert "unknown" not in snap, snap
    json.dumps(snap)  # published through the store as JSON
    entries = snap["entries"]
    assert len(entries) <= 4 * len({str(e["process_group"]) for e in entries})
    last = entries[-1]
    assert last["profiling_name"].endswith("all_reduce") and last["input_sizes"] == [[7]]
    assert last["input_dtypes"] == ["Double"] and entries[-2]["input_sizes"] == [[3]]
    assert last["collective_seq_id"] == entries[-2]["collective_seq_id"] + 1


def test_a_recorder_that_cannot_be_read_is_a_value_not_an_error(monkeypatch):
    def broken(**_):
        raise RuntimeError("no recorder here")

    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace", broken)
    assert fr_snapshot.take() == {"unknown": "RuntimeError: no recorder here"}


def test_an_empty_recorder_is_off_only_when_a_variable_says_so(monkeypatch):
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace",
                        lambda **_: __import__("pickle").dumps({"version": "2.10", "entries": []}))
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    assert fr_snapshot.take() == {"unknown": "the Flight Recorder holds no collective yet"}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert fr_snapshot.take() == {"unknown": "the Flight Recorder is turned off (TORCH_FR_BUFFER_SIZE=0)", "off": True}
