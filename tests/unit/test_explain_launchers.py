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
