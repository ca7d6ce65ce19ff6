"""A crash made by a setting, named by that setting (issue 51): real ranks, a real crash, no injection.

On torch 2.13.0 (the CI's CPU wheel) `TORCH_DISTRIBUTED_DEBUG=DETAIL` makes every rank's
`DistributedDataParallel(model)` die of SIGSEGV in `_ddp_init_helper`, as torch's issues report crashes under
DETAIL. `ddpdoctor check`, which started the ranks, runs the failing probe again without the behaviour-changing
settings, then with each alone, and leads with the one the stage crashes with. A second setting that changes
nothing on CPU (NCCL_ALGO) set beside it must be cleared, not blamed (slow tier). Where another torch does not
crash under DETAIL, the run must be healthy and quiet about settings (both branches assert).
"""

from __future__ import annotations

import pytest

from .harness import assert_nothing_left, run_check

pytestmark = pytest.mark.ranks


def _named_by_detail(tmp_path, env: dict[str, str], culprits: list[str]) -> None:
    run = run_check(tmp_path, "--nproc", "2", "--device", "cpu", "--probes", "gpu-count", env=env, timeout_s=180)
    assert run.report is not None, run.explain()
    settings = run.report["settings"]
    # The host's own (a GPU machine's NCCL_* exports) may be there too; ddpdoctor's own TORCH_CPP_LOG_LEVEL is not.
    assert env.items() <= settings["env_settings"].items()
    assert "TORCH_CPP_LOG_LEVEL" not in settings["env_settings"], settings
    crashes = run.findings("RUN002") + run.findings("RUN003")
    if "retried" not in settings:  # this torch does not crash under DETAIL: nothing to retry, nothing said
        assert run.returncode == 0 and not crashes and not run.findings("RUN013"), run.explain()
        assert_nothing_left(run)
        return
    first = run.report["findings"][0]
    assert first["code"] == "RUN013" and first["ranks"] == [0, 1], run.explain()
    assert first["title"].startswith("DDP construction") and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in first["title"]
    assert "NCCL_ALGO" not in first["title"] and first["evidence"]["crash"] == "SIGSEGV"
    retried = settings["retried"]
    assert retried["passed"] is True and retried["culprits"] == culprits, retried
    assert set(env) <= set(retried["without"])  # tried without them all, then each alone
    assert retried["stage"] == "ddp" and retried["probe"] == "gpu-count" and retried["seconds"] < 90
    assert not crashes, "one finding for the cause, not a crash per rank beside it"
    assert run.returncode == 2 and run.report["verdict_line"].startswith("RUN013"), run.report["verdict_line"]
    assert "trying it once more" in run.stdout + run.stderr
    assert_nothing_left(run)


def test_a_crash_made_by_a_setting_is_named_by_that_setting(tmp_path):
    _named_by_detail(tmp_path, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, ["TORCH_DISTRIBUTED_DEBUG"])


@pytest.mark.slow
def test_a_setting_beside_the_one_that_crashes_is_cleared_by_trying_each_alone(tmp_path):
    """NCCL_ALGO (nothing on CPU) set beside DETAIL: without both it passes, with each alone only DETAIL
    crashes, so DETAIL alone is named (four launches, 17 s).
    Default twin: tests/ranks/test_crash_settings_e2e.py::test_a_crash_made_by_a_setting_is_named_by_that_setting
    (the same crash, retry and finding with one setting; the tries one by one are unit-tested in
    tests/unit/test_crash_settings.py)."""
    _named_by_detail(tmp_path, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_ALGO": "Ring"},
                     ["TORCH_DISTRIBUTED_DEBUG"])


@pytest.mark.slow
def test_every_rank_failing_alike_in_init_under_a_setting_is_named_by_it(tmp_path):
    """Made another way: GLOO_DEVICE_TRANSPORT=uv on a torch built without libuv fails every rank inside
    init_process_group with "makeDeviceForInterface(): unsupported gloo device" (not a crash: no one rank is the
    cause, RUN008). Tried again without it, init passes: the setting leads.
    Default twin: tests/ranks/test_crash_settings_e2e.py::test_a_crash_made_by_a_setting_is_named_by_that_setting
    (the same retry and RUN013; the failing-alike rule is unit-tested in tests/unit/test_crash_settings.py)."""
    run = run_check(tmp_path, "--nproc", "2", "--device", "cpu", "--probes", "gpu-count",
                    env={"GLOO_DEVICE_TRANSPORT": "uv"}, timeout_s=180)
    assert run.report is not None, run.explain()
    if "retried" not in run.report["settings"]:  # a torch built with libuv takes it: a healthy run
        assert run.returncode == 0 and not run.findings("RUN013") and not run.findings("RUN008"), run.explain()
        assert_nothing_left(run)
        return
    first = run.report["findings"][0]
    assert first["code"] == "RUN013" and first["ranks"] == [0, 1], run.explain()
    assert first["title"] == "init_process_group fails with GLOO_DEVICE_TRANSPORT=uv and passes without it"
    assert "unsupported gloo device" in first["why"] and not run.findings("RUN008")
    assert run.returncode == 2
    assert_nothing_left(run)


@pytest.mark.slow
def test_a_healthy_run_with_settings_is_never_retried(tmp_path):
    """Default twin: tests/ranks/test_crash_settings_e2e.py::test_a_crash_made_by_a_setting_is_named_by_that_setting
    (a check with a setting set; every healthy default check crosses the plan that finds nothing to try)."""
    run = run_check(tmp_path, "--nproc", "2", "--device", "cpu", "--probes", "gpu-count", env={"NCCL_ALGO": "Ring"},
                    timeout_s=120)
    assert run.returncode == 0 and run.report is not None, run.explain()
    assert "retried" not in run.report["settings"] and not run.findings("RUN013")
    assert "trying it once more" not in run.stdout + run.stderr
    assert_nothing_left(run)
