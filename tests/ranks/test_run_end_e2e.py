"""The end of the run (issue 53) on real ranks: short runs whose faults only the end can name, a rank gone before
the end, and the summary, in the JSON and on rank 0's stderr.

Every run here is shorter than the live checks need (a straggler is said live once the checks have named it for
2 s, from the third check): what is named, is named at the end. Each fault has a floor every host keeps (a sleep
or a spin that ends by the clock is never shorter), and the run's steps are sized from it, so that the end's
evidence spans CONFIRM_S of the job on a host twice as fast as this one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ddpdoctor.callback.doctor import CONFIRM_S, ONLINE_MIN_STEPS
from ddpdoctor.callback.final_check import FINAL_WAIT_CAP_S

from .harness import _env, free_port, run_script_ranks, tagged_processes

pytestmark = pytest.mark.ranks
LOOP = Path(__file__).with_name("doctor_loop.py")
BATCHES = 8  # doctor_loop.py's batches per rank and epoch
DEFAULTS = {"every": "50", "check-every-s": "2"}  # the Doctor's own: doctor_loop.py checks by steps otherwise


def epochs_for(floor_ms: float) -> int:
    """Epochs whose steps after the first (the end judges windows of more than one step) last CONFIRM_S on any
    host, each step at least `floor_ms`, with a quarter more for the first windows' gaps; ONLINE_MIN_STEPS at least."""
    steps = max(ONLINE_MIN_STEPS, math.ceil(1.25 * CONFIRM_S * 1e3 / floor_ms)) + 1
    return math.ceil(steps / BATCHES)


def run_loop(tmp_path: Path, case: str, timeout_s: float = 90, spawn: int = 0, torchrun: bool = False,
             srun: bool = False, **flags: str) -> dict:
    report = tmp_path / f"{case.replace(',', '-')}.json"
    args = ["--case", case, "--json", str(report), *(f"--{k}={v}" for k, v in (DEFAULTS | flags).items())]
    began = time.monotonic()
    port = free_port()
    if spawn:
        results = run_spawned([*args, "--spawn", str(spawn), "--port", str(port)], timeout_s)
    elif torchrun:  # torchrun's agent serves the store: the end's rows go through it
        results = run_spawned(args, timeout_s, ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                                "--master_port", str(port)])
    else:
        results = run_script_ranks(LOOP, args, {0: port, 1: port}, timeout_s, srun=srun)
    return {"exit": [rc for rc, _ in results], "stderr": [err for _, err in results],
            "report": json.loads(report.read_text()) if report.exists() else None, "took_s": time.monotonic() - began}


def run_spawned(args: list[str], timeout_s: float, launcher: tuple[str, ...] | list[str] = ()) -> list[tuple[int, str]]:
    """The loop as one process that starts its ranks: with mp.spawn (nothing of torchrun's in its environment), or
    under `launcher` (torchrun's module and its flags)."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, *launcher, str(LOOP), *args], env=_env(tag, {}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not tagged_processes(tag), "processes left behind"
    return [(proc.returncode, err)]


def by_code(report: dict) -> dict[str, dict]:
    return {f["code"]: f for f in report["findings"]}


@pytest.mark.parametrize("launch", ["env", pytest.param("srun", marks=pytest.mark.slow)])
def test_slow_data_and_a_missing_set_epoch_are_named_at_the_end_of_a_short_run(tmp_path, launch):
    """Rank 1's loader sleeps 20 ms a step; set_epoch is never called. 20 epochs (161 steps): checks at step 1
    and about step 100, never a third, so the live rules never judge a straggler: the end does. `srun`: the
    tasks as srun starts them (SLURM_PROCID, no RANK), the script's tcp:// rendezvous serving the end's store
    (slow tier: test_a_rank_gone_before_the_end_is_named_and_costs_no_wait[srun] crosses that path)."""
    epochs = epochs_for(20.0)
    result = run_loop(tmp_path, "slowdata,noepoch", epochs=str(epochs), srun=launch == "srun", **{"slow-ms": "20"})
    assert result["exit"] == [0, 0], result["stderr"][0][-3000:]
    report = result["report"]
    found = by_code(report)
    assert found["STR001"]["ranks"] == [1] and found["STR001"]["evidence"]["cause"] == "data loading", found
    assert found["STR001"]["evidence"]["judged_at_end"]["job_s"] >= CONFIRM_S
    assert found["DOC003"]["ranks"] == [0, 1]
    s = report["summary"]
    # One verdict first: the straggler (critical at this size) leads; the figures are its evidence.
    assert s["code"] == "STR001" and s["verdict"].startswith("STR001 (rank 1)"), s["verdict"]
    assert s["steps"] == epochs * BATCHES and [r["steps"] for r in s["ranks"]] == [epochs * BATCHES] * 2
    slow, waiting = s["ranks"][1], s["ranks"][0]
    assert slow["data_pct"] > 50 > waiting["data_pct"], s["ranks"]  # rank 1 loads; rank 0 waits for it
    assert waiting["wait_pct"] > slow["wait_pct"]
    assert slow["step_ms_median"] >= 20.0 and s["lost_to_slowest"]["rank"] == 1 and s["lost_to_slowest"]["straggler"]
    assert s["final_check"]["missing"] == [] and s["samples_per_s"] > 0
    assert s["stragglers_judged"]["judged"] and s["stragglers_judged"]["job_s"] >= CONFIRM_S
    err = result["stderr"][0]
    assert "ddpdoctor end of run: STR001 (rank 1)" in err and "samples/s" in err and "fix:" in err


def test_a_compute_straggler_in_backward_is_named_at_destroy_process_group_under_mp_spawn(tmp_path):
    """mp.spawn's tutorial setup; rank 1 spins 25 ms inside its backward pass; the script never closes the Doctor,
    it only calls dist.destroy_process_group(): the end of the run is judged there, the summary written."""
    result = run_loop(tmp_path, "backward", spawn=2, epochs=str(epochs_for(25.0)), end="destroy",
                      **{"spin-ms": "25"})
    assert result["exit"] == [0], result["stderr"][0][-3000:]
    report = result["report"]
    found = by_code(report)
    assert found["STR001"]["ranks"] == [1] and found["STR001"]["evidence"]["cause"] == "compute", found
    s = report["summary"]
    assert s["code"] == "STR001" and s["ranks"][1]["compute_pct"] > s["ranks"][0]["compute_pct"], s["ranks"]
    assert s["ranks"][0]["wait_pct"] > 50, s["ranks"]  # rank 0 waits in the all-reduce for rank 1's backward


@pytest.mark.parametrize("launch", ["env", pytest.param("torchrun", marks=pytest.mark.slow),
                                    pytest.param("srun", marks=pytest.mark.slow)])
def test_a_rank_gone_before_the_end_is_named_and_costs_no_wait(tmp_path, launch):
    """Rank 1 exits after its last step without closing (a crash after training): rank 0 names it dead at once
    (its process is gone from this host), reports, and leaves; nothing is left behind. Under torchrun (slow tier
    since the pictures' tests joined the default run) the rows go through the store its agent serves, whose
    default path test_run_command_e2e.py's around-torchrun test crosses (its workers' end exchange); srun's
    (slow tier) through the script's tcp:// rendezvous, whose default path test_run_command_e2e.py's srun test
    crosses."""
    result = run_loop(tmp_path, "nosampler,die", epochs="2", torchrun=launch == "torchrun", srun=launch == "srun")
    assert set(result["exit"]) == {0}, result["stderr"][0][-3000:]
    report = result["report"]
    missing = by_code(report)["DOC021"]
    assert missing["ranks"] == [1] and missing["severity"] == "critical", missing
    assert missing["evidence"]["fate_by_rank"] == {"1": "dead"} and missing["evidence"]["arrived_ranks"] == [0]
    s = report["summary"]
    assert s["verdict"].startswith("DOC021 (rank 1)") and s["ranks"][1]["missing"] == "dead"
    assert s["final_check"]["waited_ms"] < 1e3 * FINAL_WAIT_CAP_S


def test_an_unsharded_loader_is_named_at_the_end_of_a_sixteen_step_run(tmp_path):
    """No DistributedSampler: the same batch on both ranks at the first step's check and again at the end (two
    checks in a row, a step apart at least), in a run too short for a second live check."""
    result = run_loop(tmp_path, "nosampler", epochs="2")
    assert result["exit"] == [0, 0], result["stderr"][0][-3000:]
    report = result["report"]
    found = by_code(report)
    assert found["DOC001"]["ranks"] == [0, 1] and found["DOC001"]["severity"] == "critical", found
    assert report["summary"]["code"] == "DOC001" and not [f for f in report["findings"] if f["code"].startswith("STR")]
    # Too short to judge a straggler, and the summary says so rather than call the run's speed healthy.
    judged = report["summary"]["stragglers_judged"]
    assert not judged["judged"] and judged["steps_per_rank"] < judged["needs_steps"], judged
    assert "stragglers not judged" in result["stderr"][0]
