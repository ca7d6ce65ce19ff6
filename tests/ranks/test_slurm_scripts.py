"""The job scripts in docs/slurm: valid bash, and their pre-flight line runs as srun would run it.

srun starts one process per task with SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, the node list
and the job id set; nothing else is faked here. Without Slurm on this machine the line's command
is started that way by hand, on one node ("localhost"), two tasks.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .harness import TAG_VAR, free_port, tagged_processes

pytestmark = pytest.mark.ranks

SLURM_DOCS = Path(__file__).resolve().parents[2] / "docs" / "slurm"
SCRIPTS = sorted(SLURM_DOCS.glob("*.sbatch")) + sorted(SLURM_DOCS.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_is_valid_bash_with_a_marked_preflight_line(script):
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert preflight_line(script)


def preflight_line(script: Path) -> str:
    """The command after the `# ddpdoctor-preflight:` marker, continuation lines joined."""
    lines = script.read_text().splitlines()
    start = lines.index("# ddpdoctor-preflight:") + 1
    text = ""
    for line in lines[start:]:
        text += line.rstrip("\\").rstrip() + " "
        if not line.endswith("\\"):
            break
    return text.strip()


def test_the_multinode_preflight_runs_as_srun_runs_it(tmp_path):
    job_id = str(40000 + free_port() % 20000)  # ddpdoctor derives its port from the job id
    report = tmp_path / f"preflight-{job_id}-0.json"
    words = shlex.split(preflight_line(SLURM_DOCS / "preflight-multinode.sbatch").replace("$REPORT", str(report)))
    assert words[0] == "srun"
    command = [w for w in words[1:] if not w.startswith("--kill")]
    assert command[:2] == ["ddpdoctor", "check"]
    tag = f"sbatch-{job_id}"
    procs = []
    for task in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(SLURM_PROCID=str(task), SLURM_NTASKS="2", SLURM_LOCALID=str(task), SLURM_NODEID="0",
                   SLURM_STEP_ID="0", SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost",
                   SLURM_STEP_NODELIST="localhost", SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="2",
                   SLURM_NNODES="1", OMP_NUM_THREADS="1", **{TAG_VAR: tag})
        procs.append(subprocess.Popen([sys.executable, "-m", *command[:1], *command[1:]], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    report = json.loads(report.read_text())
    assert report["mode"] == "slurm" and report["verdict"] == "ok" and report["world_size"] == 2
    assert [r["host"] for r in report["ranks"]] == [report["nodes"][0]] * 2
    assert "ddpdoctor check" in outs[0][0] and "ddpdoctor check" not in outs[1][0]  # rank 0 reports
    assert not tagged_processes(tag)


def run_batch_script(tmp_path: Path, script: str, **extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The whole batch script as Slurm's batch step runs it: on the allocated node, in the submit
    directory, with the job's SLURM_* variables; train.py is a stand-in that leaves a mark."""
    (tmp_path / "train.py").write_text("open('trained', 'w').write('yes')\n")
    job_id = str(40000 + free_port() % 20000)
    tag = f"sbatch-{job_id}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1",
               SLURM_CPUS_PER_TASK="2", SLURM_NTASKS="1", DDPDOCTOR_REPORTS=str(tmp_path / "reports"),
               **{TAG_VAR: tag}, **extra)
    # Its own session: on a timeout the whole script (torchrun, its ranks) is killed, not bash alone.
    proc = subprocess.Popen(["bash", str(SLURM_DOCS / script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not tagged_processes(tag)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, tmp_path / "reports" / f"preflight-{job_id}-0.json"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="fakes a grant of 2 GPUs on a machine torch sees none on")
@pytest.mark.slow
def test_the_single_node_script_reads_the_gpus_slurm_granted_and_trains_on_a_warning(tmp_path):
    """Default twin: tests/ranks/test_slurm_scripts.py::test_the_single_node_script_does_not_train_after_a_critical_finding
    (the same batch script, torchrun pre-flight and exit-code branch; there exit 2 stops training, here
    exit 1 trains. GPU006 from a Slurm grant: tests/ranks/test_gpu_count_e2e.py)
    """
    # A GPU allocation as Slurm describes it; this machine's torch sees none: GPU006, a warning.
    done, report = run_batch_script(tmp_path, "preflight-single-node.sbatch", SLURM_GPUS_ON_NODE="2",
                                    SLURM_JOB_GPUS="0,1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads(report.read_text())
    assert found["exit_code"] == 1 and found["mode"] == "torchrun" and found["world_size"] == 2
    [granted] = [f for f in found["findings"] if f["code"] == "GPU006"]
    assert granted["ranks"] == [0, 1] and granted["evidence"]["SLURM_JOB_GPUS"] == "0,1"
    assert "training anyway" in done.stdout and (tmp_path / "trained").exists()


def test_the_single_node_script_does_not_train_after_a_critical_finding(tmp_path):
    done, report = run_batch_script(tmp_path, "preflight-single-node.sbatch", DDPDOCTOR_NPROC="2",
                                    DDPDOCTOR_ARGS="--inject crash:rank=1:stage=ddp")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(report.read_text())["exit_code"] == 2
    assert "not training" in done.stderr and not (tmp_path / "trained").exists()
