"""gpu-count end to end on CPU ranks: real environment mismatches through the whole pipeline.

There is no GPU here, so the faults are the ones a node's environment makes: a
CUDA_VISIBLE_DEVICES that differs on one rank, an unreadable one, and a Slurm allocation
that CUDA does not see. Each rank really runs with that environment.
"""

from __future__ import annotations

import pytest

from .harness import run_check, run_hand_set_ranks, tagged_processes

pytestmark = pytest.mark.ranks


def _codes(report, code):
    return [f for f in report["findings"] if f["code"] == code]


@pytest.mark.slow
def test_healthy_cpu_ranks_say_no_gpu_and_raise_nothing(tmp_path):
    """Default twin: tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm
    (the same gpu-count probe on healthy CPU ranks, GPU000 and the probe ok, with the other default probes)
    """
    run = run_check(tmp_path, "--nproc", "2", "--probes", "gpu-count")
    assert run.returncode == 0, run.explain()
    assert [f["code"] for f in run.findings()] == ["GPU000"]
    assert run.findings()[0]["severity"] == "info"
    facts = run.report["probes"][0]["facts"]
    assert all(f["nvml"]["available"] is False and f["nvml"]["reason"] for f in facts.values())
    assert all(f["env"]["LOCAL_WORLD_SIZE"] == "2" for f in facts.values())


@pytest.mark.slow
def test_visible_devices_that_break_the_local_rank_mapping(tmp_path):
    """Default twin: tests/ranks/test_gpu_count_e2e.py::test_slurm_allocation_that_cuda_does_not_see
    (the same gpu-count probe judging each hand-set rank's GPU environment, the faulty ranks named;
    GPU005's rules: tests/unit)
    """
    env = {
        0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
        1: {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "CUDA_VISIBLE_DEVICES": "0,x,2"},
        2: {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "CUDA_VISIBLE_DEVICES": "0,1"},
    }
    procs, report, tag = run_hand_set_ranks(tmp_path, 3, env, "--probes", "gpu-count", "--timeout", "20")
    assert procs[0].returncode == 2, procs[0].stdout + procs[0].stderr
    ordinal = [f for f in _codes(report, "GPU005") if "invalid device ordinal" in f["why"]]
    assert len(ordinal) == 1 and ordinal[0]["ranks"] == [2]
    assert ordinal[0]["evidence"]["visible_gpus"] == 2 and ordinal[0]["evidence"]["LOCAL_RANK"] == 2
    unreadable = [f for f in _codes(report, "GPU005") if f["severity"] == "warn"]
    assert len(unreadable) == 1 and unreadable[0]["ranks"] == [1]
    assert unreadable[0]["evidence"]["used"] == ["0"] and unreadable[0]["evidence"]["ignored"] == ["x", "2"]
    assert not any(0 in f["ranks"] for f in report["findings"] if f["probe"] == "gpu-count"
                   and f["severity"] in ("warn", "critical"))
    assert not tagged_processes(tag)


def test_slurm_allocation_that_cuda_does_not_see(tmp_path):
    env = {r: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "SLURM_STEP_GPUS": "0,1",
               "SLURM_GPUS_ON_NODE": "2"} for r in (0, 1)}
    procs, report, tag = run_hand_set_ranks(tmp_path, 2, env, "--probes", "gpu-count", "--timeout", "20")
    assert procs[0].returncode == 1, procs[0].stdout + procs[0].stderr
    mismatch = _codes(report, "GPU006")
    assert sorted(r for f in mismatch for r in f["ranks"]) == [0, 1]
    assert mismatch[0]["evidence"]["SLURM_STEP_GPUS"] == "0,1" and mismatch[0]["evidence"]["torch_gpus"] == 0
    assert not tagged_processes(tag)
