"""`ddpdoctor.watch()` in real rank processes: who never arrived at init_process_group, and why.

Ranks started with hand-set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as torchrun or srun would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import free_port, run_script_ranks

pytestmark = pytest.mark.ranks
JOB = Path(__file__).with_name("watch_job.py")


def start(tmp_path: Path, case: str, ports: dict[int, int]) -> dict:
    report = tmp_path / "watch.json"
    results = run_script_ranks(JOB, ["--case", case, "--json", str(report)], ports)
    found = {}
    for r in ports:
        path = Path(f"{report}.rank{r}")
        if path.exists():
            found[r] = json.loads(path.read_text())["findings"][0]
    return {"exit": [rc for rc, _ in results], "stderr": [e for _, e in results], "findings": found}


@pytest.mark.slow
def test_a_rank_stuck_before_init_and_one_given_another_port_are_each_named(tmp_path):
    """Default twin: tests/ranks/test_launch_styles_e2e.py::test_watch_reads_rank_world_and_rendezvous_from_the_init_call
    (the same watch() in a rank process naming WATCH001 the ranks that never called init_process_group;
    there one rank of 2, its target from the call, here 3 hand-set ranks, with the unreachable and stuck ones)
    """
    # (A healthy start under watch() is tests/ranks/test_doctor_e2e.py's correct loop.)
    port, wrong = free_port(), free_port()
    result = start(tmp_path, "noshow", {0: port, 1: wrong, 2: port})
    assert result["exit"] == [124, 124, 124], result["stderr"]
    waiting = result["findings"][0]
    assert waiting["code"] == "WATCH001" and waiting["ranks"] == [1, 2], waiting
    assert "1 of 3 ranks called it; rank 1-2 never did" in waiting["title"]
    assert waiting["evidence"]["never_arrived"] == [1, 2] and list(waiting["evidence"]["arrived"]) == ["0"]
    unreachable = result["findings"][1]
    assert "cannot reach the rendezvous" in unreachable["title"] and "connection refused" in unreachable["title"]
    stuck = result["findings"][2]
    assert "has not called init_process_group" in stuck["title"] and "watch_job.py" in stuck["evidence"]["stuck_at"]
