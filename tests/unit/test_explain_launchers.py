"""Each launcher's and collector's line, as users pasted it (tests/fixtures/explain/public/),
read for its rank, host and cause."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.explain.collectors import LineStyle, pdsh_hosts
from ddpdoctor.explain.command import explain
from ddpdoctor.explain.launchers import exit_signal
from ddpdoctor.explain.prefixes import split_prefixes
from ddpdoctor.explain.signatures import match_line


def _explain(tmp_path: Path, text: str) -> list[tuple[str, tuple[int, ...]]]:
    log = tmp_path / "job.log"
    log.write_text(text)
    return [(f.code, f.ranks) for f in explain([str(log)]).explanation.findings]


def test_containerd_prefix_then_rank_prefix() -> None:
    origin, message = split_prefixes("2024-05-01T10:00:00.123456789Z stderr F [rank3]: RuntimeError: boom")
    assert (origin.rank, message) == (3, "RuntimeError: boom")


def test_kubectl_pod_prefix_names_the_host() -> None:
    origin, message = split_prefixes("[pod/pytorchjob-worker-1/pytorch] [rank5]: ValueError: x")
    assert (origin.rank, origin.host, message) == (5, "pytorchjob-worker-1", "ValueError: x")


def test_compose_style_pod_name_and_log_levels_are_told_apart() -> None:
    assert split_prefixes("pytorchjob-worker-1 | [rank2]: KeyError: 'a'")[0].host == "pytorchjob-worker-1"
    assert split_prefixes("INFO | KeyError: 'a'")[1] == "INFO | KeyError: 'a'"


def test_openmpi_tag_output_and_lightning_rank_prefixes() -> None:
    assert split_prefixes("[1,3]<stderr>:RuntimeError: x")[0].rank == 3
    assert split_prefixes("[rank: 2] Received SIGTERM: 15")[0].rank == 2


def test_pdsh_hosts_need_several_lines_and_a_host_like_name() -> None:
    text = "worker-1: a\nworker-1: b\nworker-1: c\nRuntimeError: x\nRuntimeError: y\nRuntimeError: z\n"
    assert pdsh_hosts(text) == frozenset({"worker-1"})
    origin, message = split_prefixes("worker-1: RuntimeError: x", LineStyle(pdsh_hosts=pdsh_hosts(text)))
    assert (origin.host, message) == ("worker-1", "RuntimeError: x")


def test_exit_codes_and_words_name_the_signal() -> None:
    assert exit_signal({"exitcode": "-9"}, "elastic_failed") == "SIGKILL"
    assert exit_signal({"code": "139", "what": "Exited with exit code 139"}, "srun_task") == "SIGSEGV"
    assert exit_signal({"what": "Aborted"}, "srun_task") == "SIGABRT"
    assert exit_signal({"exitcode": "1"}, "deepspeed_exit") is None


def test_torchrun_one_line_failure_without_the_block(tmp_path: Path) -> None:
    line = ("E0114 09:51:42.118000 140137 torch/distributed/elastic/multiprocessing/api.py:869] failed "
            "(exitcode: -9) local_rank: 2 (pid: 1203) of binary: /usr/bin/python3\n")
    assert _explain(tmp_path, line) == [("LOG012", (2,))]


def test_deepspeed_launcher_command_line_is_not_the_failed_rank(tmp_path: Path) -> None:
    text = ("[2023-04-10 10:00:00,000] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 100\n"
            "[2023-04-10 10:00:00,000] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 101\n"
            "[2023-04-10 10:00:00,001] [ERROR] [launch.py:434:sigkill_handler] ['/usr/bin/python', '-u', "
            "'train.py', '--local_rank=1'] exits with return code = -11\n")
    assert _explain(tmp_path, text) == [("LOG013", ())]


def test_launcher_stopped_by_a_signal(tmp_path: Path) -> None:
    text = ("W0301 10:00:00.000000 1 torch/distributed/elastic/agent/server/api.py:704] Received 1 death signal, "
            "shutting down workers\n")
    assert _explain(tmp_path, text) == [("LOG015", ())]
    # By the name users search for, the log's number beside it (issue 37: "received 1" said nothing).
    log = tmp_path / "job.log"
    [found] = explain([str(log)]).explanation.findings
    assert found.title == "The launcher received SIGHUP (1) and stopped its workers"
    log.write_text("Main process received SIGTERM, exiting\n")
    assert explain([str(log)]).explanation.findings[0].title == "The launcher received SIGTERM (15) and stopped its workers"


def test_mpirun_names_the_killed_rank(tmp_path: Path) -> None:
    text = "mpirun noticed that process rank 1 with PID 4242 on node gpu3 exited on signal 9 (Killed).\n"
    assert _explain(tmp_path, text) == [("LOG012", (1,))]


def test_hydra_bad_termination_block() -> None:
    assert match_line("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES") is not None


def test_srun_task_range_is_every_task(tmp_path: Path) -> None:
    text = "srun: error: nid01: tasks 2-3: Segmentation fault\n"
    assert _explain(tmp_path, text) == [("LOG013", (2, 3))]


def test_known_message_in_a_generic_exception_wins_whatever_the_order(tmp_path: Path) -> None:
    text = ("[rank0]: AssertionError: boom\n"
            "[rank0]: RuntimeError: The NVIDIA driver on your system is too old (found version 10010).\n")
    assert _explain(tmp_path, text)[0][0] == "GPU008"


def _findings(tmp_path: Path, text: str, world_size: "int | None" = None) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    log = tmp_path / "job.log"
    log.write_text(text)
    return [(f.code, f.ranks, f.nodes) for f in explain([str(log)], world_size=world_size).explanation.findings]


_TIMEOUT = ("[E ProcessGroupNCCL.cpp:475] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=880, "
            "OpType=BROADCAST, NumelIn=131137536, NumelOut=131137536, Timeout(ms)=1800000) ran for 1800648 milliseconds "
            "before timing out.\n")


def test_a_partial_paste_of_timeouts_blames_no_absent_rank(tmp_path: Path) -> None:
    """Ranks 2, 4 and 6 timed out (pytorch#118369); ranks 0, 1, 3, 5 printed nothing in the paste."""
    text = "".join(_TIMEOUT.format(r=r) for r in (2, 4, 6))
    (code, ranks, _), = _findings(tmp_path, text)
    assert (code, ranks) == ("RUN008", ())
    # The same lines with the world size given: the user says the log is the whole world.
    assert _findings(tmp_path, text, world_size=7)[0][:2] == ("RUN004", (0, 1, 3, 5))


def test_sigabrt_after_a_watchdog_timeout_is_the_watchdogs_abort(tmp_path: Path) -> None:
    """NVIDIA/nccl#1438: rank 0 timed out, local_rank 1 died of -6: no rank is blamed for the abort."""
    text = (_TIMEOUT.format(r=0) +
            "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 886321 closing signal SIGTERM\n"
            "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 1 (pid: 886322) "
            "of binary: /usr/bin/python\n")
    assert [(c, r) for c, r, _ in _findings(tmp_path, text)] == [("RUN008", ())]


def test_redacted_host_names_name_no_node(tmp_path: Path) -> None:
    text = "slurmstepd: error: *** JOB 123 ON ... CANCELLED AT 2024-01-01T00:00:00 DUE TO TIME LIMIT ***\n"
    assert _findings(tmp_path, text) == [("LOG008", (), ())]
    text = "slurmstepd: error: *** JOB 123 ON SERVER_NAME CANCELLED AT 2024-01-01T00:00:00 DUE TO JOB REQUEUE ***\n"
    assert _findings(tmp_path, text) == [("LOG008", (), ())]


def test_a_cancelled_job_names_every_node_srun_reports(tmp_path: Path) -> None:
    text = ("slurmstepd: error: *** STEP 32233190.0 ON nid01934 CANCELLED AT 2020-07-03T02:59:56 DUE TO TIME LIMIT ***\n"
            "srun: error: nid01935: tasks 8-15: Terminated\n")
    assert _findings(tmp_path, text) == [("LOG008", (), ("nid01934", "nid01935"))]


def test_an_infiniband_error_seen_from_one_end_names_no_node(tmp_path: Path) -> None:
    text = ("PHLRR4036:24141:24296 [2] ib_plugin.c:978 NCCL WARN NET/IB : Got completion from peer "
            "10.226.98.98<48598> with error 12, opcode 0, len 0, vendor err 129\n")
    assert _findings(tmp_path, text) == [("LOG007", (), ())]


def test_store_failures_name_the_store_not_the_reporting_rank(tmp_path: Path) -> None:
    nccl_id = ("gpu004: RuntimeError: [15] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via "
               "c10d key-value store by key '0', but store->get('0') got error: Connection reset by peer. This may "
               "indicate a possible application crash on rank 0 or a network set up issue.\n")
    assert _findings(tmp_path, nccl_id * 3) == [("LOG006", (), ())]
    assert _findings(tmp_path, "[rank0]: ValueError: host not found: Name or service not known\n") == \
        [("LOG006", (), ())]
    at_init = ('  File "/opt/conda/lib/python3.6/site-packages/torch/distributed/distributed_c10d.py", line 360, in '
               'init_process_group\n    timeout=timeout)\nRuntimeError: Connection reset by peer\n')
    assert _findings(tmp_path, at_init)[0][:2] == ("LOG006", ())


def test_horovods_shutdown_is_a_wait_and_mpiruns_first_failure_the_cause(tmp_path: Path) -> None:
    text = ("[1,1]<stderr>:RuntimeError: Horovod has been shut down. This was caused by an exception on one of the "
            "ranks or an attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
            "execution.\n"
            "mpirun detected that one or more processes exited with non-zero status, thus causing\n"
            "the job to be terminated. The first process to do so was:\n\n"
            "  Process name: [[50371,1],0]\n  Exit code:    1\n")
    assert [(c, r) for c, r, _ in _findings(tmp_path, text)] == [("RUN002", (0,))]


def test_an_unsigned_error_belongs_to_the_tasks_srun_says_exited(tmp_path: Path) -> None:
    text = ("RuntimeError: NCCL error in: /pytorch/torch/lib/c10d/../c10d/NCCLUtils.hpp:82, invalid argument, "
            "NCCL version 2.4.8\n"
            "srun: error: node-0: tasks 2-7: Exited with exit code 1\n"
            "srun: error: node-1: task 14: Exited with exit code 1\n")
    (code, ranks, _), = _findings(tmp_path, text)
    assert (code, ranks) == ("RUN003", (2, 3, 4, 5, 6, 7, 14))


def test_nccls_shm_error_is_the_nodes_and_wins_over_its_carrier(tmp_path: Path) -> None:
    text = ("[rank2]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2028, unhandled system "
            "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
            "[rank2]: Error while creating shared memory segment /dev/shm/nccl-c8G2vd (size 5767520)\n")
    assert _findings(tmp_path, text) == [("LOG007", (), ())]
    pod = ("job-pod-lcbz2t:97:183 [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment "
           "nccl-shm-recv-c43b (size 9637888)\n")
    assert _findings(tmp_path, pod) == [("LOG007", (), ("job-pod-lcbz2t",))]


def test_every_rank_aborted_alike_is_no_ranks_fault(tmp_path: Path) -> None:
    block = ("[{r}]:\n  time      : 2023-06-14_22:36:10\n  host      : neptun\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : -6 (pid: 238592{r})\n  error_file: <N/A>\n  traceback : Signal 6 (SIGABRT) received by "
             "PID 238592{r}\n")
    text = "Failures:\n" + "".join(block.format(r=r) for r in (1, 2)) + "Root Cause (first observed failure):\n" + \
        block.format(r=0)
    assert _findings(tmp_path, text) == [("LOG014", (), ())]


def test_the_old_launcher_names_the_failed_worker_only_with_process_args(tmp_path: Path) -> None:
    tail = ("\nsubprocess.CalledProcessError: Command '['/usr/bin/python', '-u', 'train.py', '--local_rank=1']' "
            "returned non-zero exit status 1.\n")
    frame = '  File "/env/lib/python3.7/site-packages/torch/distributed/launch.py", line 231, in main\n'
    assert _findings(tmp_path, frame + "    cmd=process.args)" + tail)[0][:2] == ("RUN002", (1,))
    assert _findings(tmp_path, frame + "    cmd=cmd)" + tail)[0][:2] == ("RUN002", ())
