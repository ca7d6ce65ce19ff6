"""`ddpdoctor run` on real ranks: an unedited script (tests/ranks/plain_train.py, nothing of ddpdoctor in it)
named right in every launch style, its own behaviour unchanged, and nothing left behind.

The faults are doctor_loop.py's, made the same ways (a sleep in rank 1's loop before its step, set_epoch never
called, no DistributedSampler, a spin in rank 1's backward), and each is asserted as the explicit Doctor's end of
the run names it (tests/ranks/test_run_end_e2e.py): the same code, rank and cause. Runs are sized as there, from
a floor every host keeps. The frameworks' fits under `ddpdoctor run` are at the end (marked `adapters`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ddpdoctor.attach.settings import DIR_VAR, RUN_VAR

from tests.trace_format import check_rules, spans_of

from .harness import _env, free_port, port_is_free, run_script_ranks, tagged_processes
from .test_launch_styles_e2e import nobody_listens
from .test_run_end_e2e import epochs_for

pytestmark = pytest.mark.ranks
SCRIPT = Path(__file__).with_name("plain_train.py")
FIT = Path(__file__).with_name("adapter_fit.py")
RUN = ("-m", "ddpdoctor", "run")
CLEAN = {RUN_VAR: None, DIR_VAR: None}  # a test under a `ddpdoctor run` of its own must not inherit it


def by_code(report: dict) -> dict[str, dict]:
    return {f["code"]: f for f in report["findings"]}


def start(argv: list[str], tag: str) -> subprocess.Popen:
    return subprocess.Popen(argv, env=_env(tag, {**CLEAN, "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, tag: str, timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not tagged_processes(tag), "processes left behind"
    return proc.returncode, out, err


def one_process(tmp_path: Path, run_args: list[str], script_args: list[str], timeout_s: float = 120,
                launcher: tuple[str, ...] = ()) -> tuple[int, str, str, dict | None]:
    """`python -m ddpdoctor run RUN_ARGS [-- LAUNCHER] plain_train.py SCRIPT_ARGS` as one process (mp.spawn inside,
    or a launcher around); (exit status, stdout, stderr, rank 0's report)."""
    report = tmp_path / "run.json"
    tag = uuid.uuid4().hex
    argv = [sys.executable, *RUN, "--json", str(report), *run_args,
            *(["--", *launcher] if launcher else []), str(SCRIPT), *script_args]
    rc, out, err = finish(start(argv, tag), tag, timeout_s)
    return rc, out, err, json.loads(report.read_text()) if report.exists() else None


def test_an_unedited_script_under_ddpdoctor_run_inside_the_launcher_names_slow_data_and_a_missing_set_epoch(tmp_path):
    """Each rank started as torchrun or a job's env does, `python -m ddpdoctor run train.py`: rank 1 sleeps 20 ms
    before each step, set_epoch is never called. As the explicit Doctor's end names it: STR001 rank 1, data."""
    port = free_port()
    report, timeline = tmp_path / "run.json", tmp_path / "run.trace.json"
    results = run_script_ranks(SCRIPT, ["--case", "slowdata,noepoch", "--epochs", str(epochs_for(20.0))],
                               {0: port, 1: port}, timeout_s=120, extra_env=CLEAN,
                               python_args=(*RUN, "--json", str(report), "--trace", str(timeline),
                                            "--html", str(tmp_path / "run.html")))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    found = by_code(json.loads(report.read_text()))
    assert found["STR001"]["ranks"] == [1] and found["STR001"]["evidence"]["cause"] == "data loading", found
    assert found["DOC003"]["ranks"] == [0, 1] and found["DOC020"]["severity"] == "info"
    summary = json.loads(report.read_text())["summary"]
    assert summary["code"] == "STR001" and summary["final_check"]["missing"] == []
    assert "ddpdoctor end of run: STR001 (rank 1)" in results[0][1]
    # `--trace`: rank 1's data bars are its long ones (its sleep is before each step), rank 0 waits for it.
    doc = json.loads(timeline.read_text())
    check_rules(doc)
    data = {r: sum(e["dur"] for e in spans_of(doc, r, "phase") if e["name"] == "data") for r in (0, 1)}
    assert data[1] > 3 * data[0], data
    page = (tmp_path / "run.html").read_text()  # `--html`: the same run as a page, its verdict first
    assert page.index('id="verdict"') < page.index('data-code="STR001"') < page.index('id="block-timeline"')


def test_srun_tasks_under_ddpdoctor_run_name_an_unsharded_loader_and_count_optimizer_steps(tmp_path):
    """srun's way: SLURM_PROCID and no RANK, the script's tcp:// rendezvous. The loop accumulates gradients over
    two forwards a step: a step is an optimizer step (32 of them, each rank reading all 16 batches an epoch with no
    sampler), not one of the 64 forwards."""
    port = free_port()
    report = tmp_path / "run.json"
    results = run_script_ranks(SCRIPT, ["--case", "nosampler,accum", "--epochs", "2"], {0: port, 1: port},
                               timeout_s=90, extra_env=CLEAN, srun=True, python_args=(*RUN, "--json", str(report)))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    written = json.loads(report.read_text())
    found = by_code(written)
    assert found["DOC001"]["ranks"] == [0, 1] and found["DOC001"]["severity"] == "critical", found
    assert written["summary"]["steps"] == 2 * 16 and [r["steps"] for r in written["summary"]["ranks"]] == [32, 32]


@pytest.mark.slow
def test_an_mp_spawn_script_attaches_in_its_children_and_names_a_compute_straggler_in_backward(tmp_path):
    """`ddpdoctor run train.py --spawn 2`: the script's function pickled to its mp.spawn children, which attach
    through the environment; rank 1 spins 25 ms in its backward pass. Its exit status (sys.exit(3)) is kept.
    Default twin: tests/ranks/test_run_command_e2e.py::test_the_script_sees_itself_as_it_does_without_ddpdoctor"""
    rc, _, err, report = one_process(tmp_path, [], ["--case", "backward", "--epochs", str(epochs_for(25.0)),
                                                    "--spawn", "2", "--port", str(free_port()), "--exit", "3"])
    assert rc == 3, err[-3000:]
    found = by_code(report)
    assert found["STR001"]["ranks"] == [1] and found["STR001"]["evidence"]["cause"] == "compute", found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap, case, expect", [
    ("fsdp", "slowdata", ("STR001", [1], "data loading")),
    ("compile", "nosampler,loss_in_model", ("DOC001", [0, 1], None)),
])
def test_fsdp_and_a_compiled_ddp_model_are_attached(tmp_path, wrap, case, expect):
    """FullyShardedDataParallel's constructor is wrapped as DDP's is; a DDP model that torch.compile wraps is found
    when DDP is built, and its own loss is still read through the compiled forward (no DOC020); compiling takes a
    minute on 2 CPU cores.
    Default twin: tests/ranks/test_run_command_e2e.py::test_the_script_sees_itself_as_it_does_without_ddpdoctor"""
    epochs = str(epochs_for(20.0)) if "slowdata" in case else "2"
    rc, _, err, report = one_process(tmp_path, [], ["--case", f"{wrap},{case}", "--epochs", epochs, "--spawn", "2",
                                                    "--port", str(free_port())], timeout_s=240)
    assert rc == 0, err[-3000:]
    found = by_code(report)
    code, ranks, cause = expect
    assert found[code]["ranks"] == ranks and (cause is None or found[code]["evidence"]["cause"] == cause), found
    if wrap == "compile":
        assert "DOC020" not in found, found


def test_ddpdoctor_run_around_torchrun_attaches_its_workers_and_a_healthy_run_is_quiet(tmp_path):
    """`ddpdoctor run -- torchrun --nproc_per_node=2 train.py`: the workers attach through sitecustomize, the
    agent (a Python process too) does not; a healthy run says so, with its figures, and nothing is loud."""
    port = free_port()
    rc, _, err, report = one_process(tmp_path, [], ["--case", "healthy", "--epochs", "4"],
                                     launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                               "--master_port", str(port)))
    assert rc == 0, err[-3000:]
    loud = [f for f in report["findings"] if f["severity"] in ("warn", "critical")]
    assert not loud and report["summary"]["verdict"].startswith("healthy"), report["summary"]
    assert report["summary"]["steps"] == 4 * 8  # attached at the first forward: every step timed
    assert "nothing was watched" not in err and port_is_free(port)


@pytest.mark.slow
def test_a_script_that_raises_keeps_its_traceback_and_status_and_leaves_nothing(tmp_path):
    """An mp.spawn child raises at step 3: the parent's exit 1 and the traceback from the script's first frame.
    Default twin: tests/unit/test_run_command.py::test_a_script_runs_as_python_runs_it_and_its_status_and_traceback_are_its_own"""
    port = free_port()
    rc, _, err, _ = one_process(tmp_path, [], ["--spawn", "2", "--port", str(port), "--raise"], timeout_s=90)
    assert rc == 1 and "RuntimeError: the script's own error at step 3" in err, err[-3000:]
    lines = err.splitlines()
    first = lines[lines.index("Traceback (most recent call last):") + 1]
    assert "plain_train.py" in first, err[-3000:]  # the traceback starts at the script, not in ddpdoctor or runpy
    assert nobody_listens(port)  # mp.spawn killed rank 0 mid-run: its connections may sit in TIME_WAIT, no listener


def test_the_script_sees_itself_as_it_does_without_ddpdoctor(tmp_path):
    """__name__, sys.argv, sys.path[0], the sibling import, in the parent and the mp.spawn children, and the exit
    status, under `ddpdoctor run`: what `python train.py` gives them (the values python sets, asserted one by one;
    the same script run plainly gave exactly these, compared whole while this test was written). The model returns
    its own loss, and rank 1's inputs turn NaN from its 11th step: the loss is watched, and DOC018 names rank 1."""
    report = tmp_path / "run.json"
    record = tmp_path / "rec"
    args = ["--epochs", "2", "--case", "loss_in_model,nan", "--spawn", "2", "--port", str(free_port()),
            "--record", str(record), "--exit", "3"]
    tag = uuid.uuid4().hex
    rc, out, err = finish(start([sys.executable, *RUN, "--json", str(report), str(SCRIPT), *args], tag), tag, 90)
    assert rc == 3, err[-3000:]
    assert out.count(" trained 16 steps") == 2  # the script's own stdout, through
    seen = {who: json.loads((tmp_path / f"rec.{who}").read_text()) for who in ("parent", "0", "1")}
    for who, name in (("parent", "__main__"), ("0", "__mp_main__"), ("1", "__mp_main__")):
        assert seen[who] == {"name": name, "argv": [str(SCRIPT), *args], "path0": str(SCRIPT.parent),
                             "file": str(SCRIPT), "sibling": True, "main_module": name}, seen[who]
    found = by_code(json.loads(report.read_text()))
    assert found["DOC018"]["ranks"] == [1] and "DOC020" not in found, found
    assert found["DOC018"]["evidence"]["first_nonfinite_step"]["1"] == 11  # its 11th step, counted as the script does


def test_ctrl_c_on_ddpdoctor_run_around_a_launcher_leaves_no_process_and_no_port(tmp_path):
    """SIGINT to the whole foreground group (what a terminal's Ctrl-C sends) in the middle of training."""
    port = free_port()
    tag = uuid.uuid4().hex
    argv = [sys.executable, *RUN, "--", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(port), str(SCRIPT), "--epochs", "400", "--floor-ms", "5"]
    proc = start(argv, tag)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(tagged_processes(tag)) < 4:  # us, the agent, two workers
        time.sleep(0.2)
    time.sleep(3.0)  # training
    os.killpg(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, tag, 60)
    assert rc != 0 and nobody_listens(port), err[-3000:]


@pytest.mark.adapters
def test_ddpdoctor_run_around_accelerate_launch_names_slow_data_on_its_workers(tmp_path):
    """`ddpdoctor run -- accelerate launch --multi_gpu --num_processes 2 train.py`: Accelerate's launcher (torch's
    elastic agent under its own command; `--multi_gpu` is its multi-process mode, and starts CPU ranks too) runs
    the unedited script's workers, which attach through sitecustomize. Named as inside torchrun: STR001 rank 1,
    data loading; nothing left, the port free. No accelerate config of the host's is read (HF_HOME is the test's)."""
    pytest.importorskip("accelerate")
    port = free_port()
    report = tmp_path / "run.json"
    tag = uuid.uuid4().hex
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(port))
    argv = [sys.executable, *RUN, "--json", str(report), "--", *launcher, str(SCRIPT),
            "--case", "slowdata,noepoch", "--epochs", str(epochs_for(20.0))]
    env = _env(tag, {**CLEAN, "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "HF_HOME": str(tmp_path / "hf")})
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)
    rc, out, err = finish(proc, tag, 180)
    assert rc == 0, err[-3000:]
    found = by_code(json.loads(report.read_text()))
    assert found["STR001"]["ranks"] == [1] and found["STR001"]["evidence"]["cause"] == "data loading", found
    assert found["DOC003"]["ranks"] == [0, 1] and port_is_free(port)


@pytest.mark.adapters
@pytest.mark.parametrize("framework, scenario, expect", [
    ("lightning", "slowdata", ("STR001", [1], "data loading")),
    ("hf", "nosampler", ("DOC001", [0, 1], None)),
    ("accelerate", "slowdata", ("STR001", [1], "data loading")),
])
def test_an_unedited_fit_under_ddpdoctor_run_gets_its_framework_adapter(tmp_path, framework, scenario, expect):
    """adapter_fit.py with ADAPTER_FIT_UNEDITED=1: no callback, no Doctor in the fit. Lightning and the Hugging
    Face Trainer get their adapters when they are built; Accelerate's plain loop, the DDP model it prepares."""
    pytest.importorskip({"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}[framework])
    port = free_port()
    report = tmp_path / "run.json"
    results = run_script_ranks(FIT, [framework, "--json", str(tmp_path / "fit"), "--scenarios", scenario],
                               {0: port, 1: port}, timeout_s=240, cwd=tmp_path,
                               extra_env={**CLEAN, "ADAPTER_FIT_UNEDITED": "1"},
                               python_args=(*RUN, "--json", str(report), "--every", "20", "--check-every-s", "0"))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    code, ranks, cause = expect
    loud = [f for f in json.loads(report.read_text())["findings"] if f["severity"] in ("warn", "critical")]
    assert loud and loud[0]["code"] == code and loud[0]["ranks"] == ranks, loud
    assert cause is None or loud[0]["evidence"]["cause"] == cause, loud
    assert not (tmp_path / f"fit.{scenario}.json").exists()  # no Doctor of the fit's own: ddpdoctor run's only
