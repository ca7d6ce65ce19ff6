"""Shared test settings: rank-spawning tests must never inherit a launcher's variables."""

import os

import pytest

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "DDPDOCTOR_INJECT",
               "DDPDOCTOR_LAUNCHER_PID", "DDPDOCTOR_BACKEND", "DDPDOCTOR_DEVICE", "DDPDOCTOR_RUN_ID")


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    os.environ.pop("COLUMNS", None)
