"""The callback and watch() for the ways tutorials start jobs: DataParallel, mp.spawn's
arguments instead of torchrun's variables, learning-rate scaling, a port another job holds.

The judging is tested on hand-set numbers (a GPU's memory and utilisation are recorded
values here: no GPU on the test machine); DataParallel on the CPU and the port holders are
real objects and real processes.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

import ddpdoctor
from ddpdoctor.core.findings import Severity
from ddpdoctor.callback.watch import Target, port_conflict, target_from_call, target_from_env
from ddpdoctor.callback.online_checks import DataParallelGpu, batch_scaling_finding, data_parallel_finding, setup_findings
from ddpdoctor.measure.port_holders import foreign_listeners, is_local_address

GiB = 2**30


# -- DataParallel -----------------------------------------------------------------------------
def test_a_data_parallel_model_on_the_cpu_is_flagged_after_its_first_steps(caplog):
    model = nn.DataParallel(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    doctor = ddpdoctor.Doctor(model, optimizer, every=5)
    with caplog.at_level(logging.WARNING, logger="ddpdoctor"):
        for step in range(7):
            with doctor.step((torch.randn(4, 8),)):
                model(torch.randn(4, 8)).sum().backward()
            if step == 3:
                assert doctor.report() == []  # measured over the first 5 steps, then judged
        doctor.close()
    [finding] = doctor.report()
    assert finding.code == "DOC009" and finding.severity == Severity.INFO  # no GPU: nothing lost yet
    assert finding.evidence["device_ids"] == [] and finding.evidence["steps_measured"] == 5
    assert "no GPU" in finding.title and "DistributedDataParallel" in finding.fix
    assert "DOC009" in caplog.text


def test_a_data_parallel_job_shorter_than_the_window_is_judged_at_close():
    model = nn.DataParallel(nn.Linear(8, 2))
    doctor = ddpdoctor.Doctor(model, every=50)
    with doctor.step(torch.randn(4, 8)):
        model(torch.randn(4, 8)).sum().backward()
    doctor.close()
    assert [f.code for f in doctor.report()] == ["DOC009"]
    assert doctor.report()[0].evidence["steps_measured"] == 1


def test_gpu0_carrying_more_memory_and_the_others_idling_is_what_the_title_says():
    # As DataParallel leaves 4 GPUs: the replicas' memory on 1-3, the gathered outputs on 0.
    gpus = [DataParallelGpu(0, int(9.5 * GiB), [97, 98, 99]), DataParallelGpu(1, 5 * GiB, [55, 60, 58]),
            DataParallelGpu(2, 5 * GiB, [50, 61, 57]), DataParallelGpu(3, int(5.2 * GiB), [52, 59, 60])]
    finding = data_parallel_finding(gpus, steps=20, step_ms=[310.0, 300.0, 305.0], rank=0, host="gpu-node-3")
    assert finding.title == ("The model is wrapped in torch.nn.DataParallel across 4 GPUs: GPU 0 peaked at 9.50 GiB vs "
                             "5.00 GiB on the others (median), utilisation 98% vs 58%")
    assert finding.evidence["gpu0_memory_ratio"] == 1.9
    assert finding.evidence["median_util_pct_by_gpu"] == {0: 98, 1: 58, 2: 57, 3: 59}
    assert finding.evidence["median_step_ms"] == 305.0 and finding.nodes == ("gpu-node-3",)


def test_without_nvml_the_memory_alone_is_shown():
    gpus = [DataParallelGpu(0, 3 * GiB, []), DataParallelGpu(1, 2 * GiB, [])]
    finding = data_parallel_finding(gpus, steps=20, step_ms=[10.0], rank=0, host="h")
    assert "utilisation" not in finding.title and "median_util_pct_by_gpu" not in finding.evidence
    assert "3.00 GiB vs 2.00 GiB" in finding.title


def test_one_process_with_several_gpus_is_doc005_unless_it_is_data_parallel():
    plain = setup_findings(True, 1, 4, 0, "h", None)
    assert [f.code for f in plain] == ["DOC005"]
    assert setup_findings(True, 1, 4, 0, "h", None, data_parallel=True) == []


# -- learning rate and batch ----------------------------------------------------------------------
def test_the_effective_batch_and_both_rules_by_hand():
    finding = batch_scaling_finding({0: 32.0, 1: 32.0, 2: 32.0, 3: 32.0}, [0.1], nodes=["h"])
    assert finding is not None and finding.severity == Severity.INFO
    assert finding.evidence["effective_batch"] == 128.0
    assert finding.evidence["linear_rule"] == [0.4] and finding.evidence["sqrt_rule"] == [0.2]
    assert finding.title.startswith("Effective batch 128 (4 ranks x 32) at learning rate 0.1:")
    assert "linear rule gives 0.4 and the square-root rule 0.2" in finding.title


def test_uneven_batches_and_several_groups_are_shown_as_they_are():
    finding = batch_scaling_finding({0: 32.0, 1: 16.0}, [3e-4, 1e-3], nodes=["h"])
    assert finding is not None and finding.evidence["effective_batch"] == 48.0
    assert "2 ranks, 16/32 per rank" in finding.title and "learning rates 0.0003, 0.001" in finding.title
    assert finding.evidence["sqrt_rule"] == [pytest.approx(3e-4 * 2**0.5), pytest.approx(1e-3 * 2**0.5)]


def test_the_effective_batch_names_every_node_once():
    finding = batch_scaling_finding({0: 8.0, 1: 8.0, 2: 8.0, 3: 8.0}, [0.1], nodes=["a", "a", "b", "b"])
    assert finding is not None and finding.nodes == ("a", "b")


def test_no_scaling_finding_for_one_rank_or_without_a_learning_rate():
    assert batch_scaling_finding({0: 32.0}, [0.1], nodes=["h"]) is None
    assert batch_scaling_finding({0: 32.0, 1: 32.0}, [], nodes=["h"]) is None
    assert batch_scaling_finding({0: 32.0, 1: 0.0}, [0.1], nodes=["h"]) is None


def test_the_base_rate_of_a_warm_up_schedule_is_read_not_its_first_step():
    from ddpdoctor.callback.user_objects import learning_rates as _learning_rates

    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-4}], lr=3e-4)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 1000))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-7)  # the warm-up's start
    assert _learning_rates(optimizer) == [3e-4, 1e-4]


# -- watch(): where the rank and the rendezvous come from -------------------------------------------
def test_the_target_from_torchruns_variables_ignores_garbage():
    assert target_from_env({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}) == \
        Target(3, 8, "n1", 29500)
    assert target_from_env({"RANK": "-1", "WORLD_SIZE": "abc", "MASTER_PORT": "99999"}) == \
        Target(None, None, None, None)


def test_the_target_from_init_process_groups_arguments():
    assert target_from_call({"rank": 1, "world_size": 4, "init_method": "tcp://10.0.0.5:23456"}) == \
        Target(1, 4, "10.0.0.5", 23456)
    assert target_from_call({"rank": -1, "world_size": -1, "init_method": "env://"}) == Target(None, None, None, None)
    assert target_from_call({"init_method": "tcp://[::1]:bad"}) == Target(None, None, None, None)


def test_explicit_arguments_win_over_the_environment():
    merged = Target(0, 2, None, None).merge(Target(5, 9, "127.0.0.1", 12355))
    assert merged == Target(0, 2, "127.0.0.1", 12355)


@pytest.mark.parametrize("bad", [{"rank": -1}, {"world_size": 0}, {"rank": "0"}, {"world_size": True}])
def test_watch_refuses_a_rank_or_world_size_that_is_not_a_count(bad):
    with pytest.raises(ValueError):
        ddpdoctor.watch(timeout_s=1, **bad)


# -- a port another job holds -------------------------------------------------------------------
@pytest.fixture
def other_listener():
    """Another process listening on a port of this host, as a second job's store would."""
    proc = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
                             "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen()\n"
                             "print(s.getsockname()[1], flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def test_the_process_holding_the_port_is_named(other_listener):
    proc, port = other_listener
    [holder] = foreign_listeners(port)
    assert holder.pid == proc.pid and "time.sleep(60)" in holder.cmdline
    finding = port_conflict(Target(0, 2, "127.0.0.1", port))
    assert finding is not None and finding.code == "WATCH002" and finding.severity == Severity.CRITICAL
    assert f"MASTER_PORT {port}" in finding.title and f"pid {proc.pid}" in finding.title
    assert finding.evidence["held_by"][0]["pid"] == proc.pid


def test_only_the_rank_hosting_the_store_judges_and_only_on_this_host(other_listener):
    _, port = other_listener
    assert port_conflict(Target(1, 2, "127.0.0.1", port)) is None  # rank 1 normally sees its own job's store
    assert port_conflict(Target(0, 2, "192.0.2.1", port)) is None  # TEST-NET: another host's port


def test_this_process_listening_is_not_a_conflict():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert foreign_listeners(port) == []
        assert port_conflict(Target(0, 2, "localhost", port)) is None


def test_local_addresses_without_dns():
    assert is_local_address("127.0.0.1") and is_local_address("localhost") and is_local_address("::1")
    assert is_local_address(socket.gethostname()) and is_local_address("0.0.0.0")
    assert not is_local_address("192.0.2.1") and not is_local_address("node-that-needs-dns.example")


# -- watch() in a process that is not a rank ---------------------------------------------------------
NOT_A_RANK = """
import multiprocessing, sys, time
import ddpdoctor

def main():
    ddpdoctor.watch(timeout_s=0.5, json_path=sys.argv[1], on_hang="exit", **eval(sys.argv[2]))
    time.sleep(2.0)  # well past the deadline, never calling init_process_group
    print("still running", flush=True)

if __name__ == "__main__":
    if sys.argv[3] == "child":  # as mp.spawn starts its workers
        worker = multiprocessing.get_context("spawn").Process(target=main)
        worker.start()
        worker.join(30)
        sys.exit(worker.exitcode)
    main()
"""


@pytest.mark.parametrize("env, kwargs, where, reported", [
    ({}, {}, "main", False),  # a plain script
    ({"WORLD_SIZE": "2"}, {}, "main", False),  # mp.spawn's parent, its script exporting WORLD_SIZE
    ({"RANK": "0", "WORLD_SIZE": "1"}, {}, "main", False),  # torchrun --nproc_per_node=1, no process group
    ({}, {}, "child", True),  # mp.spawn's worker stuck before init_process_group, no rank= given
    ({}, {"world_size": 2}, "main", True),  # told it is one of 2
], ids=["plain", "spawn-parent", "world-of-one", "spawn-worker", "world-given"])
def test_watch_never_ends_a_process_it_cannot_name_as_a_rank(tmp_path, env, kwargs, where, reported):
    # Only where other processes wait is the missing process group reported (by pid while the
    # rank is unknown), and only a process known to be a rank is ever ended (exit 124).
    import json
    import os

    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    script = tmp_path / "job.py"
    script.write_text(NOT_A_RANK)
    report = tmp_path / "watch.json"
    proc = subprocess.run([sys.executable, str(script), str(report), repr(kwargs), where], env=base | env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "still running" in proc.stdout, proc.stderr
    written = list(tmp_path.glob("watch.json.rank*"))
    if not reported:
        assert written == [] and "ddpdoctor" not in proc.stderr
    else:
        [path] = written
        [finding] = json.loads(path.read_text())["findings"]
        assert finding["code"] == "WATCH001" and "has not called init_process_group" in finding["title"]
        assert path.name.startswith("watch.json.rankpid") and "(pid " in finding["title"]


# -- mp.spawn under NCCL: the callback's own gather ---------------------------------------------
def test_under_nccl_the_gather_runs_on_the_models_gpu_not_the_current_device(monkeypatch):
    """The tutorial's ranks move the model with .to(rank) and never call set_device: gathering on
    the current device would put every rank on cuda:0 (NCCL: "Duplicate GPU detected")."""
    from ddpdoctor.callback.doctor import gather_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert gather_device(True, torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert gather_device(True, torch.device("cuda")) == torch.device("cuda", 0)  # no index: current
    assert gather_device(True, torch.device("cpu")) == torch.device("cuda", 0)
    assert gather_device(False, torch.device("cuda", 3)) == torch.device("cpu")  # gloo takes CPU tensors
