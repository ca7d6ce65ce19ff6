"""The callback's gathered row: one layout, packed and unpacked by one pair, and what `Doctor` gathers with it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.row import COLUMNS, HEADER, SCALARS, GatheredRow, pack, packed_length, unpack

FULL = GatheredRow(rank=3, steps_done=150, loader_len_batches=1250, stale_epoch=True, peak_mem_bytes=79 * 2**30 + 7,
                   batch_fingerprint=2**52 - 3, wait_measured=True, loss_nonfinite_step=31, step_ms=[12.5, 13.25, 11.0],
                   data_ms=[0.5, 0.75, 2.0], wait_ms=[1.0, 0.0, 3.5], samples=[32.0, 32.0, 31.0])
UNKNOWN = GatheredRow(rank=0, steps_done=1, step_ms=[4.0], data_ms=[0.0], wait_ms=[0.0], samples=[0.0])


@pytest.mark.parametrize("row, width", [(FULL, 3), (FULL, 50), (UNKNOWN, 2), (GatheredRow(rank=1, steps_done=0), 4)])
def test_unpack_reads_back_what_pack_wrote(row, width):
    values = pack(row, width)
    assert len(values) == packed_length(width)
    assert unpack(values) == row


def test_an_unknown_scalar_travels_as_nan_and_a_known_zero_does_not():
    values = pack(UNKNOWN, 2)
    names = [name for name, _ in SCALARS]
    for name in ("loader_len_batches", "peak_mem_bytes", "batch_fingerprint", "loss_nonfinite_step"):
        assert math.isnan(values[names.index(name)])
    zeros = GatheredRow(rank=0, steps_done=1, loader_len_batches=0, peak_mem_bytes=0, batch_fingerprint=0)
    back = unpack(pack(zeros, 2))
    assert (back.loader_len_batches, back.peak_mem_bytes, back.batch_fingerprint) == (0, 0, 0)


def test_the_layout_is_the_fields_scalars_then_count_then_padded_columns():
    assert COLUMNS == ["step_ms", "data_ms", "wait_ms", "samples"]
    assert HEADER == len(SCALARS) + 1 == 32
    values = pack(FULL, 5)
    assert values[:2] == [3.0, 150.0] and values[HEADER - 1] == 3.0  # rank, steps done, ..., count
    assert values[HEADER:HEADER + 5] == [12.5, 13.25, 11.0, 0.0, 0.0]  # a column padded to the width
    assert values[HEADER + 5:HEADER + 10] == [0.5, 0.75, 2.0, 0.0, 0.0]


def test_columns_of_different_lengths_or_past_the_width_are_refused():
    with pytest.raises(ValueError):
        pack(GatheredRow(rank=0, steps_done=2, step_ms=[1.0, 2.0], data_ms=[1.0]), 4)
    with pytest.raises(ValueError):
        pack(FULL, 2)
    with pytest.raises(ValueError):
        unpack([0.0] * (HEADER + 3))


def test_unknowns_reach_the_judges_as_their_sentinels():
    window = UNKNOWN.to_window("node0")
    assert (window.loader_len, window.fingerprint, window.peak_mem_bytes, window.wait_measured) == (-1, 0, 0, False)
    full = FULL.to_window("node1")
    assert (full.rank, full.host, full.step, full.loader_len, full.fingerprint) == (3, "node1", 150, 1250, 2**52 - 3)
    assert full.step_ms == FULL.step_ms and full.samples == FULL.samples and full.stale_epoch


def test_the_cpu_set_a_rank_published_reaches_its_contention_reading():
    """The gather carries numbers; the CPU set (the same-cores rule needs it) comes from the store."""
    row = GatheredRow(rank=1, steps_done=20, wall_s=0.5, run_delay_pct=30.0)
    reading = row.to_window("node1", "4-7").contention
    assert reading is not None and reading["cpus"] == "4-7" and reading["run_delay_pct"] == 30.0
    unknown = row.to_window("node1").contention
    assert unknown is not None and unknown["cpus"] is None


@pytest.fixture
def gloo_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_check_gathers_the_window_the_judges_then_read(gloo_group, monkeypatch):
    doctor = Doctor(nn.Linear(4, 2), every=3, check_every_s=0)
    judged = []
    try:
        monkeypatch.setattr(doctor, "_judge", lambda rows: judged.append(rows) or [])
        for size in (5, 6, 7, 8):  # step 1 is checked, then every third step
            with doctor.step(torch.randn(size, 4)):
                pass
    finally:
        doctor.close()
    assert len(judged) == 2
    first, second = judged[0][0], judged[1][0]
    assert (first.rank, first.step, first.samples, len(first.step_ms)) == (0, 1, [5.0], 1)
    # Each check sends the steps since the one before: step 3's, steps 2 and 3.
    assert (second.step, second.samples, len(second.data_ms), len(second.wait_ms)) == (3, [6.0, 7.0], 2, 2)
    assert second.loader_len == -1 and second.fingerprint != 0 and second.peak_mem_bytes > 0
    assert not second.wait_measured  # not DDP: no reducer to read


def test_a_ddp_models_wait_is_read_from_its_reducer_and_no_hook_is_added(gloo_group):
    """The wait comes from DDP's own timings: no comm hook of ours in the backward pass (the job may
    register its own), and no DOC011."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(4, 2))
    doctor = Doctor(model, every=3)
    try:
        assert doctor.wait_measured
        assert model.logger is not None and not any(f.code == "DOC011" for f in doctor.findings)
        model.register_comm_hook(None, lambda state, bucket: __import__("torch").distributed.all_reduce(
            bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0]))  # the job's own: accepted
    finally:
        doctor.close()
