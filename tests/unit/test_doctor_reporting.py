"""`Doctor`'s reporting paths in one process with no process group: each finding once, the hook, the raise."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from ddpdoctor.callback.doctor import WINDOW_CAP, Doctor, FindingRaised
from ddpdoctor.callback.user_objects import first_tensor as _first_tensor, fingerprint as _fingerprint
from ddpdoctor.core.findings import Finding, Severity


def finding(code: str = "DOC003", severity: Severity = Severity.WARN) -> Finding:
    return Finding(code=code, severity=severity, title="t", probe="callback", ranks=(0,))


def test_each_finding_reaches_the_hook_and_the_json_once(tmp_path):
    seen = []
    path = tmp_path / "f.json"
    doctor = Doctor(nn.Linear(2, 2), on_finding=seen.append, json_path=str(path))
    try:
        doctor._emit(finding())
        doctor._emit(finding())  # the same code and ranks again: not repeated
        doctor._emit(finding("DOC006"))
        assert [f.code for f in seen] == ["DOC003", "DOC006"]
        assert [f["code"] for f in json.loads(path.read_text())["findings"]] == ["DOC003", "DOC006"]
        assert [f.code for f in doctor.report()] == ["DOC003", "DOC006"]
    finally:
        doctor.close()


def test_a_broken_hook_never_breaks_training(caplog):
    def broken(_):
        raise RuntimeError("user bug")

    doctor = Doctor(nn.Linear(2, 2), on_finding=broken)
    try:
        doctor._emit(finding())  # must not raise
        assert "on_finding raised" in caplog.text
    finally:
        doctor.close()


def test_raise_on_finding_raises_for_warnings_only():
    doctor = Doctor(nn.Linear(2, 2), raise_on_finding=True)
    try:
        doctor._emit(finding("STR005", Severity.INFO))
        with pytest.raises(FindingRaised, match="DOC003"):
            doctor._emit(finding())
    finally:
        doctor.close()


def test_steps_without_a_process_group_are_timed_and_never_gathered():
    doctor = Doctor(nn.Linear(4, 2), every=2)
    try:
        for _ in range(101):
            with doctor.step(torch.zeros(3, 4)):
                pass
        # Timed, and with no check to take the columns, only the last WINDOW_CAP are kept: a long
        # single-process job does not grow a list per step.
        assert doctor._steps == 101 and len(doctor._samples) == len(doctor._step_ms) == 101
        assert set(doctor._samples) == {3.0}
        for _ in range(WINDOW_CAP):
            with doctor.step(torch.zeros(3, 4)):
                pass
        assert len(doctor._samples) == len(doctor._step_ms) == len(doctor._data_ms) == WINDOW_CAP
    finally:
        doctor.close()


def test_on_hang_must_be_known():
    with pytest.raises(ValueError, match="on_hang"):
        Doctor(nn.Linear(2, 2), on_hang="ignore")


def test_batch_fingerprints_tell_batches_apart_and_find_the_first_tensor():
    a, b = torch.arange(64.0).reshape(8, 8), torch.arange(64.0).reshape(8, 8) + 1
    assert _fingerprint((a, "labels")) == _fingerprint([a]) != _fingerprint({"x": b})
    assert 0 < _fingerprint(a) < 2**53  # exact in the float64 row it travels in
    assert _first_tensor({"meta": "x", "inputs": [a]}) is a and _fingerprint("text") == 0


def test_other_data_parallel_wrappers_are_not_called_unwrapped():
    from torch.nn.parallel import DistributedDataParallel

    from ddpdoctor.callback.user_objects import is_wrapped as _is_wrapped, unsharded_sampler as _unsharded_sampler

    class FSDPLinear(nn.Linear):  # what FSDP2's fully_shard makes of an nn.Linear
        pass

    class Compiled(nn.Module):  # torch.compile's wrapper keeps the original as _orig_mod
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    assert _is_wrapped(FSDPLinear(2, 2), DistributedDataParallel)
    assert _is_wrapped(Compiled(FSDPLinear(2, 2)), DistributedDataParallel)
    assert not _is_wrapped(nn.Linear(2, 2), DistributedDataParallel)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    assert _unsharded_sampler(loader, loader.sampler) == "SequentialSampler"

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    streamed = torch.utils.data.DataLoader(Stream(), batch_size=2)
    assert _unsharded_sampler(streamed, streamed.sampler) is None  # an IterableDataset shards itself


STUCK_STORE = """
import threading, time
from torch import nn
from ddpdoctor.callback import hang
from ddpdoctor.callback.doctor import Doctor
class Stuck:  # a store whose calls never return, as a TCPStore held by another client can
    def set(self, *args): threading.Event().wait()
    def check(self, *args): threading.Event().wait()
hang.COLLECT_S, hang.CULPRIT_EXIT_GRACE_S = 0.5, 0.5  # every wait of the hang's exchange: 4.5 s
doctor = Doctor(nn.Linear(2, 2), on_hang="exit")
doctor._store, doctor.world_size = Stuck(), 2
print("began", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: the parent's clock too
doctor._hang.cross_rank_hang(None)
print("returned", flush=True)
"""


def test_leaving_after_a_hang_does_not_wait_on_a_store_that_never_answers():
    # Every wait of the exchange adds up to 4.5 s here; the backstop ends the process 2 s after, "hung".
    # Timed from the exchange's start, as the child reports it: its own start (a Python importing torch) took
    # from 2 to over 20 s with four ranks of a benchmark on the same two cores, and failed a bar of the
    # whole process's time (34.8 s), which is not what this test is about.
    proc = subprocess.run([sys.executable, "-c", STUCK_STORE], capture_output=True, text=True, timeout=90)
    ended = time.monotonic()
    assert proc.returncode == 124 and "returned" not in proc.stdout, proc.stderr
    began = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("began ")))
    took = ended - began
    assert 6.5 <= took < 25, took


def test_a_step_whose_check_raised_is_over_not_hung(monkeypatch):
    # raise_on_finding raises out of step_end; the watchdog must not then report the ended step as stuck.
    doctor = Doctor(nn.Linear(2, 2), raise_on_finding=True)
    try:
        def judged() -> None:
            raise FindingRaised("DOC009: t")

        monkeypatch.setattr(doctor, "_data_parallel_step", judged)
        doctor._dp_done = False
        with pytest.raises(FindingRaised):
            with doctor.step(torch.randn(3, 2)):
                pass
        assert doctor._began == 0.0 and doctor._last_end > 0
    finally:
        doctor.close()


def test_a_step_without_a_batch_counts_no_samples():
    # Not a guessed batch of 1: DOC010 (the effective batch) is then not said at all.
    from ddpdoctor.callback.online_checks import batch_scaling_finding

    doctor = Doctor(nn.Linear(2, 2))
    try:
        with doctor.step():
            pass
        with doctor.step(torch.randn(5, 2)):
            pass
        assert list(doctor._samples) == [0.0, 5.0]
        assert batch_scaling_finding({0: 0.0, 1: 0.0}, [0.1], nodes=["h"]) is None
    finally:
        doctor.close()
