"""ddpdoctor.runtime.slurm (host lists) and ddpdoctor.runtime.launch_env.detect on plain dict environments."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ddpdoctor.runtime import launch_env
from ddpdoctor.runtime import slurm
from ddpdoctor.core.errors import UsageError
from ddpdoctor.runtime.launch_env import LaunchEnv, detect

FAST = settings(database=None, deadline=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow])


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message, message
    return message


# == slurm.expand_nodelist / first_host / tasks_per_node ==========================

@pytest.mark.parametrize("text, hosts", [
    ("node5", ["node5"]),
    ("  node5  ", ["node5"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),  # zero padding kept across a digit boundary
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),            # and not invented where there was none
    ("gpu[1]", ["gpu1"]),
    ("a[1-2]-ib", ["a1-ib", "a2-ib"]),                   # suffix after the brackets
    ("a,b, c", ["a", "b", "c"]),
    ("gpu[01-02],cpu[1,3-4]", ["gpu01", "gpu02", "cpu1", "cpu3", "cpu4"]),
    ("x[5-5]", ["x5"]),
])
def test_expand_nodelist(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, first", [
    ("gpu[01-03,07],login1", "gpu01"),
    ("node5", "node5"),
    ("login1,gpu[01-02]", "login1"),
    ("n[009-010]", "n009"),
])
def test_first_host(text, first):
    assert slurm.first_host(text) == first


@pytest.mark.parametrize("text", [
    "", "   ", "gpu[01-03", "gpu01-03]", "gpu[]", "gpu[03-01]", "gpu[a-b]", "gpu[01-]", "gpu[-02]",
    "a,,b", "a,", "gpu[[01]]", "rack[1-2]-node[01-02]",
])
def test_bad_nodelist_raises_usage_error(text):
    with pytest.raises(UsageError) as info:
        slurm.expand_nodelist(text)
    message = _one_line(info.value)
    assert "MASTER_ADDR" in message  # says how to get past it
    with pytest.raises(UsageError):
        slurm.first_host(text)


@pytest.mark.parametrize("text, count", [("4", 4), ("4(x2)", 4), ("4(x2),3", 4), (" 8", 8), ("1(x16)", 1)])
def test_tasks_per_node(text, count):
    assert slurm.tasks_per_node(text) == count


@pytest.mark.parametrize("text", ["", "x4", "(x2)", "-1"])
def test_bad_tasks_per_node_raises_usage_error(text):
    with pytest.raises(UsageError) as info:
        slurm.tasks_per_node(text)
    assert "SLURM_TASKS_PER_NODE" in _one_line(info.value)


_NODELISTISH = st.text(alphabet=st.sampled_from(list("gpu0123[]-,( )x")), max_size=24)


def _expands_or_usage_error(text: str) -> None:
    try:
        hosts = slurm.expand_nodelist(text)
    except UsageError as exc:
        _one_line(exc)
    else:
        assert hosts and all(isinstance(h, str) for h in hosts)
        assert all("[" not in h and "]" not in h and "," not in h for h in hosts)
        assert slurm.first_host(text) == hosts[0]


def _no_huge_range(text: str) -> bool:
    # "n[0-99999999]" really is 10^8 hosts: fine for Slurm, too slow for a unit test.
    return not re.search(r"[0-9]{5,}", text)


@FAST
@given(_NODELISTISH)
def test_nodelist_like_text_expands_or_raises_usage_error(text):
    assume(_no_huge_range(text))
    _expands_or_usage_error(text)


@FAST
@given(st.text(max_size=40))
@example("n[\u00b9-\u00b2]")  # superscript one and two: isdigit() but not int()
def test_any_text_expands_or_raises_usage_error(text):
    assume(_no_huge_range(text))
    _expands_or_usage_error(text)


@pytest.mark.parametrize("text", ["gpu[,01]", "gpu[01,]", "gpu[ab]"])
def test_malformed_bracket_parts_are_rejected(text):
    with pytest.raises(UsageError):
        slurm.expand_nodelist(text)


@FAST
@given(st.text(max_size=30))
def test_tasks_per_node_any_text(text):
    try:
        count = slurm.tasks_per_node(text)
    except UsageError as exc:
        _one_line(exc)
    else:
        assert count >= 0
        assert text.lstrip()[:1].isdigit()  # only a leading number is read


# == launch_env.detect =============================================================

TORCHRUN = {
    "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job-42", "TORCHELASTIC_USE_AGENT_STORE": "True",
}

SLURM = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "4(x2)",
}


@pytest.mark.parametrize("environ", [
    {},
    {"PATH": "/usr/bin", "HOME": "/root"},
    {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "0"},  # no RANK/WORLD_SIZE
    {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[01-02]"},
])
def test_no_rank_variables_means_standalone(environ):
    assert detect(environ) is None


def test_torchrun_with_agent_store():
    env = detect(TORCHRUN)
    assert isinstance(env, LaunchEnv)
    assert (env.mode, env.store_host) == ("torchrun", "agent")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 4, 0, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    assert env.run_id == "job-42"
    assert env.is_reporter
    assert not env.hosts_store  # the agent serves the store, not rank 0


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_torchrun_only_rank_zero_reports(rank):
    env = detect({**TORCHRUN, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)})
    assert env.rank == rank and env.local_rank == rank % 2
    assert not env.is_reporter
    assert not env.hosts_store


def test_torchrun_without_agent_store_has_rank0_serve_it():
    environ = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    env0 = detect(environ)
    env1 = detect({**environ, "RANK": "1", "LOCAL_RANK": "1"})
    assert (env0.mode, env0.store_host) == ("torchrun", "rank0")
    assert env0.hosts_store and env0.is_reporter
    assert not env1.hosts_store and not env1.is_reporter


def test_env_mode_without_agent_store():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "12345"}
    env0 = detect(base)
    env1 = detect({**base, "RANK": "1"})
    assert (env0.mode, env0.store_host) == ("env", "rank0")
    assert env0.hosts_store and env0.is_reporter
    assert (env1.mode, env1.store_host) == ("env", "rank0")
    assert not env1.hosts_store and not env1.is_reporter
    # local values default to one node holding every rank
    assert (env1.local_rank, env1.local_world_size) == (1, 2)
    assert env0.run_id == "node1:12345"


def test_our_launcher_is_recognised_and_reports_itself():
    environ = {**TORCHRUN, "RANK": "0", launch_env.LAUNCHER_PID_VAR: "4242", launch_env.RUN_ID_VAR: "abc123"}
    env = detect(environ)
    assert (env.mode, env.store_host, env.run_id) == ("ddpdoctor", "launcher", "abc123")
    assert not env.is_reporter and not env.hosts_store
    assert launch_env.launcher_pid(environ) == 4242
    assert launch_env.launcher_pid({}) is None
    assert launch_env.launcher_pid({launch_env.LAUNCHER_PID_VAR: "x1"}) is None


def test_slurm_step():
    env = detect(SLURM)
    assert env.mode == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu07"  # the first host of the job
    assert env.master_port == 20000 + 123456 % 20000 == 23456
    assert env.store_host == "rank0"
    assert env.run_id == "slurm-123456.0"
    assert not env.is_reporter and not env.hosts_store


def test_slurm_rank_zero_serves_the_store_and_reports():
    env = detect({**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert env.hosts_store and env.is_reporter


def test_slurm_port_differs_between_jobs_and_is_valid():
    ports = {detect({**SLURM, "SLURM_JOB_ID": str(job)}).master_port for job in (1, 2, 19999, 20000, 987654321)}
    assert len(ports) == 5
    assert all(20000 <= p < 40000 for p in ports)


def test_slurm_explicit_master_addr_and_port_win():
    env = detect({**SLURM, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"})
    assert (env.master_addr, env.master_port) == ("10.1.1.1", 29400)


def test_slurm_step_nodelist_is_preferred_to_the_job_one():
    env = detect({**SLURM, "SLURM_STEP_NODELIST": "cpu[3-4]"})
    assert env.master_addr == "cpu3"


def test_slurm_tasks_per_node_never_exceeds_world():
    env = detect({**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert env.local_world_size == 2


def test_sbatch_script_without_srun_is_standalone():
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect(environ) is None


def test_rank_variables_win_over_slurm():
    env = detect({**SLURM, **TORCHRUN})
    assert env.mode == "torchrun" and env.world_size == 4


@pytest.mark.parametrize("override, variable", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "two"}, "RANK"),
    ({"RANK": "4"}, "RANK"),          # RANK >= WORLD_SIZE
    ({"RANK": "-1"}, "RANK"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK"),  # >= LOCAL_WORLD_SIZE
    ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT"),
    ({"MASTER_PORT": None}, "MASTER_PORT"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    ({"MASTER_ADDR": "   "}, "MASTER_ADDR"),
    ({"RANK": None}, "RANK"),
])
def test_bad_rank_variable_is_named(override, variable):
    environ = dict(TORCHRUN)
    for key, value in override.items():
        if value is None:
            environ.pop(key)
        else:
            environ[key] = value
    with pytest.raises(UsageError) as info:
        detect(environ)
    message = _one_line(info.value)
    assert message.startswith(variable), message


@pytest.mark.parametrize("override, variable", [
    ({"SLURM_NTASKS": "many"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID"),
    ({"SLURM_LOCALID": "-3"}, "SLURM_LOCALID"),
    ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"SLURM_NTASKS_PER_NODE": "(x2)"}, "SLURM_TASKS_PER_NODE"),
])
def test_bad_slurm_variable_is_named(override, variable):
    with pytest.raises(UsageError) as info:
        detect({**SLURM, **override})
    assert variable in _one_line(info.value)


def test_slurm_without_any_address_says_what_to_set():
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(UsageError) as info:
        detect(environ)
    assert "MASTER_ADDR" in _one_line(info.value)


def test_slurm_unreadable_nodelist_says_what_to_set():
    with pytest.raises(UsageError) as info:
        detect({**SLURM, "SLURM_JOB_NODELIST": "gpu[01-"})
    assert "MASTER_ADDR" in _one_line(info.value)


_NUMERIC_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE")


@FAST
@given(st.dictionaries(st.sampled_from(_NUMERIC_VARS + ("MASTER_ADDR", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")),
                       st.one_of(st.integers(-3, 70000).map(str),
                                 st.text(alphabet=st.characters(codec="ascii"), max_size=8))))
def test_any_environment_detects_or_raises_usage_error(environ):
    environ.setdefault("SLURM_JOB_NODELIST", "gpu[01-02]")
    try:
        env = detect(environ)
    except UsageError as exc:
        _one_line(exc)
    else:
        if env is not None:
            assert 0 <= env.rank < env.world_size
            assert 1 <= env.master_port <= 65535
            assert env.master_addr.strip()
            assert env.mode in ("torchrun", "env", "slurm")
