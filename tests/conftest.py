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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-fault-matrix", action="store_true",
                     help="after the run, write docs/fault-matrix.md from the fault-matrix cells that ran")


@pytest.fixture(scope="session")
def fault_matrix_results(tmp_path_factory: pytest.TempPathFactory):
    from tests.ranks.fault_matrix import results_dir

    return results_dir(tmp_path_factory.getbasetemp())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("--write-fault-matrix"):
        return
    from pathlib import Path

    from tests.ranks.fault_matrix import load, render_doc, results_dir

    results = load(results_dir(session.config._tmp_path_factory.getbasetemp()))
    if results:
        doc = Path(__file__).resolve().parent.parent / "docs" / "fault-matrix.md"
        doc.write_text(render_doc(results))
