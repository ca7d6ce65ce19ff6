"""The job scripts in docs/slurm: valid bash, and their pre-flight line runs as srun would run it.

srun starts one process per task with SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, the node list
and the job id set; nothing else is faked here. Without Slurm on this machine the line's command
is started that way by hand, on one node ("localhost"), two tasks.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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
