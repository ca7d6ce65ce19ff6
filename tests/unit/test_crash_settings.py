"""A crash and the settings it ran with (issue 51): the table, the judging (RUN013, or the crash finding with the
settings it ran with) and the retry's plan and tries, on hand-made RunRecords.

The end-to-end proof, a real SIGSEGV under TORCH_DISTRIBUTED_DEBUG=DETAIL, is tests/ranks/test_crash_settings_e2e.py.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.core.behaviour_env import behaviour_settings
from ddpdoctor.core.run_record import ExitInfo, RunRecord
from ddpdoctor.judge.run_diagnosis import diagnose_run
from ddpdoctor.runtime.config import CheckConfig
from ddpdoctor.session import crash_retry

from .test_run_diagnosis import T0, critical, make_record, timeline

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_ALGO": "Ring"}


def segfault_in_ddp(world: int = 2, settings: Any = None, **fields: Any) -> RunRecord:
    fields.setdefault("timelines", {r: timeline("ddp", "running") for r in range(world)})
    record = make_record(world, exits={r: ExitInfo(-11, signal="SIGSEGV", t=T0 + 4 + r, log_tail=[
                             '  File "/x/torch/nn/parallel/distributed.py", line 1473 in _ddp_init_helper'])
                             for r in range(world)}, **fields)
    record.settings = dict(settings or {})
    return record


def test_the_table_picks_what_changes_behaviour_and_leaves_the_rest():
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_P2P_DISABLE": "1", "CUDA_LAUNCH_BLOCKING": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "n1",
           "HOME": "/root", "NCCL_DEBUG": "", "GLOO_SOCKET_IFNAME": "eth0"}
    assert list(behaviour_settings(env)) == ["CUDA_LAUNCH_BLOCKING", "GLOO_SOCKET_IFNAME", "NCCL_P2P_DISABLE",
                                             "PYTORCH_CUDA_ALLOC_CONF", "TORCH_DISTRIBUTED_DEBUG"]


def test_a_crash_the_retry_cleared_is_led_by_the_setting_it_crashes_with():
    record = segfault_in_ddp(settings={"env_settings": DETAIL, "retried": {
        "stage": "ddp", "probe": "gpu-count", "without": list(DETAIL), "passed": True,
        "culprits": ["TORCH_DISTRIBUTED_DEBUG"], "seconds": 9.1}})
    lead, = critical(diagnose_run(record))
    assert lead.code == "RUN013" and lead.ranks == (0, 1)
    assert lead.title == ("DDP construction (DistributedDataParallel(model)) crashes with TORCH_DISTRIBUTED_DEBUG="
                          "DETAIL and passes without it")
    assert "env -u TORCH_DISTRIBUTED_DEBUG" in lead.fix and "NCCL_ALGO" not in lead.fix
    assert "9.1 s" in lead.why and "SIGSEGV" in lead.why


def test_a_crash_that_comes_back_without_the_settings_clears_them():
    record = segfault_in_ddp(settings={"env_settings": DETAIL, "retried": {
        "stage": "ddp", "without": list(DETAIL), "passed": False, "culprits": [], "seconds": 4.0}})
    crash, = critical(diagnose_run(record))
    assert crash.code == "RUN002" and crash.ranks == (0, 1)
    assert "not the cause" in crash.why and crash.evidence["retried"]["passed"] is False


def test_under_a_launcher_the_settings_are_listed_from_the_ranks_hellos_with_how_to_try_without():
    record = segfault_in_ddp(mode="torchrun")
    for r in record.hellos:
        record.hellos[r]["env_settings"] = {"CUDA_LAUNCH_BLOCKING": "1"} if r == 1 else {}
    crash, = critical(diagnose_run(record))
    assert crash.code == "RUN002" and crash.evidence["settings"] == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert "CUDA_LAUNCH_BLOCKING=1" in crash.why and "env -u CUDA_LAUNCH_BLOCKING" in crash.fix
    assert "every kernel launch waits" in crash.evidence["what_they_change"][0]


def test_a_kill_from_outside_is_no_crash_a_setting_made():
    record = make_record(2, timelines={r: timeline("ddp", "running") for r in range(2)},
                         exits={1: ExitInfo(-9, signal="SIGKILL", t=T0 + 4), 0: ExitInfo(1, t=T0 + 9)})
    record.settings = {"env_settings": DETAIL}
    assert all("settings" not in f.evidence for f in diagnose_run(record))
    assert crash_retry.plan(record, CheckConfig(probes=("gpu-count",))) is None


def test_the_plan_tries_the_probe_the_crash_was_in_and_only_when_it_can():
    timelines = {r: [*timeline("ddp", "running")[:2], {"name": "probe:gpu-count", "status": "running"},
                     {"name": "ddp", "status": "running"}] for r in range(2)}
    record = segfault_in_ddp(settings={"env_settings": DETAIL}, timelines=timelines)
    cfg = CheckConfig(probes=("init-hang", "gpu-count", "ddp-smoke"))
    assert crash_retry.plan(record, cfg) == crash_retry.Plan("ddp", "gpu-count", tuple(DETAIL))
    assert crash_retry.plan(segfault_in_ddp(settings={"env_settings": {}}), cfg) is None  # nothing to drop
    assert crash_retry.plan(segfault_in_ddp(settings={"env_settings": DETAIL}, faults=("crash:rank=1",)), cfg) is None
    assert crash_retry.plan(segfault_in_ddp(settings={"env_settings": DETAIL}, interrupted="SIGINT"), cfg) is None
    bench = CheckConfig(probes=("allreduce",), command="allreduce-bench")
    assert crash_retry.plan(segfault_in_ddp(settings={"env_settings": DETAIL}), bench) is None


def test_the_tries_drop_them_all_then_keep_each_alone_and_name_the_one_it_crashes_with():
    tried: list[tuple[str, ...]] = []

    def launch(cfg: CheckConfig, argv: list[str], without: tuple[str, ...]) -> RunRecord:
        tried.append(without)
        assert cfg.probes == ("gpu-count",) and cfg.timeout_s <= crash_retry.TRY_TIMEOUT_S and not cfg.live
        assert argv[-4:] == ["--probes", "gpu-count", "--timeout", f"{cfg.timeout_s:g}"]
        kept = set(DETAIL) - set(without)
        if "TORCH_DISTRIBUTED_DEBUG" in kept:
            return segfault_in_ddp()
        return make_record(2, done={0, 1}, exits={r: ExitInfo(0, t=T0 + 9) for r in range(2)})

    plan = crash_retry.Plan("ddp", "gpu-count", tuple(DETAIL))
    out = crash_retry.run(plan, CheckConfig(probes=("gpu-count",), timeout_s=60), ["check"], launch)
    assert tried == [tuple(DETAIL), ("NCCL_ALGO",), ("TORCH_DISTRIBUTED_DEBUG",)]
    assert out["passed"] is True and out["culprits"] == ["TORCH_DISTRIBUTED_DEBUG"] and "note" not in out


def test_every_rank_failing_alike_is_listed_with_the_settings_and_a_different_error_is_not():
    def error(message: str, t: float) -> dict[str, Any]:
        return {"stage": "init", "t": t, "type": "RuntimeError", "message": message, "traceback": "",
                "collective": {"op": "init_process_group", "seq": 2}}

    alike = make_record(2, timelines={r: timeline("init", "error") for r in range(2)},
                        errors={r: error("makeDeviceForInterface(): unsupported gloo device", T0 + 3 + r)
                                for r in range(2)}, exits={r: ExitInfo(1, t=T0 + 6) for r in range(2)})
    alike.settings = {"env_settings": {"GLOO_DEVICE_TRANSPORT": "uv"}}
    found, = critical(diagnose_run(alike))
    assert found.code == "RUN008" and found.evidence["settings"] == {"GLOO_DEVICE_TRANSPORT": "uv"}
    assert crash_retry.plan(alike, CheckConfig(probes=("gpu-count",))) == crash_retry.Plan(
        "init", "gpu-count", ("GLOO_DEVICE_TRANSPORT",))
    alike.settings["retried"] = {"stage": "init", "without": ["GLOO_DEVICE_TRANSPORT"], "passed": True,
                                 "culprits": ["GLOO_DEVICE_TRANSPORT"], "seconds": 5.0}
    lead, = critical(diagnose_run(alike))
    assert lead.code == "RUN013" and lead.title == (
        "init_process_group fails with GLOO_DEVICE_TRANSPORT=uv and passes without it")
    alike.errors[1] = error("Connection reset by peer", T0 + 4)  # not alike: no one setting is suspected
    assert crash_retry.plan(alike, CheckConfig(probes=("gpu-count",))) is None
