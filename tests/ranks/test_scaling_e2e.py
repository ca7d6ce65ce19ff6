"""End to end on real gloo CPU ranks: `ddpdoctor scaling`, and `--model` in `check`.

The efficiency in the report is recomputed here from the ranks' own step medians; a rank
slowed by injection (its forward and backward really take 3x) lowers it and is named.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from .harness import TAG_VAR, assert_nothing_left, free_port, probe_section, run_command, tagged_processes

pytestmark = pytest.mark.ranks
TINY = str(Path(__file__).resolve().parent / "tiny_model.py")
sys.path.insert(0, str(Path(TINY).parent))
import tiny_model  # noqa: E402


def scaling(tmp_path: Path, *args: str):
    cmd = [sys.executable, "-m", "ddpdoctor", "scaling", "--no-live", "--json", str(tmp_path / "s.json"),
           "--port", str(free_port()), *args]
    return run_command(cmd, tmp_path, report_name="s.json", timeout_s=120)


def test_scaling_of_the_users_model_names_the_slow_rank_from_the_ranks_steps(tmp_path):
    # One run for three points of the issue: the user's own model trains at every size, the
    # efficiency is what the ranks' step medians say, and a rank slowed by injection (its
    # forward and backward really take 6x) lowers it and is named as the cause. At 3x the tiny
    # model's straggler cost (about 1.3 ms a step) equalled gloo's unhidden all-reduce on 2 cores
    # (1.3 ms), so which cause came first was noise: the fault must dominate to be the cause.
    run = scaling(tmp_path, "--nproc", "2", "--seconds", "0.4", "--lr", "0.1", "--inject", "slow:rank=1:factor=6",
                  "--model", f"{TINY}:make_model", "--batch", f"{TINY}:make_batch")
    assert run.returncode == 1, run.explain()
    facts = probe_section(run.report, "scaling")["facts"]
    assert {f["parameters"] for f in facts.values()} == {tiny_model.parameter_count()}  # the user's model trained
    assert sorted(facts["0"]["sizes"]) == ["1", "2"] and sorted(facts["1"]["sizes"]) == ["2"]
    # samples/s at n = n x batch / the slowest rank's median step; efficiency = speedup / n.
    one = facts["0"]["sizes"]["1"]["step_ms"]
    two = max(facts[r]["sizes"]["2"]["step_ms"] for r in ("0", "1"))
    expected = 100.0 * (2 * 32 / two) / (32 / one) / 2
    [finding] = run.findings("SCL001")
    assert f"is {expected:.0f}%" in finding["title"], (expected, finding["title"])
    assert finding["ranks"] == [1] and "rank 1 is a straggler" in finding["title"], finding["title"]
    worst = finding["evidence"]["at_worst_size"]
    assert worst["efficiency_pct"] < 60 and worst["loss_ms"]["straggler"] > worst["loss_ms"]["comm"]
    # The slow rank really computed slower when alone (no_sync steps), not only waited.
    alone = {r: facts[r]["sizes"]["2"]["forward_alone_ms"] + facts[r]["sizes"]["2"]["backward_alone_ms"]
             for r in ("0", "1")}
    assert alone["1"] > 2 * alone["0"], alone
    codes = {f["code"]: f for f in run.findings()}
    assert "defaults (bucket_cap_mb=25)" in codes["SCL002"]["evidence"]["ms_per_batch"]
    assert codes["SCL003"]["evidence"]["linear_rule_lr"] == 0.2
    assert "samples/s" in run.stdout and "efficiency" in run.stdout
    assert_nothing_left(run)


def test_the_python_api_runs_check_with_the_users_functions(monkeypatch):
    """Kept in the default tier: the one default run through ddpdoctor.api (its subprocess and the report
    read back); api.factory_spec's refusals are tests/unit/test_user_model.py's."""
    from ddpdoctor import api

    from . import tiny_model as packaged  # importable by name from the repository root

    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert api.factory_spec(packaged.make_model, "model") == "tests.ranks.tiny_model:make_model"
    report = api.check(model=packaged.make_model, batch=packaged.make_batch, nproc=2, probes="ddp-smoke")
    assert report["exit_code"] == 0, report["stdout"]
    facts = probe_section(report, "ddp-smoke")["facts"]
    assert {f["parameters"] for f in facts.values()} == {tiny_model.parameter_count()}
    assert len({f["param_sha256"] for f in facts.values()}) == 1
    assert not tagged_processes(tag)
