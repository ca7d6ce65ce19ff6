"""callback/metrics.py: each check's step, wait and straggler numbers to on_metrics and TensorBoard;
a sink that raises never reaches the training loop."""

from __future__ import annotations

import importlib.util
import logging
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.metrics import MetricsSink, window_metrics
from ddpdoctor.callback.online_checks import History, RankWindow


def _window(rank: int, step_ms: float, n: int = 10) -> RankWindow:
    return RankWindow(rank=rank, host="n0", step=n, step_ms=[step_ms] * n, data_ms=[1.0] * n,
                      wait_ms=[step_ms / 4] * n, samples=[8.0] * n, fingerprint=0, loader_len=-1,
                      stale_epoch=False, peak_mem_bytes=0)


def test_window_metrics_are_each_ranks_medians_and_the_straggler_scores():
    rows = {0: _window(0, 10.0, 100), 1: _window(1, 10.0, 100), 2: _window(2, 20.0, 100)}
    history = History()
    history.add(rows)
    metrics = window_metrics(rows, history)
    assert metrics["ddpdoctor/step_ms/rank2"] == 20.0 and metrics["ddpdoctor/wait_ms/rank0"] == 2.5
    assert metrics["ddpdoctor/step_ms/max_over_median"] == pytest.approx(2.0)
    scores = {r: metrics[f"ddpdoctor/straggler_pct/rank{r}"] for r in range(3)}
    assert scores[2] > 50 and scores[0] == scores[1] < scores[2] - 50, scores  # the slow rank, by far


def test_a_broken_sink_is_logged_once_and_never_raises(caplog):
    calls = []

    def broken(metrics):
        calls.append(metrics)
        raise RuntimeError("user bug")

    sink = MetricsSink(on_metrics=broken, tensorboard=object())  # a "writer" without add_scalar
    with caplog.at_level(logging.ERROR, logger="ddpdoctor"):
        for step in (1, 2):
            sink.publish_window(step, {0: _window(0, 5.0)}, None)
    assert [c["step"] for c in calls] == [1, 2]  # tried again at every check
    assert caplog.text.count("on_metrics raised") == 1 and caplog.text.count("tensorboard raised") == 1


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))


def test_a_real_doctor_publishes_at_every_check(tmp_path):
    """A world of one on gloo: the checks gather for real; every one reaches both sinks."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    seen, writer = [], _Writer()
    try:
        doctor = Doctor(nn.Linear(4, 2), every=3, check_every_s=0, on_metrics=seen.append, tensorboard=writer)
        try:
            for _ in range(6):
                with doctor.step(torch.zeros(8, 4)):
                    time.sleep(0.002)
        finally:
            doctor.close()
    finally:
        dist.destroy_process_group()
    assert [m["step"] for m in seen] == [1, 3, 6]
    assert all(m["ddpdoctor/step_ms/rank0"] >= 2.0 for m in seen)  # the 2 ms each step really slept
    assert {(tag, step) for tag, _, step in writer.scalars} >= {("ddpdoctor/step_ms/rank0", 6)}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_a_log_folder_gets_a_real_summary_writer(tmp_path):
    sink = MetricsSink(tensorboard=str(tmp_path / "tb"))
    sink.publish(7, {"ddpdoctor/step_ms/rank0": 12.5})
    sink.writer().flush()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    (scalar,) = events.Scalars("ddpdoctor/step_ms/rank0")
    assert scalar.step == 7 and scalar.value == 12.5
